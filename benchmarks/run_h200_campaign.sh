#!/usr/bin/env bash
# The H200 benchmark campaign (specs/campaigns/h200.yaml) in ONE device call, inside a time budget.
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/run_h200_campaign.sh [BUDGET_S]      (from the repo root, $OUT set)
#
# 1. builds the two synthetic checkpoints (real OLMoE-1B-7B-0924 and Qwen1.5-MoE-A2.7B dimensions, random
#    weights, seed 0, drawn on the GPU) on the machine's local disk and packs them (INT4, block 256, GPU
#    arithmetic), both models in parallel; each checkpoint is deleted once packed (disk: ~53 GiB at peak);
# 2. runs `runmap bench specs/campaigns/h200.yaml` on the two packs with a deadline so that it ends inside
#    BUDGET_S (default 565 s: the whole spec took 486 s on one H200) counted from the start of this script;
#    configurations not started by then
#    are listed as skipped in campaign.json;
# 3. writes $OUT/h200-campaign.tar.gz (campaigns/h200/records/*.json + campaign.json) and the logs, and
#    prints a short table.
# Runs with PYTHONPATH=. (the package is not installed there) and imports no jsonschema/snakemake.
# RUNMAP_SPEC=<spec> runs another campaign spec; RUNMAP_MODELS=olmoe prepares only OLMoE; RUNMAP_ONLY=<regex>
# passes --only to the bench. RUNMAP_MODELS=qwen prepares only Qwen1.5-MoE.
# RUNMAP_DIRECT="NAME=PRESET ..." replaces step 1: for each pair it synthesizes a pack directly, without a
# checkpoint (`runmap synth --direct-pack`: random INT4 codes, labelled in the manifest and in every record; speed
# runs at real dimensions) as $WORK/pk-NAME, unless a machine left warm still holds it, and passes
# --pack NAME=$WORK/pk-NAME. Used with specs/campaigns/h200-families.yaml (benchmarks/README.md has the calls).
set -uo pipefail
BUDGET=${1:-565}
T0=$(date +%s)
: "${OUT:?set OUT to the directory whose files come back}"
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
# Overridable only to rehearse the script on a CPU with tiny presets (see the README of results/campaigns/h200).
SPEC=${RUNMAP_SPEC:-specs/campaigns/h200.yaml}
PRESET_OLMOE=${RUNMAP_PRESET_OLMOE:-olmoe-1b-7b-0924}
PRESET_QWEN=${RUNMAP_PRESET_QWEN:-qwen1.5-moe-a2.7b}
PREP_DEVICE=${RUNMAP_PREP_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p "$WORK" "$OUT"
rm -rf "$WORK/campaigns"
elapsed() { echo $(( $(date +%s) - T0 )); }

prepare() {  # NAME PRESET: synth -> pack -> delete checkpoint (benchmarks/prepare_pack.py); the routing init, so
  # that the checkpoints' own routing ("model" rows) is not near-constant (docs/routing-workloads.md)
  python3 benchmarks/prepare_pack.py "$1" "$2" "$WORK" "$PREP_DEVICE" routing
}

PACKS=()
if [ -n "${RUNMAP_DIRECT:-}" ]; then
  echo "[$(elapsed)s] synthesizing packs directly in $WORK: $RUNMAP_DIRECT"
  FREE_GB=$(df --output=avail -B1G "$WORK" | tail -1 | tr -d ' ')
  if [ "${FREE_GB:-0}" -lt 30 ]; then  # Mixtral's pack is ~26 GB: drop this script's packs that this call does not use
    for d in "$WORK"/pk-*; do
      [ -d "$d" ] || continue
      case " $RUNMAP_DIRECT " in *" ${d##*/pk-}="*) ;; *) echo "removing $d (disk)"; rm -rf "$d";; esac
    done
  fi
  df -h "$WORK" | tail -1
  R1=0; R2=0
  for pair in $RUNMAP_DIRECT; do
    name=${pair%%=*}; preset=${pair#*=}
    if [ -f "$WORK/pk-$name/manifest.json" ] && python3 -c '
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
sys.exit(0 if (m.get("synthesized") or {}).get("preset") == sys.argv[2] else 1)' "$WORK/pk-$name" "$preset"; then
      echo "$name: pack already present ($WORK/pk-$name, $preset)" | tee "$OUT/prepare-$name.log"
      PACKS+=(--pack "$name=$WORK/pk-$name")
    elif python3 -m runmap synth "$WORK/pk-$name" --preset "$preset" --direct-pack --force --no-progress \
        > "$OUT/prepare-$name.log" 2>&1; then
      tail -1 "$OUT/prepare-$name.log"
      PACKS+=(--pack "$name=$WORK/pk-$name")
    else
      echo "$name: direct synthesis failed:"; tail -3 "$OUT/prepare-$name.log"
    fi
    echo "[$(elapsed)s] $name prepared"
  done
else
echo "[$(elapsed)s] preparing checkpoints and packs in $WORK"
df -h "$WORK" | tail -1
# Both chains at once need ~53 GiB of disk at peak (12.9 + 26.7 GiB checkpoints, 3.9 + 9.3 GiB packs); one
# after the other ~40 GiB. A machine left warm by an earlier call may hold other files: check first.
FREE_GB=$(df --output=avail -B1G "$WORK" | tail -1 | tr -d ' ')
echo "free disk in $WORK: ${FREE_GB} GB"
if [ "${RUNMAP_MODELS:-both}" = olmoe ]; then  # one model only (a shorter call): OLMoE
  prepare olmoe "$PRESET_OLMOE" > "$OUT/prepare-olmoe.log" 2>&1; R1=$?; R2=1
  echo "qwen: not prepared (RUNMAP_MODELS=olmoe)" > "$OUT/prepare-qwen.log"
elif [ "${RUNMAP_MODELS:-both}" = qwen ]; then  # Qwen1.5-MoE only
  prepare qwen "$PRESET_QWEN" > "$OUT/prepare-qwen.log" 2>&1; R2=$?; R1=1
  echo "olmoe: not prepared (RUNMAP_MODELS=qwen)" > "$OUT/prepare-olmoe.log"
elif [ "${FREE_GB:-0}" -ge 56 ] || [ -n "${RUNMAP_PRESET_OLMOE:-}" ]; then
  prepare olmoe "$PRESET_OLMOE" > "$OUT/prepare-olmoe.log" 2>&1 &
  P1=$!
  prepare qwen "$PRESET_QWEN" > "$OUT/prepare-qwen.log" 2>&1 &
  P2=$!
  wait $P1; R1=$?
  wait $P2; R2=$?
else
  echo "not enough disk for both at once: one after the other"
  prepare olmoe "$PRESET_OLMOE" > "$OUT/prepare-olmoe.log" 2>&1; R1=$?
  prepare qwen "$PRESET_QWEN" > "$OUT/prepare-qwen.log" 2>&1; R2=$?
fi
tail -n 2 "$OUT/prepare-olmoe.log" "$OUT/prepare-qwen.log"
echo "[$(elapsed)s] prepare exit codes: olmoe $R1, qwen $R2"

[ "$R1" = 0 ] && PACKS+=(--pack "olmoe=$WORK/pk-olmoe")
[ "$R2" = 0 ] && PACKS+=(--pack "qwen=$WORK/pk-qwen")
fi
ONLY="${RUNMAP_ONLY:-}"
if [ -z "$ONLY" ] && [ "$R1" != 0 ] && [ "$R2" = 0 ]; then ONLY="^qwen__"; fi
if [ -z "$ONLY" ] && [ "$R2" != 0 ] && [ "$R1" = 0 ]; then ONLY="^olmoe__"; fi
# Leave ~40 s after the deadline: the last configuration started (an engine build + its runs), the ratio
# pass and the archive.
DEADLINE=$(( BUDGET - $(elapsed) - 40 ))
echo "[$(elapsed)s] bench deadline ${DEADLINE}s"
if [ "${#PACKS[@]}" -gt 0 ] && [ "$DEADLINE" -gt 0 ]; then
  python3 - "$SPEC" "$WORK/campaigns" "$DEADLINE" "$ONLY" "${PACKS[@]}" > "$OUT/bench.log" 2>&1 <<'EOF' &
import argparse, signal, sys
from runmap.cli import bench as cmd_bench

def _stop(signum, frame):  # the watchdog: end now, still writing ratios and campaign.json (finally blocks)
    raise KeyboardInterrupt("deadline watchdog")

signal.signal(signal.SIGTERM, _stop)
spec, out, deadline, only, *packs = sys.argv[1:]
p = argparse.ArgumentParser()
cmd_bench.add_arguments(p)
argv = [spec, "--out", out, "--deadline-s", deadline, "--keep-going", "--no-progress", *packs]
if only:
    argv += ["--only", only]
args = p.parse_args(argv)
sys.argv = ["runmap", "bench", *argv]  # recorded as the command of every record
sys.exit(cmd_bench.run(args))
EOF
  BPID=$!
  # A configuration started just before the deadline may run long: stop the bench 20 s before the
  # budget ends so that the archive below is always written.
  ( sleep $(( BUDGET - 20 - $(elapsed) )); kill -TERM $BPID 2>/dev/null ) &
  WPID=$!
  wait $BPID; echo "bench exit code $?"
  kill $WPID 2>/dev/null
  cat "$OUT/bench.log"
fi
echo "[$(elapsed)s] bench finished"
tar -czf "$OUT/h200-campaign.tar.gz" -C "$WORK" campaigns 2>/dev/null || echo "no campaign output to archive"
NAME=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$SPEC")
python3 - "$WORK/campaigns/$NAME" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
if not (d / "campaign.json").is_file():
    sys.exit("no campaign.json")
s = json.loads((d / "campaign.json").read_text())
print(f"done {len(s['done'])}, failed {len(s['failed'])}, skipped {len(s['skipped'])}, copy bw {s['copy_bandwidth_gb_s'].get('value')}")
for f in s["failed"]:
    print("FAILED", f["id"], f["error"][:300])
print(f"{'config':58s} {'dec tok/s':>9s} {'peak GiB':>8s} {'hit':>5s} {'xfloor':>6s} {'xbound':>6s} {'h2d GB/s':>8s}")
nan = float("nan")
for p in sorted((d / "records").glob("*.json")):
    r = json.loads(p.read_text())
    m, h, fl = r["memory"]["peak_allocated_bytes"], r["cache_stats"]["hit_rate"], r["ratios"]["decode_vs_byte_floor"]
    xb = r["ratios"].get("decode_vs_transfer_bound", {})
    print(f"{r['id']:58s} {r['timing']['decode_tok_s']['median']:9.1f} "
          f"{m.get('value', 0) / 2**30 if m['status'] == 'OBSERVED' else nan:8.2f} "
          f"{h.get('value', nan):5.2f} {fl.get('value', nan):6.3f} {xb.get('value', nan):6.3f} "
          f"{r['h2d']['gb_s'].get('value', nan):8.2f}")
EOF
echo "[$(elapsed)s] end"
