"""GPU probe (not a test, not the official record): split-K for the grouped executor's decode launches.

At decode sizes each grouped stage runs one program per (expert, BLOCK_N columns): 256-512 programs, under one wave
of the H200, with half the cycles showing no eligible warp (results/kernels/README.md). Config SPLIT_K / DOWN_SPLIT_K
(kernels/grouped.py) split K over a third grid axis. This probe

1. times the grouped decode layer (16 layers of distinct random weights in one CUDA graph, per layer) at the OLMoE
   and Qwen1.5-MoE expert shapes, T = 1 and 8, for the default config and a grid of (SPLIT_K, DOWN_SPLIT_K,
   BLOCK_N), each checked against the FP32 reference;
2. with --pack, decodes 128 tokens after a 128-token prompt through the engine (CUDA graphs, full residency) at
   batch 1 and 8 with the default config and with the best split config of step 1 for that batch, in the same
   process, so the end-to-end effect is measured in one run.

    PYTHONPATH=. python3 tools/explore/probe_split_k.py --out $OUT/split-k.json [--pack olmoe=DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from runmap.bench.kernel_workload import LAYERS, MODELS, copy_bandwidth, graph_us, model_layers, random_batches
from runmap.kernels import grouped
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32

PACK_MODELS = {"olmoe": "olmoe", "qwen": "qwen1.5-moe"}  # --pack NAME -> MODELS key


def sweep(args, out) -> dict:
    """Step 1; returns {(model, tokens): best split config} (the default's tiles plus the best splits)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    best = {}
    grid = [tuple(int(v) for v in part.split(",")) for part in args.grid.split(":")]
    for model in args.models.split(","):
        spec = MODELS[model]
        layout, layers, table = model_layers(spec, gen)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            dec = random_batches(LAYERS, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            ref = reference_moe_f32(*dec[0], layers[0], table, layout)
            base = grouped.default_config(tokens * spec["top_k"], torch.device("cuda"))
            cfgs = [dict(base)] + [dict(base, SPLIT_K=s1, DOWN_SPLIT_K=s2, **({"BLOCK_N": bn, "DOWN_BLOCK_N": bn}
                                                                               if bn else {}))
                                   for s1, s2, bn in itertools.product(*grid) if (s1, s2, bn) != (1, 1, 0)]
            rows = []
            for cfg in cfgs:
                y = moe_experts("grouped", *dec[0], layers[0], table, layout, validate=False, config=cfg)
                err = float((y.float() - ref).norm() / ref.norm())
                out["checks"].append({"model": model, "tokens": tokens, "config": cfg, "rel_err": err})
                us = graph_us(lambda cfg=cfg: [moe_experts("grouped", x, ids, w, st, table, layout, validate=False,
                                                           config=cfg) for (x, ids, w), st in zip(dec, layers)],
                              LAYERS)
                out["rows"].append({"model": model, "tokens": tokens, "kind": "decode-grouped", "config": cfg,
                                    "us": us})
                rows.append((us, err, cfg))
                print(f"{model:12s} T={tokens} split {cfg.get('SPLIT_K', 1)}/{cfg.get('DOWN_SPLIT_K', 1)} "
                      f"BN {cfg['BLOCK_N']:3d}: {us:7.2f} us/layer  rel err {err:.1e}", flush=True)
            ok = [r for r in rows if r[1] <= 2e-3]
            us0 = rows[0][0]
            if not ok:
                print(f"{model:12s} T={tokens}: no config within 2e-3 of the reference", flush=True)
                continue
            b = min(ok, key=lambda r: r[0])
            best[(model, tokens)] = b[2]
            print(f"{model:12s} T={tokens}: default {us0:.2f} us, best {b[0]:.2f} us ({us0 / b[0]:.2f}x) "
                  f"{ {k: b[2].get(k) for k in ('SPLIT_K', 'DOWN_SPLIT_K', 'BLOCK_N')} }", flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    return best


def engine_decode(args, best, out) -> None:
    """Step 2: the engine's decode tok/s with the default config and with the best split config, same process."""
    from runmap.engine.engine import Engine

    for spec in args.pack:
        name, pack = spec.split("=", 1)
        model = PACK_MODELS[name]
        for batch in [int(v) for v in args.batches.split(",")]:
            real_default = grouped.default_config
            eng = Engine.from_pack(pack, executor="grouped", max_batch=batch, max_seq_len=256)
            prompts = [[(17 * b + 5 * i) % 1000 + 10 for i in range(128)] for b in range(batch)]
            k = eng.cfg.top_k
            results = {}
            for label in ("default", "split"):
                split = best.get((model, batch)) if label == "split" else None
                if label == "split":
                    if split is None:
                        continue
                    extra = {key: split[key] for key in ("SPLIT_K", "DOWN_SPLIT_K", "BLOCK_N", "DOWN_BLOCK_N")
                             if key in split}

                    def patched(n_pairs, device, _extra=extra, _n=batch * k):
                        cfg = real_default(n_pairs, device)
                        return dict(cfg, **_extra) if n_pairs == _n else cfg
                    grouped.default_config = patched
                    eng.reset_graphs()
                try:
                    eng.generate(prompts, max_new_tokens=128, ignore_eos=True)  # warm: capture every bucket used
                    rates = [eng.run(prompts, max_new_tokens=128, ignore_eos=True).decode_tok_s
                             for _ in range(args.repeats)]
                    results[label] = sorted(rates)[len(rates) // 2]
                finally:
                    grouped.default_config = real_default
                row = {"model": model, "batch": batch, "config": label if split is None else extra,
                       "decode_tok_s": results[label], "repeats": rates}
                out.setdefault("engine_decode", []).append(row)
                print(f"engine {name} b{batch} {label}: {results[label]:.1f} tok/s {rates}", flush=True)
            if "split" in results:
                print(f"engine {name} b{batch}: split / default = {results['split'] / results['default']:.3f}",
                      flush=True)
            eng.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON record (schemas/kernel-explore.schema.json)")
    ap.add_argument("--models", default="olmoe,qwen1.5-moe", help="comma list of %(default)s")
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes T (default %(default)s)")
    ap.add_argument("--grid", default="1,2,4:1,2,4:0",
                    help="SPLIT_K list:DOWN_SPLIT_K list:BLOCK_N list, BLOCK_N 0 = the default's (default %(default)s)")
    ap.add_argument("--pack", action="append", default=[], help="NAME=DIR (NAME olmoe or qwen): step 2 on this pack")
    ap.add_argument("--batches", default="1,8", help="engine batch sizes of step 2 (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed engine runs per config (default %(default)s)")
    args = ap.parse_args()
    out = {"copy": copy_bandwidth(1 << 30), "rows": [], "checks": []}
    print(f"copy {out['copy']['gbps']:.0f} GB/s", flush=True)
    best = sweep(args, out)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.pack:
        engine_decode(args, best, out)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
