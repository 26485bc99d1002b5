#!/usr/bin/env bash
# One H200 call (device tool) proving the restructure changed no result: the kernel check at full shapes,
# the GPU kernel tests and one engine decode run, compared with the committed records of the flat layout
# (results/kernels/h200.json, results/engine/h200-olmoe-grouped-asm.json). The committed run of this script
# (results/restructure/) used the engine script of that time; it is now the runmap bench headline.
#   bash benchmarks/restructure_check_h200.sh      (writes $OUT/restructure/...)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-/tmp/restructure-out}"
R="$OUT/restructure"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader | tee "$R/gpu.txt"
S=$(date +%s)
timeout 150 python3 -m runmap.cli.check_kernels --device cuda --shapes full --no-progress --out "$R/check-h200.json" \
  > "$R/check.log" 2>&1; echo "check rc=$? $(( $(date +%s) - S ))s"
# the engine decode run goes through runmap bench now (the flat layout's run used the old engine script)
ONLY='^olmoe__engine__grouped__r64__b1__p32__d256$' RUNMAP_WORK=/tmp/rmbench OUT="$R" \
  bash benchmarks/engine_headline_h200.sh > "$R/engine.log" 2>&1; echo "engine rc=$? $(( $(date +%s) - S ))s"
RUNMAP_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
  > "$R/pytest.log" 2>&1; echo "pytest rc=$? $(( $(date +%s) - S ))s"
tail -n 3 "$R/check.log"; tail -n 30 "$R/engine.log"; tail -n 3 "$R/pytest.log"
