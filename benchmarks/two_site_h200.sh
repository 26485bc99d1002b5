#!/usr/bin/env bash
# One device call for placement two-site (docs/engine.md, "Two sites in one step"): its GPU tests (the two-site chain
# captured as CUDA graphs, registered host memory read by the grouped executor beside the CPU site, decode logits equal
# to full residency's), then specs/campaigns/two-site-matched.yaml (two-site against host-read at llama.cpp's
# --n-cpu-moe 8 / 12 / 16 GPU expert bytes, OLMoE, calibrated routing) on a directly synthesized pack:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/two_site_h200.sh [BUDGET_S]     (repo root, $OUT set; carry wheels/)
#
# RUNMAP_TWO_SITE_SPEC=<spec> runs another spec's rows (specs/campaigns/auto-sites-matched.yaml: placement auto with
# both sites against host-read and two-site); the GPU tests then include auto's host-read choice (tests/test_placement.py).
#
# llama.cpp's rows at the same budgets in the same call: benchmarks/llama_cpp_matched_h200.sh with
# RUNMAP_MATCHED_SPEC=specs/campaigns/two-site-matched.yaml (it builds llama.cpp first).
# Files back: gpu-pytest-two-site.log, h200-campaign.tar.gz, bench.log, prepare-olmoe.log. Exits 0 whatever a stage did.
BUDGET=${1:-480}
source benchmarks/device_prelude.sh
SPEC=${RUNMAP_TWO_SITE_SPEC:-specs/campaigns/two-site-matched.yaml}
TESTS=(tests/test_two_site.py)
[ "$SPEC" != specs/campaigns/two-site-matched.yaml ] && TESTS+=(tests/test_placement.py -k "two_site or both_sites or chooser or auto_runs_host_read or rate_is_measured")
RUNMAP_TEST_DEVICE=cuda timeout "${RUNMAP_TEST_TIMEOUT:-200}" python3 -m pytest -q --tb=short -p no:cacheprovider \
  "${TESTS[@]}" > "$OUT/gpu-pytest-two-site.log" 2>&1
echo "[${SECONDS}s] gpu pytest (two-site) exit $?"
tail -3 "$OUT/gpu-pytest-two-site.log"
RUNMAP_DIRECT=olmoe=olmoe-1b-7b-0924 RUNMAP_SPEC="$SPEC" RUNMAP_MODELS=olmoe \
  bash benchmarks/run_h200_campaign.sh $(( BUDGET - SECONDS ))
exit 0
