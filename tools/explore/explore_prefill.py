"""GPU exploration (not a test, not the official record): the grouped executor's tensor-core path at
prefill (512 tokens over all experts) and decode, per tile config and nibble-decoding form, against
torch's bf16 grouped path in the same run.

Forms: "plain" (Triton's nibble decoding) and "asm" (DEQ_ASM, the inline-PTX decoding of kernels/core.py).
The committed records results/kernels/explore/h200-prefill*.json also hold two forms that were measured and
then removed because they did not pay: SPLIT_X (x deinterleaved by one torch copy so even / odd columns load
contiguously) and SPLIT_H (h stored deinterleaved for the down launch); "split" and "asm+split" rows.
Every config is timed in two passes (the GPU is shared; the lower median is kept, both are recorded) and
checked against the FP32 reference. Prefill is timed as a CUDA graph of 4 layers (ours and bf16 alike), so
host launch overhead does not enter; --profile adds a per-kernel breakdown (torch.profiler) of the default
config and the bf16 path.

    PYTHONPATH=. python3 tools/explore/explore_prefill.py --out $OUT/explore-prefill.json
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from runmap.bench.kernel_workload import (LAYERS, MODELS, PREFILL_LAYERS, PREFILL_TOKENS, bf16_grouped_layer,
                                          copy_bandwidth, graph_us, model_layers, random_batches)
from runmap.kernels import grouped
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32

FORMS = {"plain": {"DEQ_ASM": False}, "asm": {"DEQ_ASM": True}}
PREFILL_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); down uses the same N / K tiles
    (64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (128, 64, 64, 8, 3), (64, 64, 256, 4, 2),
    (128, 128, 64, 8, 3), (64, 32, 256, 4, 3), (64, 64, 128, 8, 4), (128, 64, 128, 8, 3), (64, 128, 64, 4, 4),
    # 10-15: narrow row groups, for sorted passes with few rows per expert (a served decode step of 32 rows routes
    # ~4 rows to each of OLMoE's 64 experts; a join of one or two prompts ~30)
    (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (16, 64, 128, 4, 4),
    (32, 64, 256, 4, 3),
]


def tile_cfg(bm, bn, bk, nw, ns, form, sorted_runs=False):
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOWN_BLOCK_N": bn, "DOWN_BLOCK_K": bk,
           "num_warps": nw, "num_stages": ns, **FORMS[form]}
    return {**cfg, "SORTED": True} if sorted_runs else cfg


def kernel_breakdown(fn, layers: int) -> dict:
    """{kernel name: microseconds per layer} of one call of ``fn`` from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count > 0:
            out[ev.key[:80]] = round(t / layers, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def prefill(args, model, spec, layout, layers, table, gen, out, summary, tokens: int = PREFILL_TOKENS) -> None:
    """Prefill rows of one model at ``tokens`` routed tokens (a sorted pass when tokens x top-k is past the decode
    form's pair count): every form of each --tiles config and the product's default config against bf16 (and
    --profile breakdowns)."""
    h, i, e, k = spec["hidden"], spec["intermediate"], spec["experts"], spec["top_k"]
    batches = random_batches(PREFILL_LAYERS, tokens, h, e, k, gen)
    x0, ids0, w0 = batches[0]
    ref = reference_moe_f32(x0, ids0, w0, layers[0], table, layout)

    wgu = [torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
           for _ in range(PREFILL_LAYERS)]
    wd = [torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(PREFILL_LAYERS)]
    xb = [(x.to(torch.bfloat16), ids, w) for x, ids, w in batches]

    def bf16_us():
        def bstep():
            for (x, ids, w), a, b in zip(xb, wgu, wd):
                bf16_grouped_layer(x, ids, w, a.transpose(1, 2), b.transpose(1, 2), e, True)
        return graph_us(bstep, PREFILL_LAYERS, reps=15)

    # (tiles as shown, form label, config): each --tiles row per form, then the product's own choice at this pair
    # count, as it runs
    cfgs = [(tiles, form, tile_cfg(*tiles, form, args.sorted))
            for tiles in (PREFILL_TILES[int(n)] for n in args.tiles.split(",")) for form in args.forms.split(",")]
    dflt = grouped.default_config(tokens * k, torch.device("cuda"))
    cfgs.append((tuple(dflt[c] for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")), "default", dflt))
    timings = {n: [] for n in range(len(cfgs))}
    base = [bf16_us()]
    for npass in range(2):
        for n, (tiles, form, cfg) in enumerate(cfgs):
            def step(cfg=cfg):
                for (x, ids, w), st in zip(batches, layers[:PREFILL_LAYERS]):
                    moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg)
            try:
                if npass == 0:
                    y = moe_experts("grouped", x0, ids0, w0, layers[0], table, layout, validate=False, config=cfg)
                    err = float((y.float() - ref).norm() / ref.norm())
                    out["checks"].append({"model": model, "tokens": tokens, "config": cfg, "rel_err": err})
                    if not err <= 2e-3:
                        print(f"  {model} {tiles} {form}: WRONG rel err {err:.2e}", flush=True)
                        timings[n] = None
                        continue
                if timings[n] is None:
                    continue
                timings[n].append(graph_us(step, PREFILL_LAYERS, reps=15))
            except Exception as exc:
                print(f"  {model} {tiles} {form}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                timings[n] = None
        base.append(bf16_us())
    bf16 = min(base)
    print(f"{model} prefill bf16 torch._grouped_mm: {[round(b, 1) for b in base]} us/layer", flush=True)
    for n, (tiles, form, cfg) in enumerate(cfgs):
        if not timings[n]:
            continue
        us = min(timings[n])
        row = {"model": model, "tokens": tokens, "kind": "prefill-grouped", "config": cfg,
               "us": us, "passes_us": timings[n], "ratio_to_bf16": bf16 / us}
        out["rows"].append(row)
        summary.append((model, f"prefill T={tokens}", tiles, form, us, bf16 / us))
    out["rows"].append({"model": model, "tokens": tokens, "kind": "prefill-bf16", "us": bf16,
                        "passes_us": base})
    if args.profile:
        dcfg = grouped.default_config(tokens * k, torch.device("cuda"))
        for form in FORMS:
            cfg = dict(dcfg, **FORMS[form])
            bd = kernel_breakdown(lambda cfg=cfg: [moe_experts("grouped", x, ids, w, st, table, layout,
                                                                validate=False, config=cfg)
                                                   for (x, ids, w), st in zip(batches, layers)], PREFILL_LAYERS)
            out["rows"].append({"model": model, "tokens": tokens, "kind": "prefill-kernels",
                                "config": cfg, "us": sum(bd.values()), "kernels_us": bd})
            print(f"{model} prefill kernels ({form}): {bd}", flush=True)
        bd = kernel_breakdown(lambda: [bf16_grouped_layer(x, ids, w, a.transpose(1, 2), b.transpose(1, 2), e, True)
                                       for (x, ids, w), a, b in zip(xb, wgu, wd)], PREFILL_LAYERS)
        out["rows"].append({"model": model, "tokens": tokens, "kind": "prefill-kernels",
                            "config": {"bf16": "torch._grouped_mm"}, "us": sum(bd.values()), "kernels_us": bd})
        print(f"{model} prefill kernels (bf16): {bd}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON record (schemas/kernel-explore.schema.json)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of %(default)s")
    ap.add_argument("--tiles", default="0,1,4,7,9",
                    help="indices into PREFILL_TILES timed with every form (default %(default)s)")
    ap.add_argument("--decode-grid", default="16,32,64:256,512:2,4:3",
                    help="grouped decode tiles with asm as BLOCK_N list:BLOCK_K list:warps list:stages list")
    ap.add_argument("--profile", action="store_true", help="add a per-kernel breakdown of the default configs")
    ap.add_argument("--decode-only", action="store_true", help="skip prefill: only the grouped decode tiles")
    ap.add_argument("--decode-tokens", default="1,8", help="decode batch sizes T (default %(default)s)")
    ap.add_argument("--prefill-tokens", default=str(PREFILL_TOKENS),
                    help="routed tokens of the sorted-pass rows, comma list (default %(default)s)")
    ap.add_argument("--forms", default=",".join(FORMS), help="nibble-decoding forms of the tile rows (%(default)s)")
    ap.add_argument("--sorted", action="store_true",
                    help="tile rows take the sorted runs at any pair count (config SORTED), the default row as it runs")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"copy": copy_bandwidth(1 << 30), "rows": [], "checks": []}
    print(f"copy {out['copy']['gbps']:.0f} GB/s", flush=True)
    summary = []
    for model in args.models.split(","):
        spec = MODELS[model]
        h, e, k = spec["hidden"], spec["experts"], spec["top_k"]
        layout, layers, table = model_layers(spec, gen)
        if not args.decode_only:
            for tokens in [int(v) for v in args.prefill_tokens.split(",")]:
                prefill(args, model, spec, layout, layers, table, gen, out, summary, tokens)
        # decode through the grouped executor: forms at the default tiles, 16 layers in one CUDA graph
        for tokens in [int(v) for v in args.decode_tokens.split(",")]:
            dec = random_batches(LAYERS, tokens, h, e, k, gen)
            dref = reference_moe_f32(*dec[0], layers[0], table, layout)
            dcfgs = [("plain", dict(grouped.default_config(tokens * k, torch.device("cuda")), **FORMS["plain"]))]
            for bn, bk, nw, ns in itertools.product(*([int(v) for v in part.split(",")]
                                                      for part in args.decode_grid.split(":"))):
                # the decode form (SORTED False): the GPU's default asks for sorted runs from 33 pairs
                dcfgs.append(("asm", {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "DOWN_BLOCK_N": bn,
                                      "DOWN_BLOCK_K": bk, "num_warps": nw, "num_stages": ns, "SORTED": False,
                                      **FORMS["asm"]}))
            for form, cfg in dcfgs:
                try:
                    y = moe_experts("grouped", *dec[0], layers[0], table, layout, validate=False, config=cfg)
                    err = float((y.float() - dref).norm() / dref.norm())
                    out["checks"].append({"model": model, "tokens": tokens, "config": cfg, "rel_err": err})
                    us = graph_us(lambda cfg=cfg: [moe_experts("grouped", x, ids, w, st, table, layout, validate=False,
                                                               config=cfg)
                                                   for (x, ids, w), st in zip(dec, layers)], LAYERS)
                except Exception as exc:
                    print(f"  {model} decode T={tokens} {form}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                out["rows"].append({"model": model, "tokens": tokens, "kind": "decode-grouped", "config": cfg, "us": us})
                summary.append((model, f"decode T={tokens}", (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"],
                                                              cfg["num_stages"]), form, us, err))
            # the topk-fused executor's default (words GEMV) on the same batches, for comparison
            us = graph_us(lambda: [moe_experts("topk-fused", x, ids, w, st, table, layout, validate=False)
                                   for (x, ids, w), st in zip(dec, layers)], LAYERS)
            out["rows"].append({"model": model, "tokens": tokens, "kind": "decode-topk-fused", "us": us})
            summary.append((model, f"decode T={tokens}", "default", "topk-fused", us, 0.0))
        layers.clear()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'model':12s} {'phase':12s} {'tiles (BM,BN,BK,nw,ns)':24s} {'form':10s} {'us':>8s} {'ratio/err':>10s}")
    for model, phase, tiles, form, us, r in summary:
        print(f"{model:12s} {phase:12s} {str(tiles):24s} {form:10s} {us:8.1f} {r:10.3g}")


if __name__ == "__main__":
    main()
