"""GPU probe (not a test): one decode layer of each executor, for Nsight Compute to read its hardware counters.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python3 tools/explore/probe_decode_ncu.py > $OUT/ncu-decode.log

Builds one random layer per model (``runmap.bench.kernel_workload.model_layers``), compiles and warms both executors up
outside the profiled range, then runs one layer call of topk-fused and of grouped for each model and T in
``--tokens`` inside ``torch.cuda.profiler.start() / stop()`` (ncu replays each kernel with its caches flushed,
so the weights come from HBM as in a real decode step). Prints which call is which, in launch order.
"""
from __future__ import annotations

import argparse

import torch

from runmap.bench.kernel_workload import MODELS, model_layers, random_batches
from runmap.kernels.executors import moe_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes T (default %(default)s)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for model, spec in MODELS.items():
        layout, layers, table = model_layers(spec, gen, n=1)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            (x, ids, w), = random_batches(1, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            for executor in ("topk-fused", "grouped"):
                calls.append((f"{model} T={tokens} {executor}", executor, x, ids, w, layers[0], table, layout))
    for _name, executor, *rest in calls:  # compile and warm up, not profiled
        moe_experts(executor, *rest, validate=False)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, executor, *rest in calls:
        print(f"call: {name}", flush=True)
        moe_experts(executor, *rest, validate=False)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
