#!/usr/bin/env bash
# Decode speed under several values of one environment setting, in ONE device call (a lab setting judged end to end
# before it becomes a default):
#
#   AB_VAR=RUNMAP_PDL AB_VALUES="0 1" RUNMAP_GIT_COMMIT=<sha> OUT=$OUT \
#     bash benchmarks/decode_env_ab_h200.sh [BUDGET_S]
#
# from the repo root. "unset" runs without the variable. Steps, each skipped when the budget (default 560 s) runs
# short:
#  1. GPU_TESTS (default none) selected by GPU_K, this tree, on the GPU (a failure is printed, the rows still run);
#  2. PROBE (python3's arguments, default none; {dir} is the archive folder), given what the budget leaves beyond
#     PROBE_KEEP_S (default 300 s);
#  3. packs synthesized directly (real OLMoE-1B-7B / Qwen1.5-MoE-A2.7B dimensions, random INT4 codes);
#  4. for each model of MODELS (default "olmoe qwen"), each value of AB_VALUES in turn: the engine rows of
#     specs/campaigns/h200-floor.yaml (OLMoE) / specs/campaigns/h200-qwen-decode.yaml (Qwen1.5-MoE) at the batch
#     sizes of BATCHES (default "1 8"), full residency, grouped executor, CUDA graphs, 128 + 128 tokens.
# One file back, env-ab.tar.gz: gpu-pytest.log, probe.log (+ what PROBE wrote), bench-{model}-{value}.log and
# campaign-{model}-{value}/ (records, campaign.json); and the console table.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
: "${RUNMAP_GIT_COMMIT:?set RUNMAP_GIT_COMMIT to the commit of this tree}"
: "${AB_VAR:?set AB_VAR to the environment variable under test}"
: "${AB_VALUES:?set AB_VALUES to its values (unset: without it)}"
BUDGET=${1:-560}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
LOGS=/tmp/env-ab
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
MODELS=${MODELS:-olmoe qwen}
BATCHES=${BATCHES:-1 8}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
finish() { tar -czf "$OUT/env-ab.tar.gz" -C "$LOGS" . ; step "archive written"; }
trap finish EXIT
source benchmarks/decode_steps_common.sh

if [ -n "${GPU_TESTS:-}" ]; then
  RUNMAP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS -k "${GPU_K:-}" \
    > "$LOGS/gpu-pytest.log" 2>&1
  step "gpu pytest exit $?"; tail -1 "$LOGS/gpu-pytest.log"
fi
run_probe 300

mkdir -p "$WORK"
batches=$(echo $BATCHES | tr ' ' '|')
for model in $MODELS; do
  case $model in
    olmoe) pack olmoe olmoe-1b-7b-0924; spec=specs/campaigns/h200-floor.yaml;;
    qwen) pack qwen qwen1.5-moe-a2.7b; spec=specs/campaigns/h200-qwen-decode.yaml;;
    *) step "MODELS: unknown model $model (olmoe, qwen): skipped"; continue;;
  esac
  for value in $AB_VALUES; do
    if [ "$(left)" -lt 80 ]; then step "bench $model $AB_VAR=$value skipped ($(left) s left)"; continue; fi
    camp=$WORK/env-ab-$model-$value
    rm -rf "$camp"
    if [ "$value" = unset ]; then envset=(env -u "$AB_VAR"); else envset=(env "$AB_VAR=$value"); fi
    "${envset[@]}" timeout $(( $(left) - 30 )) python3 -m runmap bench "$spec" --pack "$model=$WORK/pk-$model" \
      --only "engine__grouped__r[0-9]+__b($batches)__p128__d128\$" --out "$camp" --no-progress --keep-going \
      > "$LOGS/bench-$model-$value.log" 2>&1
    step "bench $model $AB_VAR=$value exit $?"; grep -E "decode" "$LOGS/bench-$model-$value.log" | tail -4
    mkdir -p "$LOGS/campaign-$model-$value" && cp -r "$camp/." "$LOGS/campaign-$model-$value/" 2>/dev/null
  done
done
