#!/usr/bin/env bash
# Decode speed of this tree against an earlier one, in ONE device call (a kernel change judged end to end):
#
#   RUNMAP_GIT_COMMIT=<sha> RUNMAP_BEFORE_COMMIT=<sha> OUT=$OUT bash benchmarks/decode_ab_h200.sh [BUDGET_S]
#
# from the repo root, with the earlier tree extracted into ./before-tree (ignored; carried along:
# `mkdir before-tree && git archive <sha> | tar -x -C before-tree`). Steps, each skipped when the budget (default
# 560 s) runs short:
#  1. GPU pytest of this tree: GPU_TESTS (default tests/test_kernels.py) selected by GPU_K (default "grouped or
#     scales"), then the engine against the reference executor and transformers, and chained launches changing no
#     token (ENGINE_TESTS=0 leaves these out);
#  2. PROBE (python3's arguments, default none) under this tree, e.g. "tools/explore/probe_scale_preload.py --out
#     {dir}/p.json",
#     given what the budget leaves beyond PROBE_KEEP_S (default 150 s) for the decode rows (a skip is printed);
#  3. packs synthesized directly (real OLMoE-1B-7B / Qwen1.5-MoE-A2.7B dimensions, random INT4 codes);
#  4. ROUNDS (default 1) x alternating before / this: the engine decode rows of specs/campaigns/h200-floor.yaml
#     (OLMoE, batch 1 and 8) and specs/campaigns/h200-qwen-decode.yaml (Qwen1.5-MoE, batch 1 and 8), full residency,
#     grouped executor, CUDA graphs; MODELS="olmoe" (default "olmoe qwen") runs a subset;
#  5. a greedy `runmap generate` (OLMoE pack, 64 tokens) under each tree: the texts must match.
# One file back, decode-ab.tar.gz: gpu-pytest.log, probe.log (+ what PROBE wrote), bench-{before,this}-{model}-{round}.log
# and campaign-{before,this}-{model}-{round}/ (records, campaign.json), gen-{before,this}.txt; and the console table.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
: "${RUNMAP_GIT_COMMIT:?set RUNMAP_GIT_COMMIT to this tree's commit}"
: "${RUNMAP_BEFORE_COMMIT:?set RUNMAP_BEFORE_COMMIT to before-tree's commit}"
BUDGET=${1:-560}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
LOGS=/tmp/decode-ab
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
THIS=$PWD
BEFORE=$PWD/before-tree
MODELS=${MODELS:-olmoe qwen}
ROUNDS=${ROUNDS:-1}
GPU_K=${GPU_K:-grouped or scales}
GPU_TESTS=${GPU_TESTS:-tests/test_kernels.py}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
finish() { tar -czf "$OUT/decode-ab.tar.gz" -C "$LOGS" . ; step "archive written"; }
trap finish EXIT
source benchmarks/decode_steps_common.sh
[ -d "$BEFORE/runmap" ] || { echo "no before-tree/ (carry it)"; exit 2; }

# 1. this tree's GPU tests (two selections: the kernel tests by keyword, then the engine's own)
PYTHONPATH=. RUNMAP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider $GPU_TESTS \
  -k "$GPU_K" > "$LOGS/gpu-pytest.log" 2>&1
step "gpu pytest (kernels) exit $?"; tail -1 "$LOGS/gpu-pytest.log"
if [ "${ENGINE_TESTS:-1}" = 1 ]; then
  PYTHONPATH=. RUNMAP_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_model.py \
    tests/test_engine.py -k "transformers or match_reference or chained_launches" >> "$LOGS/gpu-pytest.log" 2>&1
  step "gpu pytest (engine: transformers, reference, chained launches) exit $?"; tail -1 "$LOGS/gpu-pytest.log"
fi

# 2. an optional probe under this tree ({dir} is the archive folder), leaving PROBE_KEEP_S (default 150) for the rows
run_probe 150

# 3. packs
mkdir -p "$WORK"
pack olmoe olmoe-1b-7b-0924
case " $MODELS " in *" qwen "*) pack qwen qwen1.5-moe-a2.7b;; esac

# 4. decode rows, alternating trees
bench() {  # TREE MODEL ROUND
  local dir=$THIS commit=$RUNMAP_GIT_COMMIT spec only
  [ "$1" = before ] && dir=$BEFORE && commit=$RUNMAP_BEFORE_COMMIT
  case $2 in
    olmoe) spec=specs/campaigns/h200-floor.yaml; only='engine__grouped__r64__b(1|8)__p128__d128';;
    qwen) spec=specs/campaigns/h200-qwen-decode.yaml; only='engine__grouped';;
    *) step "MODELS: unknown model $2 (olmoe, qwen): skipped"; return;;
  esac
  if [ "$(left)" -lt 100 ]; then step "bench $1 $2 $3 skipped ($(left) s left)"; return; fi
  local camp=$WORK/camp-$1-$2-$3
  rm -rf "$camp"
  (cd "$dir" && PYTHONPATH=$dir RUNMAP_GIT_COMMIT=$commit timeout $(( $(left) - 60 )) python3 -m runmap bench \
    "$dir/$spec" --pack "$2=$WORK/pk-$2" --only "$only" --out "$camp" --no-progress --keep-going) \
    > "$LOGS/bench-$1-$2-$3.log" 2>&1
  step "bench $1 $2 round $3 exit $?"; grep -E "decode" "$LOGS/bench-$1-$2-$3.log" | tail -4
  mkdir -p "$LOGS/campaign-$1-$2-$3" && cp -r "$camp/." "$LOGS/campaign-$1-$2-$3/" 2>/dev/null
}
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for tree in before this; do bench $tree $model $round; done
  done
done

# 5. the same greedy text from both trees, each within half of what the budget leaves
if [ "$(left)" -lt 40 ]; then step "generate skipped ($(left) s left)"; exit 0; fi
for tree in before this; do
  dir=$THIS; [ "$tree" = before ] && dir=$BEFORE
  (cd "$dir" && PYTHONPATH=$dir timeout $(( ($(left) - 10) / 2 )) python3 -m runmap generate --packed "$WORK/pk-olmoe" \
    --prompt "The capital of France" --max-new-tokens 64) > "$LOGS/gen-$tree.txt" 2> "$LOGS/gen-$tree.err"
done
cmp -s "$LOGS/gen-before.txt" "$LOGS/gen-this.txt" && step "generate: greedy text equal under both trees" \
  || step "generate: greedy texts DIFFER (or a run failed; gen-*.err)"
