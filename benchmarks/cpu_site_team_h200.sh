#!/usr/bin/env bash
# One device call: the decode chain's CPU part with the caller's OpenMP team kept as it is and shrunk
# (runmap/engine/engine.py Engine.hand_cpu_site_cores; RUNMAP_CPU_SITE_CALLER_TEAM=keep|shrink), A, B, A, B while the
# budget allows, each a run of the h200-placement-split campaign's CPU-placement and emulated-13-GB/s rows
# (issue 25 items 1 and 6) on one directly synthesized OLMoE pack:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/cpu_site_team_h200.sh [BUDGET_S]     (repo root, $OUT set)
#
# Files back: <mode>-<round>/{h200-campaign.tar.gz,bench.log,...} for mode keep / shrink and round 1, 2.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
BUDGET=${1:-560}
T0=$(date +%s)
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
ONLY=${RUNMAP_ONLY:-'placement-cpu|link13gbs'}
for round in 1 2; do
  for mode in keep shrink; do
    if [ "$(left)" -lt 150 ]; then echo "stopping before $mode-$round: $(left) s left"; break 2; fi
    echo "=== $mode-$round ($(left) s left)"
    RUNMAP_CPU_SITE_CALLER_TEAM=$mode OUT="$OUT/$mode-$round" RUNMAP_SPEC=specs/campaigns/h200-placement-split.yaml \
      RUNMAP_DIRECT="olmoe=olmoe-1b-7b-0924" RUNMAP_MODELS=olmoe RUNMAP_ONLY="$ONLY" \
      bash benchmarks/run_h200_campaign.sh $(( $(left) < 200 ? $(left) - 20 : 180 )) 2>&1 | grep -E "tok/s|done|FAILED|===" 
  done
done
