"""GPU exploration (not a test, not the official record): decode-time tile sweep of the topk-fused
kernels ("tiles" = kernels/topk_fused.py, "blocks" = kernels/gemv.py, "words" = kernels/gemv_words.py), each
launch timed alone, and the
router (torch vs the two-launch Triton router). 16 layers of distinct weights captured in one CUDA graph.

    PYTHONPATH=. python3 tools/explore/explore_decode.py --out $OUT/explore.json   (committed: results/kernels/explore/h200-decode.json)
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from runmap.bench.kernel_workload import LAYERS, MODELS, copy_bandwidth, graph_us, model_layers, random_batches
from runmap.kernels.reference import reference_moe_f32
from runmap.kernels.topk_fused import topk_down, topk_gate_up


def layer_sweep(args) -> None:
    """Whole topk-fused layers (16 in one CUDA graph) per config of --layer-configs, two passes each."""
    from runmap.kernels.executors import moe_experts
    cfgs = json.loads(Path(args.layer_configs).read_text())
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"copy": copy_bandwidth(1 << 30), "rows": [], "checks": []}
    copy = out["copy"]["gbps"]
    print(f"copy {copy:.0f} GB/s", flush=True)
    for model, spec in MODELS.items():
        hdim, e, k = spec["hidden"], spec["experts"], spec["top_k"]
        layout, layers, table = model_layers(spec, gen)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            batches = random_batches(LAYERS, tokens, hdim, e, k, gen)
            nbytes = sum(int(torch.unique(b[1]).numel()) for b in batches) * layout.row_bytes / LAYERS
            ref = reference_moe_f32(*batches[0], layers[0], table, layout)
            times = {n: [] for n in range(len(cfgs))}
            for _pass in range(2):
                for n, cfg in enumerate(cfgs):
                    try:
                        if _pass == 0:
                            y = moe_experts("topk-fused", *batches[0], layers[0], table, layout, validate=False,
                                            config=cfg)
                            err = float((y.float() - ref).norm() / ref.norm())
                            out["checks"].append({"model": model, "tokens": tokens, "config": cfg, "rel_err": err})
                            if not err <= 2e-3:
                                print(f"  {model} T={tokens} {cfg}: WRONG rel err {err:.2e}", flush=True)
                                times[n] = None
                        if times[n] is None:
                            continue
                        times[n].append(graph_us(lambda cfg=cfg: [
                            moe_experts("topk-fused", x, ids, w, st, table, layout, validate=False, config=cfg)
                            for (x, ids, w), st in zip(batches, layers)], LAYERS))
                    except Exception as exc:
                        print(f"  {model} T={tokens} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        times[n] = None
            for n, cfg in enumerate(cfgs):
                if not times[n]:
                    continue
                us = min(times[n])
                gbps = nbytes / us / 1e3
                out["rows"].append({"model": model, "tokens": tokens, "kind": "layer-topk-fused", "config": cfg,
                                    "us": us, "passes_us": times[n], "gbps": gbps, "fraction": gbps / copy})
                print(f"  {model} T={tokens} {us:7.2f} us {gbps / copy:.2f} of copy {[round(t, 2) for t in times[n]]} {cfg}",
                      flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON record (schemas/kernel-explore.schema.json), e.g. results/kernels/explore/h200-decode.json")
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes T to sweep (default 1,8)")
    ap.add_argument("--words-gate-up", default="16,32,64:1,2:2,4,8",
                    help="words grid of launch 1 as BLOCK_N list:SUB list:num_warps list (default %(default)s)")
    ap.add_argument("--words-down", default="8,16,32:1,2:2,4,8",
                    help="words grid of launch 2, same form (default %(default)s)")
    ap.add_argument("--layer-configs", help="JSON list of topk-fused configs: time only whole layers (both launches) "
                    "with each, checked against the FP32 reference (kind layer-topk-fused)")
    args = ap.parse_args()
    if args.layer_configs:
        return layer_sweep(args)

    def grid(spec):
        return itertools.product(*([int(v) for v in part.split(",")] for part in spec.split(":")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"copy": copy_bandwidth(1 << 30), "rows": []}
    copy = out["copy"]["gbps"]
    print(f"copy {copy:.0f} GB/s", flush=True)
    for model, spec in MODELS.items():
        hdim, idim, e, k = spec["hidden"], spec["intermediate"], spec["experts"], spec["top_k"]
        layout, layers, table = model_layers(spec, gen)
        gu_bytes = 2 * idim * (hdim // 2 + 2 * -(-hdim // 256))
        dn_bytes = hdim * (idim // 2 + 2 * -(-idim // 256))
        for tokens in [int(v) for v in args.tokens.split(",")]:
            batches = random_batches(LAYERS, tokens, hdim, e, k, gen)
            hs = [torch.randn(tokens * k, idim, device="cuda", generator=gen).half() for _ in range(LAYERS)]
            pairs = tokens * k

            def run(kind, cfg):
                def gu():
                    for (x, ids, w), st in zip(batches, layers):
                        topk_gate_up(x, ids, st, table, layout, cfg)

                def dn():
                    for (x, ids, w), st, h in zip(batches, layers, hs):
                        topk_down(h, ids, w, st, table, layout, cfg)

                fn = gu if kind == "gate_up" else dn
                try:
                    us = graph_us(fn, LAYERS)
                except Exception as exc:
                    print(f"  {model} T={tokens} {kind} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    return None
                nbytes = pairs * (gu_bytes if kind == "gate_up" else dn_bytes)
                gbps = nbytes / us / 1e3
                row = {"model": model, "tokens": tokens, "kind": kind, "config": cfg, "us": us, "gbps": gbps,
                       "fraction": gbps / copy}
                out["rows"].append(row)
                return row

            # correctness of the whole topk-fused path with the first blocks config, against FP32 reference
            x, ids, w = batches[0]
            ref = reference_moe_f32(x, ids, w, layers[0], table, layout)
            # "blocks": the previous sweep's best two per launch; "words": the full grid
            gu_cfgs = [{"KERNEL": "blocks", "BLOCK_N": 16, "SUB": 2, "num_warps": 8},
                       {"KERNEL": "blocks", "BLOCK_N": 16, "SUB": 4, "num_warps": 4}]
            gu_cfgs += [{"KERNEL": "words", "BLOCK_N": bn, "SUB": sub, "num_warps": nw}
                        for bn, sub, nw in grid(args.words_gate_up)]
            dn_cfgs = [{"KERNEL": "blocks", "DOWN_BLOCK_N": 8, "DOWN_SUB": 2, "DOWN_num_warps": 8},
                       {"KERNEL": "blocks", "DOWN_BLOCK_N": 16, "DOWN_SUB": 1, "DOWN_num_warps": 4}]
            dn_cfgs += [{"KERNEL": "words", "DOWN_BLOCK_N": bn, "DOWN_SUB": sub, "DOWN_num_warps": nw}
                        for bn, sub, nw in grid(args.words_down)]
            best = {}
            for kind, cfgs in (("gate_up", gu_cfgs), ("down", dn_cfgs)):
                res = [r for r in (run(kind, c) for c in cfgs) if r]
                res.sort(key=lambda r: r["us"])
                best[kind] = res[0]["config"] if res else None
                for r in res[:4]:
                    print(f"  {model} T={tokens} {kind:7s} {r['us']:7.2f} us {r['gbps']:6.0f} GB/s "
                          f"{r['fraction']:.2f}  {r['config']}", flush=True)
                for fam in ("blocks", "words"):
                    of = [r for r in res if r["config"]["KERNEL"] == fam]
                    if of:
                        print(f"  {model} T={tokens} {kind:7s} best {fam} {of[0]['us']:.2f} us "
                              f"{of[0]['fraction']:.2f} of copy", flush=True)
            cfg = dict(best["gate_up"] or {}, **{kk: v for kk, v in (best["down"] or {}).items() if kk.startswith("DOWN")})
            cfg["DOWN_KERNEL"] = (best["down"] or {}).get("KERNEL", cfg.get("KERNEL"))
            from runmap.kernels.executors import moe_experts
            y = moe_experts("topk-fused", x, ids, w, layers[0], table, layout, config=cfg)
            err = float((y.float() - ref).norm() / ref.norm())
            out.setdefault("checks", []).append({"model": model, "tokens": tokens, "config": cfg, "rel_err": err})
            print(f"  {model} T={tokens} best-combo rel err {err:.2e}", flush=True)

        # router: torch vs fused, 16 layers graph
        from runmap.kernels.fused_ops import route_fused
        from runmap.engine.model import route
        r32 = [torch.randn(e, hdim, device="cuda", generator=gen) * 0.02 for _ in range(LAYERS)]
        for tokens in (1, 8):
            hh = torch.randn(tokens, hdim, device="cuda", generator=gen).half()
            a = route(hh, r32[0], k, False)
            b = route_fused(hh, r32[0], k, False)
            same = bool(torch.equal(a[0], b[0]))
            for name, fn in (("torch", route), ("fused", route_fused)):
                us = graph_us(lambda fn=fn: [fn(hh, r, k, False) for r in r32], LAYERS)
                out["rows"].append({"model": model, "tokens": tokens, "kind": "router-" + name, "us": us,
                                    "same_ids": same})
                print(f"  {model} T={tokens} router {name}: {us:.2f} us/layer (same ids {same})", flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
