#!/usr/bin/env bash
# One device call for the segment chain's CPU part on the job thread and auto's split (issue 25 items 2 and 6,
# issue 24 item 8): the placement and segment-chain tests on the GPU (captured chains), the h200-placement-split
# campaign (batch-1 placements at 30 / 32 / 16 of 64 and over an emulated 13 GB/s link), then where the host time of
# a step goes (tools/explore/probe_segment_phases.py on the campaign's pack) while the budget allows:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/placement_split_h200.sh [BUDGET_S]     (repo root, $OUT set)
#
# Files back: gpu-pytest.log, h200-campaign.tar.gz, bench.log, prepare-olmoe.log, phases.log, phases.json.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
BUDGET=${1:-570}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p "$OUT"
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
RUNMAP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_placement.py \
  tests/test_segment_decode.py -k "chain or segment or split" > "$OUT/gpu-pytest.log" 2>&1
step "gpu pytest (placement chain, segment decode) exit $?"; tail -3 "$OUT/gpu-pytest.log"
RUNMAP_SPEC=specs/campaigns/h200-placement-split.yaml RUNMAP_DIRECT="olmoe=olmoe-1b-7b-0924" RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( $(left) - 100 ))
rm -f "$OUT/prepare-qwen.log"
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
if [ "$(left)" -gt 60 ] && [ -f "$WORK/pk-olmoe/manifest.json" ]; then
  mkdir -p /tmp/probe && ln -sfn "$WORK/pk-olmoe" /tmp/probe/pk-olmoe-1b-7b-0924
  timeout $(( $(left) - 10 )) python3 tools/explore/probe_segment_phases.py --work /tmp/probe --decode 48 \
    --variants calibrated:v2:monitor,calibrated:v2:monitor:cpu,calibrated:v2:monitor:auto \
    --out "$OUT/phases.json" > "$OUT/phases.log" 2>&1
  step "phases probe exit $?"; grep -E "tok/s|segment\.|native|experts\." "$OUT/phases.log" | head -60
else
  step "phases probe skipped ($(left) s left)"
fi
