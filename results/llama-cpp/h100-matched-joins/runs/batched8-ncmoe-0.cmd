/tmp/runmap-llama/build-dffa4990f863-cuda/bin/llama-batched-bench -m /tmp/runmap-llama/olmoe-1b-7b-0924-Q4_K_M.gguf -c 4096 -b 512 -ub 512 -npp 32 -ntg 128 -npl 8 -ngl 99 -fa on --output-format jsonl
