#!/usr/bin/env bash
# One device call for the one-graph two-site step (docs/engine.md, "Two sites in one step"): its GPU tests
# (tests/test_two_site.py: the step captured as one CUDA graph whose joins wait on the device for the host's CPU sum,
# decode logits equal to full residency's; the join kernel on fresh inputs), then specs/campaigns/two-site-graph.yaml
# (the one-graph step against host-read at llama.cpp's --n-cpu-moe 8 / 12 / 16 GPU expert bytes, OLMoE, calibrated
# routing), then the same spec's rates' two-site rows again with RUNMAP_TWO_SITE_STEP=chain (the 2L + 1 segment chain)
# on the same pack in the same call:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/two_site_graph_h200.sh [BUDGET_S]     (repo root, $OUT set; carry wheels/)
#
# Files back: gpu-pytest-two-site.log, graph.tar.gz + bench-graph.log, chain.tar.gz + bench-chain.log,
# prepare-olmoe.log. Exits 0 whatever a stage did.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
BUDGET=${1:-560}
mkdir -p "$OUT"
SECONDS=0
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -c "import jsonschema" 2>/dev/null || { [ -d wheels ] && python3 -m pip install -q --no-index --find-links wheels/ \
  --break-system-packages jsonschema==4.26.0; }
RUNMAP_TEST_DEVICE=cuda timeout "${RUNMAP_TEST_TIMEOUT:-200}" python3 -m pytest -q --tb=short -p no:cacheprovider \
  tests/test_two_site.py > "$OUT/gpu-pytest-two-site.log" 2>&1
echo "[${SECONDS}s] gpu pytest (two-site) exit $?"
tail -3 "$OUT/gpu-pytest-two-site.log"
SPEC=specs/campaigns/two-site-graph.yaml
# the chain's rows need ~45 s after the graph's (the pack is made once, by the first run)
RUNMAP_DIRECT=olmoe=olmoe-1b-7b-0924 RUNMAP_SPEC="$SPEC" RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( BUDGET - SECONDS - 50 ))
[ -f "$OUT/h200-campaign.tar.gz" ] && mv "$OUT/h200-campaign.tar.gz" "$OUT/graph.tar.gz"
[ -f "$OUT/bench.log" ] && mv "$OUT/bench.log" "$OUT/bench-graph.log"
echo "[${SECONDS}s] graph rows done"
RUNMAP_TWO_SITE_STEP=chain RUNMAP_ONLY='placement-two-site\.routing-calibrated-olmoe$' RUNMAP_DIRECT=olmoe=olmoe-1b-7b-0924 \
  RUNMAP_SPEC="$SPEC" RUNMAP_MODELS=olmoe bash benchmarks/run_h200_campaign.sh $(( BUDGET - SECONDS ))
[ -f "$OUT/h200-campaign.tar.gz" ] && mv "$OUT/h200-campaign.tar.gz" "$OUT/chain.tar.gz"
[ -f "$OUT/bench.log" ] && mv "$OUT/bench.log" "$OUT/bench-chain.log"
echo "[${SECONDS}s] chain rows done"
ls "$OUT"
exit 0
