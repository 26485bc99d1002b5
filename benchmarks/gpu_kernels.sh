#!/usr/bin/env bash
# One H200 call for issue 3: kernel check record (full shapes), benchmark, GPU pytest. Logs and JSON go to $OUT.
#   (device tool) bash benchmarks/gpu_kernels.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-/tmp/kernels-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
S=$(date +%s)
timeout "${CHECK_S:-120}" python3 -m runmap.cli.check_kernels --device cuda --shapes full --no-progress \
  --out "$OUT/h200.json" > "$OUT/check.log" 2>&1; echo "check rc=$? $(( $(date +%s) - S ))s"
timeout "${BENCH_S:-170}" python3 benchmarks/bench_kernels.py --out "$OUT/bench-h200.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - S ))s"
RUNMAP_TEST_DEVICE=cuda timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$? $(( $(date +%s) - S ))s"
tail -n 4 "$OUT/check.log"; grep -E "FAIL|Error" "$OUT/check.log" | head -5
tail -n 25 "$OUT/bench.log"; tail -n 15 "$OUT/pytest.log"
