"""GPU probe (not a test): host time of one eager executor call (Python checks, torch ops, Triton launch
overhead) against the GPU time of the same call, and a cProfile of where the host time goes.

    PYTHONPATH=. python3 tools/explore/probe_host_overhead.py      (CUDA only; ~20 s)
"""
import cProfile
import io
import pstats
import statistics
import time

import torch

from runmap.bench.cuda_timing import event_times_ms
from runmap.bench.kernel_workload import MODELS, graph_of, median, random_layer, routing
from runmap.format.qpack import RowLayout
from runmap.kernels.executors import moe_experts


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    spec = MODELS["olmoe"]
    layout = RowLayout.build(spec["hidden"], spec["intermediate"])
    st = random_layer(layout, spec["experts"], gen)
    table = torch.arange(spec["experts"], dtype=torch.int32, device="cuda")
    for executor, tokens in (("grouped", 512), ("topk-fused", 1), ("grouped", 1)):
        ids, w = routing(tokens, spec["experts"], spec["top_k"], gen)
        x = torch.randn(tokens, spec["hidden"], device="cuda", generator=gen).half()

        def call():
            return moe_experts(executor, x, ids, w, st, table, layout, validate=False)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        host = []
        for _ in range(50):
            t = time.perf_counter()
            call()
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        gpu = median(event_times_ms(graph_of(call), reps=30)) * 1e3
        print(f"{executor} T={tokens}: host issue time {statistics.median(host) * 1e6:.1f} us per call, "
              f"GPU time (graph) {gpu:.1f} us", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            call()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print("\n".join(s.getvalue().splitlines()[:34]), flush=True)


if __name__ == "__main__":
    main()
