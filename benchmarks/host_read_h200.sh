#!/usr/bin/env bash
# One device call for the host-read site (issue 24 item 8): its GPU tests (real registered host memory mapped into the
# device, captured steps, logits equal to full residency), the grouped executor's kernel check at the full shapes (its
# kernels now resolve host rows too), then the h200-host-read campaign on directly synthesized OLMoE and Qwen1.5-MoE
# packs:
#
#   RUNMAP_GIT_COMMIT=<sha> bash benchmarks/host_read_h200.sh [BUDGET_S]     (repo root, $OUT set; carry wheels/)
#
# and the host part of a host-read step on this host's CPU (tools/explore/probe_host_read_host_cost.py, ~10 s).
#
# Files back: gpu-pytest.log, kernels-grouped.json, host-read-host-cost-h200.log, host-read-rate.log, h200-campaign.tar.gz,
# bench.log, prepare-{olmoe,qwen}.log; with stage gap / promotion-cost: host-read-gap.log / promotion-cost.log,
# synth-olmoe.log. The script exits 0 whatever a stage did: read each stage's line and log.
# RUNMAP_STAGES (default "tests kernels host-cost read-rate campaign") picks the stages; "read-rate" runs
# tools/explore/probe_host_read.py (~30 s): the rate at which this GPU's kernels read registered host memory against
# its copy engine's, which bounds every host-read row (two H100s of 2026-12-06 read at 15-28 GB/s against 38-46 by
# copy, results/campaigns/h100-host-read-slow-link); "gap" runs
# tools/explore/probe_host_read_gap.py (wall time per step against the step's graph replayed alone, promotions on and
# off; OLMoE 30 and 60 of 64 at batch 1, 60 at batch 8; ~2 min) on the campaign's OLMoE pack, synthesized first, and
# writes host-read-gap.log; "promotion-cost" runs tools/explore/probe_promotion_cost.py (OLMoE 60 of 64, batch 8:
# host time of the promotions, CUDA runtime calls, device idle gaps; ~1 min) into promotion-cost.log.
source benchmarks/device_prelude.sh
STAGES=" ${RUNMAP_STAGES:-tests kernels host-cost read-rate campaign} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
WORK=${RUNMAP_WORK:-/tmp/runmap-h200}
if { stage gap || stage promotion-cost; } && [ ! -f "$WORK/pk-olmoe/manifest.json" ]; then  # beside the tests (the campaign finds it present)
  mkdir -p "$WORK"
  python3 -m runmap synth "$WORK/pk-olmoe" --preset olmoe-1b-7b-0924 --direct-pack --force --no-progress \
    > "$OUT/synth-olmoe.log" 2>&1 &
  SYNTH_PID=$!
fi
# 150 s cut the first run at 25 of 30 tests and 240 s a later one at 33 of 34 (2026-12-05; Triton compiles each
# test's variants on a fresh host);
# --tb=short keeps the log of a failure small enough to come back
stage tests && { RUNMAP_TEST_DEVICE=cuda timeout 360 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_host_read.py \
  -k "not bench_record" > "$OUT/gpu-pytest.log" 2>&1
echo "[${SECONDS}s] gpu pytest (host-read) exit $?"
tail -3 "$OUT/gpu-pytest.log"; }
PACK_OK=1
if [ -n "${SYNTH_PID:-}" ] && ! wait "$SYNTH_PID"; then
  PACK_OK=0; echo "OLMoE pack synthesis failed: the gap and promotion-cost stages are skipped"; tail -3 "$OUT/synth-olmoe.log"
fi
if stage gap && [ "$PACK_OK" = 1 ]; then
  { timeout 150 python3 tools/explore/probe_host_read_gap.py --pack "$WORK/pk-olmoe" --resident 30,60
    timeout 60 python3 tools/explore/probe_host_read_gap.py --pack "$WORK/pk-olmoe" --resident 60 --batch 8 | tail -2
  } > "$OUT/host-read-gap.log" 2>&1
  echo "[${SECONDS}s] host-read gap probe"; cut -c1-150 "$OUT/host-read-gap.log"
fi
if stage promotion-cost && [ "$PACK_OK" = 1 ]; then
  timeout 120 python3 tools/explore/probe_promotion_cost.py --pack "$WORK/pk-olmoe" --resident 60 --batch 8 \
    > "$OUT/promotion-cost.log" 2>&1
  echo "[${SECONDS}s] promotion cost probe"; grep -v "^USDT\|^STAGE" "$OUT/promotion-cost.log" | cut -c1-150
fi
stage kernels && { timeout 120 python3 -m runmap.cli.check_kernels --device cuda --shapes full --executors grouped --m 1,2,3,8,17,64,300 \
  --out "$OUT/kernels-grouped.json" --no-progress > "$OUT/kernels-grouped.log" 2>&1
echo "[${SECONDS}s] kernel check (grouped, full shapes) exit $?"
tail -2 "$OUT/kernels-grouped.log"; }
stage host-cost && { { timeout 40 python3 tools/explore/probe_host_read_host_cost.py --steps 400 --warmup 100
  timeout 30 python3 tools/explore/probe_host_read_host_cost.py --family qwen2_moe --resident 30 --steps 400 \
    --warmup 100 | grep "per step"; } > "$OUT/host-read-host-cost-h200.log" 2>&1
echo "[${SECONDS}s] host part of a host-read step (this host's CPU)"
grep "per step" "$OUT/host-read-host-cost-h200.log" | cut -c1-150; }
stage read-rate && { timeout 90 python3 tools/explore/probe_host_read.py > "$OUT/host-read-rate.log" 2>&1
echo "[${SECONDS}s] host-read rate probe exit $?"
grep -o "^tokens=[0-9]* experts=[0-9]*\|host_read_gb_s=[0-9.]*\|copy_gb_s=[0-9.]*" "$OUT/host-read-rate.log" | paste -d' ' - - -; }
CAMPAIGN_S=$(( ${1:-570} - SECONDS - 15 ))
if stage campaign && [ "$CAMPAIGN_S" -lt 90 ]; then  # two packs to prepare and a bench deadline of at least ~30 s
  echo "[${SECONDS}s] campaign skipped: ${CAMPAIGN_S}s of the budget left"
elif stage campaign; then
  RUNMAP_SPEC=specs/campaigns/h200-host-read.yaml RUNMAP_DIRECT="olmoe=olmoe-1b-7b-0924 qwen=qwen1.5-moe-a2.7b" \
    bash benchmarks/run_h200_campaign.sh "$CAMPAIGN_S"
fi
rm -f "$OUT/kernels-grouped.log"
echo "[${SECONDS}s] done"
