"""GPU probe (not a test): a one-token shared expert (Qwen1.5-MoE) riding in the grouped executor's launches
(``runmap.kernels.grouped.SharedExpert``) against the two launches of its own after them, per tile of its programs.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_shared_ride.py --out $OUT/shared-ride.json
    (schema kernel-explore)

A batch-1 MoE block of Qwen1.5-MoE reads 4 routed experts (INT4, ~18 MB) and the shared expert (fp16, 69 MB). Kinds,
each timed as one CUDA graph of 16 layers of distinct weights (per-layer µs, the lower of two passes, the variants
alternating), launched as the engine launches them (chained on Hopper):
  moe-block-two-launch   the grouped executor's three launches, then shared_expert_one_row's two
  moe-block-riding       grouped_moe(shared=): three launches, per config of the shared expert's tiles
  routed-only            the grouped executor alone (what the routed launches cost without the shared expert)
  shared-only            shared_expert_one_row alone
``checks``: each riding config's output against the two-launch one (max |diff|, in ``config``) and both against an
FP32 reference of the whole block (rel_err). Fractions: the block's bytes (distinct experts' rows + the shared expert's
fp16 weights) over the same run's device copy.
"""
from __future__ import annotations

import torch

from runmap.atomic import write_json
from runmap.bench.kernel_workload import LAYERS, MODELS, graph_us, model_layers, probe_start, random_batches
from runmap.kernels.executors import moe_experts
from runmap.kernels.fused_ops import shared_expert_one_row
from runmap.kernels.grouped import SharedExpert
from runmap.kernels.reference import reference_moe_f32

SHARED_INTERMEDIATE = 5632  # Qwen1.5-MoE-A2.7B's shared expert
# (SHARED_BLOCK_N, SHARED_BLOCK_K, SHARED_DOWN_BLOCK_N, SHARED_DOWN_BLOCK_K): the first tiles (the one-row GEMV's) first
RIDE_CONFIGS = [(16, 512, 4, 512), (16, 512, 4, 1024), (16, 512, 4, 2048), (16, 512, 8, 1024), (8, 1024, 4, 1024),
                (32, 256, 4, 1024), (16, 512, 2, 2048), (8, 512, 4, 1024)]


def main() -> None:
    out_path, gen, copy = probe_start(__doc__)
    spec = MODELS["qwen1.5-moe"]
    hid, si = spec["hidden"], SHARED_INTERMEDIATE
    layout, layers, table = model_layers(spec, gen)
    batches = random_batches(LAYERS, 1, hid, spec["experts"], spec["top_k"], gen)
    shared = [((torch.randn(2 * si + 1, hid, device="cuda", generator=gen) / hid ** 0.5).half(),
               (torch.randn(hid, si, device="cuda", generator=gen) / si ** 0.5).half()) for _ in range(LAYERS)]
    block_bytes = (4 * layout.row_bytes + (3 * si + 1) * hid * 2)

    def two_launch():
        for (x, ids, w), st, (gug, down) in zip(batches, layers, shared):
            shared_expert_one_row(x, gug, down, moe_experts("grouped", x, ids, w, st, table, layout, validate=False))

    def routed_only():
        for (x, ids, w), st in zip(batches, layers):
            moe_experts("grouped", x, ids, w, st, table, layout, validate=False)

    def shared_only():
        for (x, _ids, _w), (gug, down) in zip(batches, shared):
            shared_expert_one_row(x, gug, down, x)

    def riding(cfg):
        def run():
            for (x, ids, w), st, (gug, down) in zip(batches, layers, shared):
                moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg,
                            shared=SharedExpert(x, gug, down))
        return run

    configs = [dict(zip(("SHARED_BLOCK_N", "SHARED_BLOCK_K", "SHARED_DOWN_BLOCK_N", "SHARED_DOWN_BLOCK_K"), c))
               for c in RIDE_CONFIGS]
    # checks on layer 0
    (x, ids, w), st, (gug, down) = batches[0], layers[0], shared[0]
    two = shared_expert_one_row(x, gug, down, moe_experts("grouped", x, ids, w, st, table, layout, validate=False))
    gu = x.float() @ gug.float().t()  # (1, 2 Is + 1)
    ref = reference_moe_f32(x, ids, w, st, table, layout) + torch.sigmoid(gu[:, -1:]) * (
        (torch.nn.functional.silu(gu[:, :si]) * gu[:, si:-1]) @ down.float().t())
    rel = lambda y: float((y.float() - ref).norm() / ref.norm())
    checks = [{"model": "qwen1.5-moe", "tokens": 1, "config": {"kind": "moe-block-two-launch"}, "rel_err": rel(two)}]
    for cfg in configs:
        y = moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg,
                        shared=SharedExpert(x, gug, down))
        checks.append({"model": "qwen1.5-moe", "tokens": 1,
                       "config": dict(cfg, kind="moe-block-riding",
                                      max_abs_diff_to_two_launch=float((y.float() - two.float()).abs().max())),
                       "rel_err": rel(y)})
    variants = [("moe-block-two-launch", {}, two_launch), ("routed-only", {}, routed_only),
                ("shared-only", {}, shared_only)] + [("moe-block-riding", cfg, riding(cfg)) for cfg in configs]
    passes = {i: [] for i in range(len(variants))}
    for _ in range(2):
        for i, (_kind, _cfg, fn) in enumerate(variants):
            fn()
            passes[i].append(graph_us(fn, LAYERS))
    rows = []
    base = min(passes[0])
    for i, (kind, cfg, _fn) in enumerate(variants):
        us = min(passes[i])
        nbytes = {"routed-only": 4 * layout.row_bytes, "shared-only": (3 * si + 1) * hid * 2}.get(kind, block_bytes)
        gbps = nbytes / us / 1e3
        rows.append({"model": "qwen1.5-moe", "tokens": 1, "kind": kind, "config": cfg, "us": us, "passes_us": passes[i],
                     "bytes": nbytes, "gbps": gbps, "fraction": gbps / copy["gbps"]})
        tiles = ",".join(str(v) for v in cfg.values()) or "-"
        print(f"{kind:22s} {tiles:16s} {us:8.2f} us/layer  {base / us:5.3f}x two-launch  {gbps / copy['gbps']:.2f} of copy",
              flush=True)
    for c in checks:
        print(f"check {c['config']}: rel_err {c['rel_err']:.2e}", flush=True)
    write_json(out_path, {"copy": copy, "rows": rows, "checks": checks})


if __name__ == "__main__":
    main()
