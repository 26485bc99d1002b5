#!/usr/bin/env bash
# The load benchmark of `runmap serve` on the H200 (issue 17, item 6) in ONE device call of < 9 minutes:
#
#   OUT=/path/to/out bash benchmarks/serve_load_h200.sh          (from the repository root)
#
# 1. checks that the server's and the clients' packages import (fastapi, uvicorn, pydantic, prometheus-client,
#    openai); when one is missing and ./wheels/ exists, installs them from there only
#    (pip --no-index --find-links wheels/), else stops with one line naming what is missing;
# 2. builds the OLMoE real-dimension synthetic pack as benchmarks/run_h200_campaign.sh does (`runmap synth`
#    seed 0 then `runmap pack`, both on the GPU; the checkpoint is deleted once packed; ~75 s), or reuses
#    $WORK/pk-olmoe when a warm machine already has it (the campaign script's path);
# 3. full residency: 1, 8, 32 and 64 concurrent streaming clients x 60 s (max batch 64), each compared with
#    the engine's offline batch decode at the same batch -> $OUT/serve/load/h200-olmoe-full.{json,png,log};
# 4. partial residency (30 of 64 experts per layer): 8 clients x 30 s (max batch 8)
#    -> $OUT/serve/load/h200-olmoe-r30.{json,png,log}; skipped with a message when the budget has no room left.
#
# Settings (environment): BUDGET_S (default 535: the whole script), RUNMAP_WORK (default /tmp/runmap-h200),
# FULL_CLIENTS (1,8,32,64), FULL_DURATION_S (60), PARTIAL_RESIDENT (30), PARTIAL_CLIENTS (8),
# PARTIAL_DURATION_S (30), MAX_TOKENS (128), OFFLINE_REPEATS (2), OFFLINE_WARMUP (1), CLIENT_PROCS (4),
# RUN_PARTIAL (1; 0 skips step 4), SERVE_LOAD_ARGS (more arguments of both runs). Runs with PYTHONPATH=. (the
# package need not be installed). A CPU rehearsal with the tiny preset:
#   OUT=/tmp/o RUNMAP_WORK=/tmp/w RUNMAP_PRESET_OLMOE=tiny-olmoe RUNMAP_PREP_DEVICE=cpu TRITON_INTERPRET=1 \
#   SERVE_LOAD_ARGS="--executor reference --device cpu --max-seq-len 256" FULL_CLIENTS=1,2 FULL_DURATION_S=2 \
#   PARTIAL_RESIDENT=4 PARTIAL_CLIENTS=2 PARTIAL_DURATION_S=2 MAX_TOKENS=4 bash benchmarks/serve_load_h200.sh
# Commit the records: cp $OUT/serve/load/h200-olmoe-*.json (and the plots) results/serve/load/ (`runmap validate
# $OUT` checks them in place).
set -uo pipefail
T0=$(date +%s)
: "${OUT:?set OUT to the directory the results are written to}"
BUDGET=${BUDGET_S:-535}
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
FULL_CLIENTS=${FULL_CLIENTS:-1,8,32,64}
FULL_DURATION=${FULL_DURATION_S:-60}
PARTIAL_RESIDENT=${PARTIAL_RESIDENT:-30}
PARTIAL_CLIENTS=${PARTIAL_CLIENTS:-8}
PARTIAL_DURATION=${PARTIAL_DURATION_S:-30}
MAX_TOKENS=${MAX_TOKENS:-128}
REPEATS=${OFFLINE_REPEATS:-2}
WARMUP=${OFFLINE_WARMUP:-1}
PROCS=${CLIENT_PROCS:-4}
PRESET=${RUNMAP_PRESET_OLMOE:-olmoe-1b-7b-0924}
PREP_DEVICE=${RUNMAP_PREP_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
elapsed() { echo $(( $(date +%s) - T0 )); }
[ -f benchmarks/serve_load.py ] || { echo "serve_load_h200.sh: run it from the repository root"; exit 1; }
REC="$OUT/serve/load"  # as results/serve/load/ (schemas/serve-load.schema.json claims serve/load/*.json)
mkdir -p "$OUT" "$WORK" "$REC"

# --- 1. packages -------------------------------------------------------------------------------------------
# the pins of pyproject.toml (runmap serve and its tests); pip takes their dependencies from wheels/ too
PINS="fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 prometheus-client==0.26.0 openai==3.57.0"
MODULES="fastapi uvicorn pydantic prometheus_client openai"
missing() {
  python3 - $MODULES <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
MISSING=$(missing)
if [ -n "$MISSING" ] && [ -d wheels ]; then
  echo "[$(elapsed)s] installing from wheels/ (missing: $MISSING)"
  python3 -m pip install -q --no-index --find-links wheels/ $PINS > "$OUT/pip.log" 2>&1 \
    || python3 -m pip install -q --no-index --find-links wheels/ --break-system-packages $PINS >> "$OUT/pip.log" 2>&1 \
    || { echo "serve_load_h200.sh: pip could not install from wheels/ (see $OUT/pip.log): $(tail -1 "$OUT/pip.log")"; exit 1; }
  MISSING=$(missing)
fi
if [ -n "$MISSING" ]; then
  echo "serve_load_h200.sh: missing Python packages: $MISSING ($(python3 -V)); put their wheels (and their dependencies') in ./wheels/ or install $PINS"
  exit 1
fi

# the plots are optional: without matplotlib the records are still written
PLOT_FULL=() PLOT_PARTIAL=()
if python3 -c "import matplotlib" 2>/dev/null; then
  PLOT_FULL=(--plot "$REC/h200-olmoe-full.png") PLOT_PARTIAL=(--plot "$REC/h200-olmoe-r$PARTIAL_RESIDENT.png")
else
  echo "matplotlib not installed: records without plots"
fi

# --- 2. the pack ---------------------------------------------------------------------------------------------
PACK="$WORK/pk-olmoe"
if [ -f "$PACK/manifest.json" ]; then
  echo "[$(elapsed)s] reusing $PACK"
else
  echo "[$(elapsed)s] building $PACK (synthetic $PRESET, seed 0, on $PREP_DEVICE)"
  { python3 -m runmap synth "$WORK/ck-olmoe" --preset "$PRESET" --seed 0 --device "$PREP_DEVICE" --force --no-progress \
    && python3 -m runmap pack "$WORK/ck-olmoe" "$PACK" --device "$PREP_DEVICE" --force --no-progress; } \
    > "$OUT/prepare-olmoe.log" 2>&1
  R=$?
  rm -rf "$WORK/ck-olmoe"
  if [ "$R" != 0 ]; then
    echo "serve_load_h200.sh: building the pack failed (exit $R): $(tail -1 "$OUT/prepare-olmoe.log")"
    exit 1
  fi
fi
echo "[$(elapsed)s] pack ready"

COMMON=(--packed "$PACK" --max-tokens "$MAX_TOKENS" --offline-repeats "$REPEATS" --offline-warmup "$WARMUP"
        --client-procs "$PROCS" ${SERVE_LOAD_ARGS:-})
# --- 3. full residency -----------------------------------------------------------------------------------------
# what the partial run needs at least (load ~15 s, warm-up, its window, its offline runs): kept out of the full run's
# limit. Expected on the H200: pack ~75 s, full run ~330 s (load + warm-up ~50, 4 x ~63 s windows, offline ~25 s),
# partial ~80 s. The records are rewritten after every client count, so a run cut by its limit keeps its points.
PARTIAL_NEED=$(( ${RUN_PARTIAL:-1} == 1 ? PARTIAL_DURATION + 60 : 0 ))
LIMIT=$(( BUDGET - $(elapsed) - PARTIAL_NEED ))
echo "[$(elapsed)s] full residency: clients $FULL_CLIENTS x ${FULL_DURATION} s (limit ${LIMIT} s)"
timeout --signal=INT --kill-after=15 "$LIMIT" python3 benchmarks/serve_load.py "${COMMON[@]}" \
  --clients "$FULL_CLIENTS" --duration-s "$FULL_DURATION" \
  --out "$REC/h200-olmoe-full.json" "${PLOT_FULL[@]}" --label "h200 olmoe full residency" \
  2>&1 | tee "$REC/h200-olmoe-full.log"
echo "[$(elapsed)s] full residency: exit ${PIPESTATUS[0]}"

# --- 4. partial residency --------------------------------------------------------------------------------------
LEFT=$(( BUDGET - $(elapsed) ))
if [ "${RUN_PARTIAL:-1}" != 1 ]; then
  echo "partial residency: skipped (RUN_PARTIAL=${RUN_PARTIAL})"
elif [ "$LEFT" -lt $(( PARTIAL_DURATION + 60 )) ]; then
  echo "partial residency: skipped, ${LEFT} s of the ${BUDGET} s budget left (needs $(( PARTIAL_DURATION + 60 )) s)"
else
  echo "[$(elapsed)s] partial residency $PARTIAL_RESIDENT: $PARTIAL_CLIENTS clients x ${PARTIAL_DURATION} s (limit ${LEFT} s)"
  timeout --signal=INT --kill-after=15 "$LEFT" python3 benchmarks/serve_load.py "${COMMON[@]}" \
    --resident "$PARTIAL_RESIDENT" --clients "$PARTIAL_CLIENTS" --duration-s "$PARTIAL_DURATION" \
    --max-batch "$PARTIAL_CLIENTS" --out "$REC/h200-olmoe-r$PARTIAL_RESIDENT.json" \
    "${PLOT_PARTIAL[@]}" --label "h200 olmoe partial residency $PARTIAL_RESIDENT" \
    2>&1 | tee "$REC/h200-olmoe-r$PARTIAL_RESIDENT.log"
  echo "[$(elapsed)s] partial residency: exit ${PIPESTATUS[0]}"
fi
ls -l "$OUT" "$REC"
echo "[$(elapsed)s] end"
