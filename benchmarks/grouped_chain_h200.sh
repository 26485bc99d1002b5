#!/usr/bin/env bash
# One device call for the grouped segment chain (batch 8 under partial residency; issue 24 item 8, issue 25 item 6)
# and prefetch from the calibrated workload's own prediction (issue 24 item 4): the segment-chain and routing-workload
# tests on the GPU (captured chains, grouped and one-lease), then the h200-grouped-chain campaign (OLMoE 30 / 48 of 64,
# batch 1 and 8, calibrated, contract v2, prefetch off / on at 30):
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/grouped_chain_h200.sh [BUDGET_S]     (repo root, $OUT set; carry wheels/)
#
# Files back: gpu-pytest.log, h200-campaign.tar.gz, bench.log, prepare-olmoe.log, phases-b8.log, phases-b8.json.
source benchmarks/device_prelude.sh
RUNMAP_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_segment_decode.py \
  tests/test_routing_workload.py tests/test_placement.py -k "segment or grouped or prefetch or prediction" \
  > "$OUT/gpu-pytest.log" 2>&1
echo "[${SECONDS}s] gpu pytest (segment chains, workload prefetch) exit $?"
tail -3 "$OUT/gpu-pytest.log"
RUNMAP_SPEC=specs/campaigns/h200-grouped-chain.yaml RUNMAP_DIRECT="olmoe=olmoe-1b-7b-0924" RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( ${1:-570} - SECONDS - 20 ))
rm -f "$OUT/prepare-qwen.log"
# where the grouped chain's host time goes, at batch 8, on the campaign's pack, while the budget allows
PACK=${RUNMAP_WORK:-/tmp/runmap-h200}/pk-olmoe
if [ $(( ${1:-570} - SECONDS )) -gt 70 ] && [ -f "$PACK/manifest.json" ]; then
  mkdir -p /tmp/probe && ln -sfn "$PACK" /tmp/probe/pk-olmoe-1b-7b-0924
  timeout $(( ${1:-570} - SECONDS - 10 )) python3 tools/explore/probe_segment_phases.py --work /tmp/probe --batch 8 \
    --decode 24 --variants calibrated:v2:monitor --out "$OUT/phases-b8.json" > "$OUT/phases-b8.log" 2>&1
  echo "[${SECONDS}s] phases probe (batch 8) exit $?"; grep -E "tok/s|segment\.|cache\._transaction" "$OUT/phases-b8.log"
fi
echo "[${SECONDS}s] done"
