#!/usr/bin/env bash
# llama.cpp and the engine at the same GPU expert bytes, in ONE device call (issue 25 item 6):
#
#   bash benchmarks/llama_cpp_matched_h200.sh [BUDGET_S] [LLAMA_BUDGET_S]     (repo root, $OUT set;
#                                                                             the device tool: carry=[".llama-cpp"])
#
# 1. benchmarks/llama_cpp_h200.sh LLAMA_BUDGET_S (default 210): llama-bench tg128 at batch 1 and
#    llama-batched-bench at batch 8, full GPU and --n-cpu-moe 4 / 8 / 12 / 16. Within that budget only on a machine
#    left warm by a first call of that script (it keeps the CUDA build and the Q4_K_M GGUF in /tmp/runmap-llama);
#    a cold machine spends ~450 s building and converting and the engine's rows below get what is left;
# 2. benchmarks/run_h200_campaign.sh with specs/campaigns/h200-llama-matched.yaml for the rest of BUDGET_S
#    (default 570): the same synthetic checkpoint (seed 0, routing init) packed, the engine's rows under the
#    calibrated routing workload at each llama.cpp row's GPU expert bytes (config.matched_n_cpu_moe).
# Files back: llama-cpp.tar.gz + llama-cpp/steps.log, h200-campaign.tar.gz, bench.log, prepare-*.log.
set -uo pipefail
BUDGET=${1:-570}
LLAMA_BUDGET=${2:-210}
T0=$(date +%s)
: "${OUT:?set OUT to the directory whose files come back}"
echo "[0s] llama.cpp rows (budget ${LLAMA_BUDGET}s)"
bash benchmarks/llama_cpp_h200.sh "$LLAMA_BUDGET"
echo "[$(( $(date +%s) - T0 ))s] llama.cpp done; the engine's matched rows"
RUNMAP_SPEC=specs/campaigns/h200-llama-matched.yaml RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( BUDGET - $(date +%s) + T0 ))
