/tmp/runmap-llama/build-dffa4990f863-cuda/bin/llama-bench -m /tmp/runmap-llama/olmoe-1b-7b-0924-Q4_K_M.gguf -p 0 -n 128 -b 1 -ub 1 -ngl 99 -fa on -ncmoe 8 -o json
