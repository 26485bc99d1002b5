#!/usr/bin/env bash
# Decode with and without programmatic dependent launch (RUNMAP_PDL=0 / 1) in ONE device call, alternating:
# the engine rows of specs/campaigns/h200-floor.yaml (OLMoE decode, batch 1 and 8) and of
# specs/campaigns/h200-qwen-decode.yaml (Qwen1.5-MoE, batch 1 and 8) on directly synthesized packs (random INT4
# codes: speed runs at real dimensions), then a greedy `runmap generate` with each setting, whose texts must match.
#
#   RUNMAP_GIT_COMMIT=<sha> OUT=$OUT bash benchmarks/decode_pdl_h200.sh
#
# MODELS="olmoe" (default "olmoe qwen") runs a subset.
# Writes $OUT/{olmoe,qwen}-pdl{0,1}.tar.gz (each run's campaign folder) and $OUT/{olmoe,qwen}-pdl{0,1}.log.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
run() {  # NAME SPEC DIRECT ONLY PDL
  local tmp=/tmp/decode-pdl-$1-pdl$5
  rm -rf "$tmp"
  RUNMAP_PDL=$5 RUNMAP_SPEC=$2 RUNMAP_DIRECT=$3 RUNMAP_ONLY=$4 OUT=$tmp timeout 240 \
    bash benchmarks/run_h200_campaign.sh 220 > "$OUT/$1-pdl$5.log" 2>&1
  cp "$tmp/h200-campaign.tar.gz" "$OUT/$1-pdl$5.tar.gz" 2>/dev/null
  cat "$tmp/bench.log" >> "$OUT/$1-pdl$5.log" 2>/dev/null
  tail -3 "$OUT/$1-pdl$5.log"
}
MODELS=${MODELS:-olmoe qwen}
for pdl in 0 1; do
  case " $MODELS " in *" olmoe "*)
    run olmoe specs/campaigns/h200-floor.yaml "olmoe=olmoe-1b-7b-0924" 'engine__grouped__r64__b(1|8)__p128__d128' $pdl;;
  esac
done
for pdl in 0 1; do
  case " $MODELS " in *" qwen "*)
    run qwen specs/campaigns/h200-qwen-decode.yaml "qwen=qwen1.5-moe-a2.7b" 'engine__grouped' $pdl;;
  esac
done
for pdl in 0 1; do
  RUNMAP_PDL=$pdl timeout 90 python3 -m runmap generate --packed /tmp/runmap-h200/pk-olmoe \
    --prompt "The capital of France" --max-new-tokens 64 > /tmp/gen-pdl$pdl.txt 2>/tmp/gen-pdl$pdl.err
  tail -1 /tmp/gen-pdl$pdl.err
done
cmp /tmp/gen-pdl0.txt /tmp/gen-pdl1.txt && echo "generate: greedy text equal with and without PDL"
