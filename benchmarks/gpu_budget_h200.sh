#!/usr/bin/env bash
# The H200 records of `--gpu-budget` (issue 24, item 6) and where a partial-residency segment step's host time goes
# (tools/explore/probe_segment_phases.py), in one device call (~6 min):
#   PYTHONPATH=. bash benchmarks/gpu_budget_h200.sh        # writes $OUT/gpu-budget-h200.json, $OUT/*.log
# PHASES=0 PARTIAL=0 runs the budgets alone; OLMOE_BUDGETS / QWEN_BUDGETS (GiB, comma-separated) choose them;
# DIRECT=1 synthesizes the packs directly; BUDGET_TIMEOUT bounds gpu_budget.py (its record keeps every row it measured).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/runmap-out} WORK=${RUNMAP_WORK:-/tmp/runmap-work}
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
prepare() {  # NAME PRESET: a synthetic checkpoint packed, or with DIRECT=1 a pack synthesized directly (random INT4
  # codes, `runmap synth --direct-pack`: seconds instead of minutes; the calibrated routing imposes every route, so
  # the memory and the work measured here do not depend on the values)
  if [ "${DIRECT:-0}" = 1 ]; then
    python3 -m runmap synth "$WORK/pk-$1" --preset "$2" --direct-pack --force --no-progress
  else
    python3 benchmarks/prepare_pack.py "$1" "$2" "$WORK"
  fi
}
prepare olmoe olmoe-1b-7b-0924 > "$OUT/prepare-olmoe.log" 2>&1 &
P1=$!
prepare qwen qwen1.5-moe-a2.7b > "$OUT/prepare-qwen.log" 2>&1 &
P2=$!
wait $P1; R1=$?
wait $P2; R2=$?  # both packs first: the phase probe's timings must not share the machine with a pack build
cat "$OUT/prepare-olmoe.log" "$OUT/prepare-qwen.log"
echo "[$(( $(date +%s) - T0 ))s] packs: olmoe exit $R1, qwen exit $R2"
if [ "${PHASES:-1}" = 1 ] && [ "$R1" = 0 ]; then
  mkdir -p /tmp/probe && ln -sfn "$WORK/pk-olmoe" /tmp/probe/pk-olmoe-1b-7b-0924
  timeout 200 python3 tools/explore/probe_segment_phases.py --work /tmp/probe --out "$OUT/segment-phases-h200.json" \
    > "$OUT/segment-phases-h200.log" 2>&1
  R=$?  # read before the next command substitution resets $?
  echo "[$(( $(date +%s) - T0 ))s] phases: exit $R"
  grep -v "^ *$" "$OUT/segment-phases-h200.log" | grep "tok/s\|segment\|_acquire\|_release \|_transaction\|upload\|copy_rows"
fi
if [ "${PARTIAL:-1}" = 1 ] && [ "$R1" = 0 ]; then  # the same configurations without instrumentation
  timeout 200 python3 tools/explore/probe_partial_decode.py --work /tmp/probe --resident 64,30,48 \
    --out "$OUT/probe-partial-h200.json" > "$OUT/probe-partial-h200.log" 2>&1
  R=$?
  echo "[$(( $(date +%s) - T0 ))s] partial probe: exit $R"
  grep "^{" "$OUT/probe-partial-h200.log" | cut -c1-220
fi
ARGS=()
[ "$R1" = 0 ] && ARGS+=(--pack "olmoe=$WORK/pk-olmoe" --budgets "olmoe=${OLMOE_BUDGETS:-3,4,6,12}")
[ "$R2" = 0 ] && ARGS+=(--pack "qwen=$WORK/pk-qwen" --budgets "qwen=${QWEN_BUDGETS:-6,8,10,16}")
timeout ${BUDGET_TIMEOUT:-280} python3 benchmarks/gpu_budget.py "${ARGS[@]}" --out "$OUT/gpu-budget-h200.json" \
  2>&1 | tee "$OUT/gpu-budget-h200.log" | grep -v "^gpu budget"
echo "[$(( $(date +%s) - T0 ))s] gpu budget: exit ${PIPESTATUS[0]}"
