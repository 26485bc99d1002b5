#!/usr/bin/env bash
# One device call for the miss transaction's host path (issue 24 item 8), the tree under test against the tree before
# the change in the same call:
#
#   RUNMAP_GIT_COMMIT=<sha> RUNMAP_BEFORE_COMMIT=<sha> bash benchmarks/txn_host_path_h200.sh [BUDGET_S]
#
# from the repo root, $OUT set, with the earlier tree extracted into ./before-tree (an ignored folder carried along:
# `git archive <sha> | tar -x -C before-tree`). Steps: the segment-chain tests and the contract's CUDA-events run on the GPU (this tree); the
# OLMoE pack synthesized directly; twice, alternating before / this: tools/explore/probe_txn_host_cost.py and the
# h200-txn-host-path campaign (specs/campaigns/h200-txn-host-path.yaml); the segment-phases probe (this tree) while
# the budget allows. The earlier tree needs data/ too (the bench's prompts).
# One file back, txn-host-path.tar.gz: gpu-pytest.log, contract-cuda-events-v2.{log,json}, txn-{before,this}-{1,2}.*,
# bench-{before,this}-{1,2}.log, campaign-{before,this}-{1,2}/ (records), phases.{log,json}.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
: "${RUNMAP_GIT_COMMIT:?set RUNMAP_GIT_COMMIT to this tree's commit}"
: "${RUNMAP_BEFORE_COMMIT:?set RUNMAP_BEFORE_COMMIT to before-tree's commit}"
BUDGET=${1:-570}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOGS=/tmp/txn-host-path  # everything goes back as one archive (a call returns at most 8 files)
rm -rf "$LOGS"; mkdir -p "$LOGS"
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
THIS=$PWD
BEFORE=$PWD/before-tree
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
[ -d "$BEFORE/runmap" ] || { echo "no before-tree/ (carry it)"; exit 2; }
PYTHONPATH=. RUNMAP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_segment_decode.py \
  > "$LOGS/gpu-pytest.log" 2>&1  # (not tests/test_contract_model.py: it imports jsonschema, absent there)
step "gpu pytest (segment chain) exit $?"; grep -m4 -E "rror|passed|failed" "$LOGS/gpu-pytest.log"
PYTHONPATH=. timeout 80 python3 -m runmap.cli.contract --device cuda --events cuda --contract v2 --no-progress \
  --examples 10 --steps 15 --mutant-examples 10 --out "$LOGS/contract-cuda-events-v2.json" > "$LOGS/contract-cuda-events-v2.log" 2>&1
step "contract v2, cuda events: exit $?"; tail -4 "$LOGS/contract-cuda-events-v2.log"
mkdir -p "$WORK"
if [ ! -f "$WORK/pk-olmoe/manifest.json" ]; then
  PYTHONPATH=. python3 -m runmap synth "$WORK/pk-olmoe" --preset olmoe-1b-7b-0924 --direct-pack --force --no-progress \
    > "$LOGS/prepare-olmoe.log" 2>&1
  step "pack synthesized: exit $?"
fi
SPEC=$THIS/specs/campaigns/h200-txn-host-path.yaml
for round in 1 2; do
  for tree in before this; do
    dir=$THIS; commit=$RUNMAP_GIT_COMMIT
    [ "$tree" = before ] && dir=$BEFORE && commit=$RUNMAP_BEFORE_COMMIT
    PYTHONPATH=$dir timeout 120 python3 tools/explore/probe_txn_host_cost.py --out "$LOGS/txn-$tree-$round.json" \
      > "$LOGS/txn-$tree-$round.log" 2>&1
    step "txn probe ($tree tree, round $round) exit $?"; grep -E "stream|v2 monitor=True" "$LOGS/txn-$tree-$round.log"
    if [ "$(left)" -lt 90 ]; then step "bench $tree $round skipped ($(left) s left)"; continue; fi
    rm -rf "$WORK/camp-$tree-$round"
    (cd "$dir" && PYTHONPATH=$dir RUNMAP_GIT_COMMIT=$commit timeout $(( $(left) - 30 )) python3 -m runmap bench "$SPEC" \
      --pack "olmoe=$WORK/pk-olmoe" --out "$WORK/camp-$tree-$round" --no-progress --keep-going) \
      > "$LOGS/bench-$tree-$round.log" 2>&1
    step "bench $tree round $round exit $?"; grep -E "decode" "$LOGS/bench-$tree-$round.log" | sed 's/__b1__p32__d64//'
    mkdir -p "$LOGS/campaign-$tree-$round" && cp -r "$WORK/camp-$tree-$round/." "$LOGS/campaign-$tree-$round/" 2>/dev/null
  done
done
if [ "$(left)" -gt 70 ]; then
  mkdir -p /tmp/probe && ln -sfn "$WORK/pk-olmoe" /tmp/probe/pk-olmoe-1b-7b-0924
  PYTHONPATH=. timeout $(( $(left) - 10 )) python3 tools/explore/probe_segment_phases.py --work /tmp/probe --decode 48 \
    --variants calibrated:v2:monitor,calibrated:v2:off --out "$LOGS/phases.json" > "$LOGS/phases.log" 2>&1
  step "phases probe exit $?"; grep -E "tok/s|cache\._transaction|cache\._acquire|segment\.run" "$LOGS/phases.log" | head -20
else
  step "phases probe skipped ($(left) s left)"
fi
tar -czf "$OUT/txn-host-path.tar.gz" -C "$LOGS" .
step "archive: $(du -h "$OUT/txn-host-path.tar.gz" | cut -f1)"
