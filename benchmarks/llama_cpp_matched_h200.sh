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
# RUNMAP_MATCHED_DIRECT=1 fits both in one call on a cold machine (llama.cpp's build and conversion take ~355 s): the
# engine's pack is synthesized directly (random INT4 codes, `runmap synth --direct-pack`) in the background while
# llama.cpp builds, instead of packed from llama.cpp's checkpoint; under the calibrated routing workload the ids do not
# depend on the weights and the kernels' time does not depend on their values, so the rows' speed is comparable; the
# records say "synthesized-direct pack".
# RUNMAP_MATCHED_MODEL=qwen (default olmoe): Qwen1.5-MoE-A2.7B instead, with specs/campaigns/h200-llama-matched-qwen.yaml
# and llama.cpp's --n-cpu-moe 0 / 6 / 12 / 18 / 24 of its 24 layers. Its bf16 checkpoint + bf16 GGUF need ~57 GB of
# disk at the conversion's peak, so the engine's direct pack (~8 GB) is synthesized after llama.cpp's rows, not beside
# them, and a cold machine needs two calls (the spec's budget_note).
# RUNMAP_MATCHED_SPEC=<spec> runs that spec's engine rows instead (specs/campaigns/two-site-matched.yaml: placement
# two-site against host-read at --n-cpu-moe 8 / 12 / 16).
# Files back: llama-cpp.tar.gz + llama-cpp/steps.log, h200-campaign.tar.gz, bench.log, prepare-*.log.
set -uo pipefail
BUDGET=${1:-570}
LLAMA_BUDGET=${2:-210}
T0=$(date +%s)
: "${OUT:?set OUT to the directory whose files come back}"
MODEL=${RUNMAP_MATCHED_MODEL:-olmoe}
case "$MODEL" in
  olmoe) PRESET=olmoe-1b-7b-0924; SPEC=specs/campaigns/h200-llama-matched.yaml; NCMOE="0 4 8 12 16";;
  qwen) PRESET=qwen1.5-moe-a2.7b; SPEC=specs/campaigns/h200-llama-matched-qwen.yaml; NCMOE="0 6 12 18 24";;
  *) echo "RUNMAP_MATCHED_MODEL=$MODEL: choose olmoe or qwen"; exit 2;;
esac
SPEC=${RUNMAP_MATCHED_SPEC:-$SPEC}  # another spec of the engine's rows at the same budgets (e.g. two-site-matched.yaml)
export RUNMAP_LLAMA_PRESET=$PRESET RUNMAP_LLAMA_NCMOE=${RUNMAP_LLAMA_NCMOE:-$NCMOE}
DIRECT=()
if [ "${RUNMAP_MATCHED_DIRECT:-0}" = 1 ]; then
  WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
  mkdir -p "$WORK"
  if [ "$MODEL" = olmoe ]; then  # beside llama.cpp's build (run_h200_campaign.sh synthesizes it otherwise, after)
    PYTHONPATH=. python3 -m runmap synth "$WORK/pk-$MODEL" --preset "$PRESET" --direct-pack --force --no-progress \
      > "$OUT/synth-$MODEL.log" 2>&1 &
    SYNTH_PID=$!
  fi
  DIRECT=(env RUNMAP_DIRECT="$MODEL=$PRESET")
fi
echo "[0s] llama.cpp rows ($PRESET, --n-cpu-moe $RUNMAP_LLAMA_NCMOE; budget ${LLAMA_BUDGET}s)"
bash benchmarks/llama_cpp_h200.sh "$LLAMA_BUDGET"
echo "[$(( $(date +%s) - T0 ))s] llama.cpp done; the engine's matched rows"
if [ -n "${SYNTH_PID:-}" ] && ! wait "$SYNTH_PID"; then
  echo "direct synthesis of the engine's pack failed (run_h200_campaign.sh tries once more):"; tail -3 "$OUT/synth-$MODEL.log"
fi
"${DIRECT[@]}" env RUNMAP_SPEC="$SPEC" RUNMAP_MODELS="$MODEL" \
  bash benchmarks/run_h200_campaign.sh $(( BUDGET - $(date +%s) + T0 ))
