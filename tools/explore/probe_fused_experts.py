"""GPU probe (not a test, not the official record): the grouped executor's sliced form (a decode layer's routed
experts in ONE launch, config SLICED) against its two launches (gate/up, then down), each followed by the slot sum.

The question (issue 18 item 2; docs/kernels.md, "What bounds a decode expert launch"): an OLMoE batch-1 layer's
grouped launches take ~20 us for 24 MB of weights, so a launch boundary, not the bytes, bounds them. Here each program
(``runmap.kernels.grouped.sliced_experts``) owns one expert and one slice of BI intermediate columns: it computes h = fp16(silu(x Wg^T) * (x Wu^T)) for its BI
columns (the gate/up rows it alone reads), then at once that slice's contribution to the down projection,
h[:, slice] Wd[:, slice]^T for every hidden row, times the pair's gate weight, into its own fp32 partial
part[pair, slice, :]. No program waits for another; a second launch sums the k x (I / BI) partials of each token in a
fixed order (deterministic, no atomics). Down's weights are read as BI / 2-byte pieces of each hidden row (the pack's
row layout); BI divides the quantization block, so each piece has one scale.

Full residency, no shared expert; OLMoE and Qwen1.5-MoE expert shapes at batch 1 and 8, 16 layers of distinct
weights in one CUDA graph; the default two-launch form first and last; each variant checked against the FP32
reference before it is timed.

    PYTHONPATH=. python3 tools/explore/probe_fused_experts.py --out $OUT/fused-experts.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


# config overrides of the grouped executor's sliced form (grouped.sliced_experts), each timed beside the default
SLICED_CONFIGS = [
    {"SLICE_I": 64, "BLOCK_K": 256, "SLICE_BLOCK_N": 256, "num_warps": 4, "num_stages": 3},
    {"SLICE_I": 32, "BLOCK_K": 256, "SLICE_BLOCK_N": 256, "num_warps": 4, "num_stages": 3},
    {"SLICE_I": 64, "BLOCK_K": 256, "SLICE_BLOCK_N": 256, "num_warps": 8, "num_stages": 3},
    {"SLICE_I": 64, "BLOCK_K": 256, "SLICE_BLOCK_N": 256, "num_warps": 4, "num_stages": 3, "SLICE_PREFETCH": True},
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON written here")
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes (default 1,8)")
    ap.add_argument("--cases", help="only these model:tokens pairs, e.g. olmoe:1,olmoe:8,qwen1.5-moe:8")
    ap.add_argument("--configs", type=int, default=len(SLICED_CONFIGS),
                    help="time the first N sliced configs (default all %(default)s)")
    args = ap.parse_args()
    cases = None if not args.cases else {tuple(c.rsplit(":", 1)) for c in args.cases.split(",")}
    from runmap.bench.kernel_workload import MODELS, LAYERS, copy_bandwidth, graph_us, model_layers, random_batches
    from runmap.kernels.executors import moe_experts
    from runmap.kernels.reference import reference_moe_f32
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth(1 << 30)
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows = []
    for model, spec in MODELS.items():
        layout, layers, table = model_layers(spec, gen)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            if cases is not None and (model, str(tokens)) not in cases:
                continue
            batches = random_batches(LAYERS, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            union = sum(int(torch.unique(b[1]).numel()) for b in batches) / LAYERS
            floor_us = union * layout.row_bytes / (copy["gbps"] * 1e3)
            ref = reference_moe_f32(*batches[0], layers[0], table, layout)
            variants = [("grouped", None)] + [("sliced", dict(c, SLICED=True, SORTED=False))
                                               for c in SLICED_CONFIGS[:args.configs]] + \
                [("grouped", None)]
            for name, cfg in variants:
                def layer(b, st, cfg=cfg):
                    return moe_experts("grouped", *b, st, table, layout, validate=False, config=cfg)
                try:
                    y = layer(batches[0], layers[0])
                    err = float((y.float() - ref).norm() / ref.norm())
                    us = graph_us(lambda: [layer(b, st) for b, st in zip(batches, layers)], LAYERS) \
                        if err <= 2e-3 else None
                except Exception as exc:  # a config the compiler rejects: say so, go on
                    print(f"{model} T={tokens} {name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    continue
                row = {"model": model, "tokens": tokens, "variant": name, "config": cfg, "rel_err": err, "us": us,
                       "union_experts": union, "floor_us": floor_us,
                       "fraction_of_copy": None if us is None else floor_us / us}
                rows.append(row)
                print(f"{model:12s} T={tokens} {name:8s} {json.dumps(cfg) if cfg else '':78s} err {err:.1e} "
                      f"{'WRONG' if us is None else f'{us:7.2f} us  {floor_us / us:.2f} of copy'}", flush=True)
                Path(args.out).write_text(json.dumps({"copy": copy, "rows": rows}, indent=1))  # kept if cut short
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
