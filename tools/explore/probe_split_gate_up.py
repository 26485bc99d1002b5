"""GPU probe (not a test): the grouped executor's decode gate/up launch with K split in ranges (config "SPLIT_K",
``runmap.kernels.grouped.split_k``) against one program per (expert, column tile) over the whole K.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_split_gate_up.py --out $OUT/split-gate-up.json
    (schema kernel-explore)

Why: at batch 1 the launch is one wave of programs (OLMoE: 256 programs of 4 warps at 130 registers, all resident at
once), so it lasts one program's serial K loop; two ranges give 512 programs with half the loop each, which at 127
registers still fit one wave (4 programs per SM), then a small launch joins the ranges (silu(gate) * up).

For each model (``runmap.bench.kernel_workload.MODELS``) and T in {1, 2}: 16 layers of distinct weights routed as in
the kernel benchmark, each config timed as one CUDA graph of the 16 layers (per-layer µs, the lower of two passes,
configs alternating), each checked against the FP32 reference (``checks``). Fractions are of the expert bytes
(distinct experts' rows) over the 1 GiB device copy of the same run.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from runmap.atomic import write_json
from runmap.bench.kernel_workload import LAYERS, MODELS, copy_bandwidth, graph_us, model_layers, random_batches
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32

CONFIGS = ({"SPLIT_K": 1}, {"SPLIT_K": 2}, {"SPLIT_K": 2, "BLOCK_K": 128}, {"SPLIT_K": 4})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON written here")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth(1 << 30)
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows, checks = [], []
    for model, spec in MODELS.items():
        layout, layers, table = model_layers(spec, gen)
        for tokens in (1, 2):
            batches = random_batches(LAYERS, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            expert_bytes = sum(int(torch.unique(b[1]).numel()) for b in batches) * layout.row_bytes / LAYERS
            ref = reference_moe_f32(*batches[0], layers[0], table, layout)
            for cfg in CONFIGS:
                y = moe_experts("grouped", *batches[0], layers[0], table, layout, validate=False, config=cfg)
                checks.append({"model": model, "tokens": tokens, "config": cfg,
                               "rel_err": float((y.float() - ref).norm() / ref.norm())})

            def step(cfg):
                def run():
                    for (x, ids, w), st in zip(batches, layers):
                        moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg)
                return run

            passes = [[] for _ in CONFIGS]
            for _ in range(2):
                for i, cfg in enumerate(CONFIGS):
                    passes[i].append(graph_us(step(cfg), LAYERS))
            for cfg, ps in zip(CONFIGS, passes):
                us = min(ps)
                gbps = expert_bytes / us / 1e3
                rows.append({"model": model, "tokens": tokens, "kind": "decode-grouped", "config": cfg, "us": us,
                             "passes_us": ps, "bytes": expert_bytes, "gbps": gbps, "fraction": gbps / copy["gbps"]})
                print(f"{model:12s} T={tokens} {str(cfg):34s} {us:7.2f} us {rows[-1]['fraction']:.2f} of copy  "
                      f"rel_err {checks[len(rows) - 1]['rel_err']:.1e}", flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    write_json(Path(args.out), {"copy": copy, "rows": rows, "checks": checks})


if __name__ == "__main__":
    main()
