/tmp/runmap-llama/build-dffa4990f863-cuda/bin/llama-bench -m /tmp/runmap-llama/qwen1.5-moe-a2.7b-Q4_K_M.gguf -p 0 -n 128 -b 1 -ub 1 -ngl 99 -fa on -ncmoe 24 -o json
