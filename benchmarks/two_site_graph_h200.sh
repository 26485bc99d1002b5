#!/usr/bin/env bash
# One device call for the one-graph two-site step (docs/engine.md, "Two sites in one step"): its GPU tests
# (tests/test_two_site.py: the step captured as one CUDA graph whose joins wait on the device for the host's CPU sum,
# decode logits equal to full residency's; the join kernel on fresh inputs), then rows of
# specs/campaigns/two-site-graph.yaml (the one-graph step against host-read at llama.cpp's --n-cpu-moe 8 / 12 / 16 GPU
# expert bytes, OLMoE, calibrated routing) once per run of RUNMAP_TWO_SITE_RUNS, on one pack in the same call:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/two_site_graph_h200.sh [BUDGET_S]     (repo root, $OUT set; carry wheels/)
#
# RUNMAP_TWO_SITE_RUNS: space-separated NAME:FORM:WAIT:REGEX[:JOIN] (FORM graph|chain = RUNMAP_TWO_SITE_STEP, WAIT
# event|poll = RUNMAP_TWO_SITE_WAIT, REGEX = the bench's --only, "." for every row, JOIN mask|rule =
# RUNMAP_TWO_SITE_JOIN, the engine's default when left out). Default: the whole spec with the one-graph step, then its
# rates' two-site rows with the chain ("graph:graph:event:. chain:chain:event:<rates>"). RUNMAP_TEST_FILES: the test
# files of the GPU pytest (default tests/test_two_site.py), RUNMAP_TEST_K its -k.
# Files back: gpu-pytest-two-site.log, NAME.tar.gz + bench-NAME.log per run, prepare-olmoe.log. Exits 0 whatever a
# stage did.
BUDGET=${1:-560}
source benchmarks/device_prelude.sh
RUNMAP_TEST_DEVICE=cuda timeout "${RUNMAP_TEST_TIMEOUT:-200}" python3 -m pytest -q --tb=short -p no:cacheprovider \
  ${RUNMAP_TEST_FILES:-tests/test_two_site.py} ${RUNMAP_TEST_K:+-k "$RUNMAP_TEST_K"} > "$OUT/gpu-pytest-two-site.log" 2>&1
echo "[${SECONDS}s] gpu pytest (two-site) exit $?"
tail -3 "$OUT/gpu-pytest-two-site.log"
SPEC=specs/campaigns/two-site-graph.yaml
RATES='placement-two-site\.routing-calibrated-olmoe$'
RUNS=${RUNMAP_TWO_SITE_RUNS:-"graph:graph:event:. chain:chain:event:$RATES"}
set -- $RUNS
N=$#
for run in "$@"; do
  IFS=: read -r name form wait only join <<< "$run"
  LEFT=$(( BUDGET - SECONDS ))
  SHARE=$(( LEFT / N ))  # the runs left share what is left
  N=$(( N - 1 ))
  ( [ -n "$join" ] && export RUNMAP_TWO_SITE_JOIN=$join
    RUNMAP_TWO_SITE_STEP=$form RUNMAP_TWO_SITE_WAIT=$wait RUNMAP_ONLY="$only" RUNMAP_DIRECT=olmoe=olmoe-1b-7b-0924 \
      RUNMAP_SPEC="$SPEC" RUNMAP_MODELS=olmoe bash benchmarks/run_h200_campaign.sh "$SHARE" )
  [ -f "$OUT/h200-campaign.tar.gz" ] && mv "$OUT/h200-campaign.tar.gz" "$OUT/$name.tar.gz"
  [ -f "$OUT/bench.log" ] && mv "$OUT/bench.log" "$OUT/bench-$name.log"
  echo "[${SECONDS}s] run $name ($form, $wait, --only $only, join ${join:-default}) done"
done
ls "$OUT"
exit 0
