"""GPU probe (not a test): the grouped executor with its scales read once per program before the K loop, against
one scale load per K tile (config "PRELOAD_SCALES"; ``runmap.kernels.core.dot_tiles`` SCALE_COLS).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_scale_preload.py --out $OUT/scale-preload.json
    (schema kernel-explore)

Why: in the compiled loop the weight and activation tiles arrive through asynchronous copies several tiles ahead,
but the per-row scale of a tile was a plain load that the same iteration consumed, so each iteration waited one
memory latency; a decode program runs only 4-8 iterations.

For each model (``runmap.bench.kernel_workload.MODELS``) and T in {1, 8, 32, 512}: 16 layers of distinct weights
routed as in the kernel benchmark, each form timed as one CUDA graph of the 16 layers (per-layer µs, the lower of two
passes, the forms alternating), both forms' outputs compared bitwise and against the FP32 reference (``checks``).
Fractions are of the expert bytes (distinct experts' rows) over the 1 GiB device copy of the same run.
"""
from __future__ import annotations

import torch

from runmap.atomic import write_json
from runmap.bench.kernel_workload import LAYERS, MODELS, graph_us, model_layers, probe_start, random_batches
from runmap.kernels.executors import moe_experts
from runmap.kernels import grouped
from runmap.kernels.grouped import DECODE_MAX_PAIRS
from runmap.kernels.reference import reference_moe_f32

TOKENS = (1, 8, 32, 512)


def main() -> None:
    out_path, gen, copy = probe_start(__doc__)
    rows, checks = [], []
    for model, spec in MODELS.items():
        layout, layers, table = model_layers(spec, gen)
        for tokens in TOKENS:
            batches = random_batches(LAYERS, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            expert_bytes = sum(int(torch.unique(b[1]).numel()) for b in batches) * layout.row_bytes / LAYERS
            outs = {}
            ref = reference_moe_f32(*batches[0], layers[0], table, layout)
            for pre in (False, True):
                cfg = {"PRELOAD_SCALES": pre}
                outs[pre] = moe_experts("grouped", *batches[0], layers[0], table, layout, validate=False, config=cfg)
                checks.append({"model": model, "tokens": tokens, "config": cfg,
                               "rel_err": float((outs[pre].float() - ref).norm() / ref.norm())})
            same = bool(torch.equal(outs[False], outs[True]))
            checks[-1]["bitwise_equal_to_per_tile"] = same

            def step(cfg):
                def run():
                    for (x, ids, w), st in zip(batches, layers):
                        moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg)
                return run

            passes = {False: [], True: []}
            for _ in range(2):
                for pre in (False, True):
                    passes[pre].append(graph_us(step({"PRELOAD_SCALES": pre}), LAYERS))
            for pre in (False, True):
                us = min(passes[pre])
                gbps = expert_bytes / us / 1e3
                pairs = tokens * spec["top_k"]  # the form the executor takes (the GPU's default sorts from 33 pairs)
                sorted_pass = pairs > DECODE_MAX_PAIRS or grouped.default_config(pairs, torch.device("cuda")).get(
                    "SORTED", False)
                rows.append({"model": model, "tokens": tokens,
                             "kind": "prefill-grouped" if sorted_pass else "decode-grouped",
                             "config": {"PRELOAD_SCALES": pre}, "us": us, "passes_us": passes[pre],
                             "bytes": expert_bytes, "gbps": gbps, "fraction": gbps / copy["gbps"]})
            off, on = rows[-2]["us"], rows[-1]["us"]
            print(f"{model:12s} T={tokens:<4d} per-tile {off:8.2f} us  preloaded {on:8.2f} us  "
                  f"({off / on:.3f}x; {rows[-1]['fraction']:.2f} of copy; bitwise equal {same})", flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    write_json(out_path, {"copy": copy, "rows": rows, "checks": checks})


if __name__ == "__main__":
    main()
