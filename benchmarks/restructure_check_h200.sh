#!/usr/bin/env bash
# One H200 call (device tool) proving the restructure changed no result: the kernel check at full shapes,
# the GPU kernel tests and one engine decode run, compared with the committed records of the flat layout
# (results/kernels/h200.json, results/engine/h200-olmoe-grouped-asm.json).
#   bash benchmarks/restructure_check_h200.sh      (writes $OUT/restructure/...)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-/tmp/restructure-out}"
R="$OUT/restructure"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader | tee "$R/gpu.txt"
S=$(date +%s)
timeout 150 python3 -m runmap.cli.check_kernels --device cuda --shapes full --no-progress --out "$R/check-h200.json" \
  > "$R/check.log" 2>&1; echo "check rc=$? $(( $(date +%s) - S ))s"
timeout 300 python3 scripts/bench_engine.py --preset olmoe-1b-7b-0924 --work /tmp/rmbench --executor grouped \
  --alt-executor topk-fused --stages prepare,copy_bw,speed,check,variants --out "$R/engine-h200.json" \
  > "$R/engine.log" 2>&1; echo "engine rc=$? $(( $(date +%s) - S ))s"
RUNMAP_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
  > "$R/pytest.log" 2>&1; echo "pytest rc=$? $(( $(date +%s) - S ))s"
tail -n 3 "$R/check.log"; tail -n 30 "$R/engine.log"; tail -n 3 "$R/pytest.log"
