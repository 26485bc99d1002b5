#!/usr/bin/env bash
# The README's engine headline in one device call: builds the synthetic OLMoE-1B-7B-0924 pack (real
# dimensions, random weights, seed 0, drawn and packed on the GPU), then `runmap bench` on the headline
# groups of specs/campaigns/h200.yaml: OLMoE full residency, batch 1, 32-token prompt + 256 decoded tokens,
# grouped (with the logits check), transformers' bf16 model at the same lengths, the 4,096-token memory
# run and the variants (topk-fused, torch ops, routed experts skipped, no graphs).
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/engine_headline_h200.sh      (repository root, $OUT set)
# Writes $OUT/headline/campaign.tar.gz (campaign.json + records/*.json) and logs. GPU_TESTS=1 also runs the GPU kernel tests.
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
WORK=${RUNMAP_WORK:-/tmp/runmap-headline}
T0=$(date +%s); elapsed() { echo $(( $(date +%s) - T0 )); }
mkdir -p "$WORK" "$OUT/headline"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader | tee "$OUT/headline/gpu.txt"
python3 - "$WORK" > "$OUT/headline/prepare.log" 2>&1 <<'PY'
import sys, time
from pathlib import Path
from runmap.arch.config import load_preset
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic
work = Path(sys.argv[1]); ck, pk = work / "ck-olmoe", work / "pk-olmoe"
t0 = time.perf_counter()
if not (pk / "manifest.json").is_file():
    write_synthetic(load_preset("olmoe-1b-7b-0924")[0], ck, seed=0, device="cuda", overwrite=True)
    t1 = time.perf_counter()
    pack_checkpoint(ck, pk, device="cuda", overwrite=True)
    print(f"synth {t1 - t0:.1f} s, pack {time.perf_counter() - t1:.1f} s")
PY
echo "[$(elapsed)s] prepare rc=$?"; tail -2 "$OUT/headline/prepare.log"
rm -rf "$WORK/campaigns"
timeout "${BENCH_S:-330}" python3 -m runmap bench specs/campaigns/h200.yaml --out "$WORK/campaigns" --no-progress \
  --keep-going --pack olmoe="$WORK/pk-olmoe" --checkpoint olmoe="$WORK/ck-olmoe" \
  --only "${ONLY:-^olmoe__(engine__(grouped|topk-fused)|hf-bf16__hf-bf16|hf-bf16-compile__hf-bf16-compile)__r64__b1__p(32__d256|4032__d64)}" \
  > "$OUT/headline/bench.log" 2>&1
echo "[$(elapsed)s] bench rc=$?"
# records as one archive (the device tool brings back a bounded number of files)
for d in "$WORK"/campaigns/h200 "$WORK"/campaigns/.h200.partial-*; do
  [ -d "$d" ] && tar -czf "$OUT/headline/campaign.tar.gz" -C "$d" . && echo "archived $d"
done
tail -n 25 "$OUT/headline/bench.log"
if [ "${GPU_TESTS:-0}" = 1 ]; then
  RUNMAP_TEST_DEVICE=cuda timeout "${TEST_S:-200}" python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
    > "$OUT/headline/pytest-kernels.log" 2>&1; echo "[$(elapsed)s] gpu kernel tests rc=$?"
  tail -n 3 "$OUT/headline/pytest-kernels.log"
fi
