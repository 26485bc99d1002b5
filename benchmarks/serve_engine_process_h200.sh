#!/usr/bin/env bash
# The serve load benchmark with the engine in a child process against the engine in the HTTP process, in ONE
# device call (issue 17, item 6: >= 0.8 of the offline batch decode at 8 and 32 clients):
#
#   OUT=/path/to/out RUNMAP_GIT_COMMIT=<sha> bash benchmarks/serve_engine_process_h200.sh   (repository root)
#
# Runs benchmarks/serve_load_h200.sh (full residency only, RUN_PARTIAL=0) once per mode in MODES (default "on off";
# each run loads and warms up its own server, the second reuses the pack the first built), with the clients of
# CLIENTS (default 8,32) for DURATION_S (default 40) each, and moves each run's record, plot and log to
# $OUT/serve/load/h200-olmoe-full-engine-process-<mode>.{json,png,log}. BUDGET_S (default 520) is shared: each
# run gets an even share of what is left. Carry wheels/ (the server's and the client's packages).
# JOIN_MODES (default "whole"): the server's --join-mode values to run for each mode, in this order (an A/B of join
# modes in one call, e.g. MODES=on JOIN_MODES="whole mixed"); a run of a join mode other than whole is named
# h200-olmoe-full-engine-process-<mode>-<join mode>.{json,png,log}.
set -uo pipefail
T0=$(date +%s)
: "${OUT:?set OUT to the directory the results are written to}"
BUDGET=${BUDGET_S:-520}
MODES=${MODES:-on off}
REC="$OUT/serve/load"
mkdir -p "$REC"
JOINS=${JOIN_MODES:-whole}
set -- $MODES
N=$#
set -- $JOINS
N=$(( N * $# ))
for MODE in $MODES; do
  for JOIN in $JOINS; do
    LEFT=$(( BUDGET - ($(date +%s) - T0) ))
    SHARE=$(( LEFT / N ))
    N=$(( N - 1 ))
    NAME="h200-olmoe-full-engine-process-$MODE"
    [ "$JOIN" = whole ] || NAME="$NAME-$JOIN"
    echo "[$(( $(date +%s) - T0 ))s] engine process $MODE, join mode $JOIN (budget ${SHARE} s)"
    BUDGET_S=$SHARE RUN_PARTIAL=0 FULL_CLIENTS=${CLIENTS:-8,32} FULL_DURATION_S=${DURATION_S:-40} \
      SERVE_LOAD_ARGS="--engine-process $MODE --join-mode $JOIN ${SERVE_LOAD_ARGS:-}" bash benchmarks/serve_load_h200.sh
    for ext in json png log; do
      [ -f "$REC/h200-olmoe-full.$ext" ] && mv "$REC/h200-olmoe-full.$ext" "$REC/$NAME.$ext"
    done
  done
done
ls -l "$REC"
echo "[$(( $(date +%s) - T0 ))s] end"
