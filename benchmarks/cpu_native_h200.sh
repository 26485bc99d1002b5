#!/usr/bin/env bash
# One device call (issue 25 item 1 and the placement rows of item 6; issue 18's pending GPU checks): the
# cpu-native site's tests on the host (its compiler, its CPU), the GPU tests of the prefill graphs, warm-up and
# budget paths, the CPU site's rate against the host read for cpu-native and cpu-int4 in the same call, then the
# h200-cpu-native campaign (batch-1 placements with the cpu-native site):
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/cpu_native_h200.sh [BUDGET_S]     (repo root, $OUT set)
#
# Files back: native-pytest.log, gpu-pytest.log, cpu-native.log, h200-host-native.json, cpu-int4.log,
# h200-host-int4.json, h200-campaign.tar.gz, bench.log (and prepare-olmoe.log).
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
BUDGET=${1:-570}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p "$OUT"
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_cpu_native.py > "$OUT/native-pytest.log" 2>&1
step "host pytest (test_cpu_native) exit $?"; tail -2 "$OUT/native-pytest.log"
RUNMAP_TEST_DEVICE=cuda timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_graph.py \
  tests/test_gpu_budget.py tests/test_engine.py -k "warm_up or prefill or graph or budget" \
  > "$OUT/gpu-pytest.log" 2>&1
step "gpu pytest (prefill graphs, warm-up, budget) exit $?"; tail -3 "$OUT/gpu-pytest.log"
timeout 110 python3 benchmarks/bench_cpu_experts.py --executor cpu-native --out "$OUT/h200-host-native.json" \
  --shapes olmoe,qwen1.5-moe --threads all,8,1 --passes 2 --mode-seconds 2 --bandwidth-repeats 5 \
  > "$OUT/cpu-native.log" 2>&1
step "cpu-native rate exit $?"; tail -11 "$OUT/cpu-native.log"
timeout 70 python3 benchmarks/bench_cpu_experts.py --executor cpu-int4 --out "$OUT/h200-host-int4.json" \
  --shapes olmoe --threads all --passes 1 --mode-seconds 2 --bandwidth-repeats 5 > "$OUT/cpu-int4.log" 2>&1
step "cpu-int4 rate exit $?"; tail -5 "$OUT/cpu-int4.log"
RUNMAP_SPEC=specs/campaigns/h200-cpu-native.yaml RUNMAP_DIRECT="olmoe=olmoe-1b-7b-0924" RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( BUDGET - $(date +%s) + T0 ))
rm -f "$OUT/prepare-qwen.log"
