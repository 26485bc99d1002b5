#!/usr/bin/env bash
# IFEval, all 541 prompts, on a full-size synthetic OLMoE-1B-7B pack: one call of the device tool.
#
#   run(command="bash results/ifeval/run_h200.sh", timeout_s=600)          # on the H200 (repo root)
#
# then, on the development machine (scoring needs nltk / lm-eval, which the GPU machine lacks):
#
#   mkdir -p results/ifeval/h200 && cp FILES_AT/ifeval/* results/ifeval/h200/
#   runmap ifeval score --inputs data/ifeval/input_data.jsonl \
#       --responses results/ifeval/h200/answers.jsonl --out results/ifeval/h200/score
#
# Steps (each timed into $OUT/ifeval/run.json): synthetic BF16 checkpoint of PRESET on the GPU, INT4 pack
# on the GPU, then `runmap ifeval generate` (grouped executor, full residency, greedy, chat template,
# MAX_NEW new tokens at most, BATCH prompts per engine call). Generation is stopped with SIGINT before the
# call's 10-minute limit (GEN_DEADLINE_S after the script started): the answers written so far and a
# sidecar with status "interrupted" come back. To continue in a later call, commit or leave the returned
# answers.jsonl(+.meta.json) at results/ifeval/h200/ in the working tree: they are copied in first and
# only the unanswered prompts are generated (a re-made pack of the same preset and seed has the same
# content hash, so the resume check accepts it). On a machine still warm from a previous call the pack
# in $W is reused.
#
# Knobs (environment): PRESET (olmoe-1b-7b-0924-instruct), BATCH (128), MAX_NEW (1280), LIMIT (all),
# EXECUTOR (grouped), DEVICE (cuda), GEN_DEADLINE_S (560), W (/tmp/runmap-ifeval-h200).
# A CPU dry run of this script: PRESET=tiny-olmoe DEVICE=cpu EXECUTOR=reference LIMIT=4 MAX_NEW=8 OUT=/tmp/o
set -euo pipefail
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
PRESET=${PRESET:-olmoe-1b-7b-0924-instruct}
BATCH=${BATCH:-128}
MAX_NEW=${MAX_NEW:-1280}
EXECUTOR=${EXECUTOR:-grouped}
DEVICE=${DEVICE:-cuda}
GEN_DEADLINE_S=${GEN_DEADLINE_S:-560}
W=${W:-/tmp/runmap-ifeval-h200}
OUT=${OUT:?set OUT (the device tool sets it)}
R=$OUT/ifeval
mkdir -p "$W" "$R"
RUNMAP="python3 -m runmap.cli"
LIMIT_ARG=${LIMIT:+--limit $LIMIT}

stamp() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1 || true

SYNTH_S=0; PACK_S=0
if [ ! -f "$W/pack/manifest.json" ]; then
  t=$(stamp); $RUNMAP synth --preset "$PRESET" --seed 0 --device "$DEVICE" --no-progress --force "$W/ckpt"
  SYNTH_S=$(( $(stamp) - t ))
  t=$(stamp); $RUNMAP pack "$W/ckpt" "$W/pack" --device "$DEVICE" --no-progress --force
  PACK_S=$(( $(stamp) - t ))
  rm -rf "$W/ckpt"  # 14 GB of BF16 no longer needed
fi

# resume from answers carried in the working tree, if any
if [ -f results/ifeval/h200/answers.jsonl ] && [ -f results/ifeval/h200/answers.jsonl.meta.json ]; then
  cp results/ifeval/h200/answers.jsonl results/ifeval/h200/answers.jsonl.meta.json "$R/"
fi

LEFT=$(( GEN_DEADLINE_S - $(stamp) ))
[ "$LEFT" -gt 30 ] || { echo "no time left for generation ($LEFT s)"; exit 3; }
t=$(stamp)
set +e
timeout --preserve-status -s INT "$LEFT" $RUNMAP ifeval generate --packed "$W/pack" --out "$R/answers.jsonl" $LIMIT_ARG \
  --max-new-tokens "$MAX_NEW" --batch-size "$BATCH" --executor "$EXECUTOR" --device "$DEVICE" \
  --model-name "$PRESET-synthetic" --no-progress 2> "$R/generate.log"
GEN_RC=$?
set -e
GEN_S=$(( $(stamp) - t ))
tail -n 20 "$R/generate.log"

python3 - "$R" "$PRESET" "$SYNTH_S" "$PACK_S" "$GEN_S" "$GEN_RC" "$BATCH" "$MAX_NEW" "$EXECUTOR" <<'EOF'
import json, sys
r, preset, synth_s, pack_s, gen_s, rc, batch, max_new, executor = sys.argv[1:]
try:
    meta = json.load(open(f"{r}/answers.jsonl.meta.json"))
except FileNotFoundError:  # stopped before the first sidecar write (tokenizing / loading the engine)
    meta = {"status": "not started", "counts": None, "timing": None,
            "sessions": [{"new_tokens": 0, "wall_s": 0.0}]}
rec = {"command": "bash results/ifeval/run_h200.sh", "preset": preset, "executor": executor,
       "batch_size": int(batch), "max_new_tokens": int(max_new), "synth_s": int(synth_s), "pack_s": int(pack_s),
       "generate_wall_s": int(gen_s), "generate_rc": int(rc), "gpu": open(f"{r}/gpu.txt").read().strip(),
       "status": meta["status"], "counts": meta["counts"], "timing": meta["timing"],
       "engine_load_s": meta.get("engine_load_s"), "max_seq_len": meta.get("max_seq_len")}
json.dump(rec, open(f"{r}/run.json", "w"), indent=2)
s = meta["sessions"][-1]
print(f"{'status':<10}{'answered':>10}{'new tok':>10}{'wall s':>9}{'tok/s':>9}{'synth s':>9}{'pack s':>8}")
c = meta["counts"] or {"answered": 0, "prompts": 0}
print(f"{meta['status']:<10}{c['answered']:>5}/{c['prompts']:<4}{s['new_tokens']:>10}"
      f"{s['wall_s']:>9.1f}{s['new_tokens'] / max(s['wall_s'], 1e-9):>9.1f}{synth_s:>9}{pack_s:>8}")
EOF
exit "$GEN_RC"
