"""The cpu-native kernel's work split and schedule against its batch-1 rate (issue 25, item 1: >= 0.6 of the host
read), per expert shape and thread count, from DRAM and from the last-level cache.

At batch 1 on the H200 host the kernel streams 44-54 GB/s of OLMoE expert bytes with 16 threads where an int64 sum
reads 80-100 GB/s (results/cpu-experts/README.md), and one thread about 5 GB/s where a one-thread sum reads 10. This
builds the kernel with other work splits (kernels/cpu_native.c's compile-time options, ``NativeLayer(defines=)``:
ROW_CHUNK output rows per work item of the gate/up loop, DOWN_CHUNK of the down loop, ROW_SCHEDULE the loops'
OpenMP schedule, STAGE_OVERLAP one ordered work list in which a down item waits only for its own expert; none changes
a result) and times each on batch-1 layer calls through the engine's path (``prepare_arrays`` on host arrays, then
the call), top-k experts (8 for OLMoE, 4 for Qwen1.5-MoE) taken in turn from random qpacked rows: ``dram`` walks a
set larger than the last-level cache, ``cached`` repeats the same k experts (what the arithmetic alone allows). Each
variant's time is the median and the best of the steps in --seconds; GB/s = the call's expert bytes / that time. An
int64-sum read at the same thread count is measured before and after. On the cached data (the same experts in
every variant) each variant's output is checked bitwise against the first variant's.

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_chunks.py [--shapes olmoe,qwen1.5-moe] [--threads all,1]
        [--seconds 1.0] [--variants "LABEL;LABEL"] [--precisions i16,fp32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from runmap.format.qpack import RowLayout
from runmap.kernels import cpu_native

VARIANTS = {  # label: compile-time options (the first is the reference of the bitwise check)
    "64 rows, guided (default)": (),
    "16 rows, dynamic": ("ROW_CHUNK=16", "ROW_SCHEDULE=dynamic,1"),
    "32 rows, guided": ("ROW_CHUNK=32",),
    "rows static (contiguous)": ("ROW_CHUNK=1", "ROW_SCHEDULE=static"),
    "overlap, 64 rows": ("STAGE_OVERLAP=1",),
    "overlap, 32 rows": ("STAGE_OVERLAP=1", "ROW_CHUNK=32"),
    "overlap, 16 rows": ("STAGE_OVERLAP=1", "ROW_CHUNK=16"),
}
SHAPES = {"olmoe": (2048, 1024, 8), "qwen1.5-moe": (2048, 1408, 4)}  # hidden, expert intermediate, top-k


def read_gbs(nbytes: int, repeats: int = 5) -> float:
    a = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def expert_rows(layout: RowLayout, n: int) -> torch.Tensor:
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for sec in ("gate.scale", "up.scale", "down.scale"):  # finite scales: random bytes could be inf / NaN halves
        s = layout.section(sec)
        rows[:, s.offset:s.offset + s.nbytes] = torch.full((s.nbytes // 2,), 0.01, dtype=torch.float16).view(torch.uint8)
    return rows


def time_variant(nl, rows, n: int, k: int, x: np.ndarray, threads: int, seconds: float, cached: bool, step0: int):
    """(median s, best s, output of the first call, steps) of batch-1 layer calls through prepare_arrays."""
    out = np.empty_like(x, dtype=np.float32)
    args = (list(range(k + 1)), [0] * k, [1.0 / k] * k)
    first = None
    times, step, t_end = [], step0, time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        experts = list(range(k)) if cached else [(step * k + j) % n for j in range(k)]
        step += 1
        t0 = time.perf_counter()
        nl.prepare_arrays([rows[e].data_ptr() for e in experts], *args, x, out, threads)()
        times.append(time.perf_counter() - t0)
        if first is None:
            first = out.copy()
    times.sort()
    return times[len(times) // 2], times[0], first, step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per variant, shape, threads and data")
    ap.add_argument("--gib", type=float, default=1.25, help="the DRAM set's size per shape (above the last-level cache)")
    ap.add_argument("--shapes", default="olmoe,qwen1.5-moe", help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--threads", default="all", help="comma-separated thread counts ('all' = torch's default)")
    ap.add_argument("--precisions", default="i16,fp32", help="comma-separated subset of i16,fp32")
    ap.add_argument("--data", default="dram,cached", help="comma-separated subset of dram,cached")
    ap.add_argument("--variants", default=None, help="labels of VARIANTS separated by semicolons (default: all)")
    a = ap.parse_args()
    every = torch.get_num_threads()
    thread_counts = [every if t == "all" else int(t) for t in a.threads.split(",")]
    chosen = VARIANTS if a.variants is None else {v: VARIANTS[v] for v in a.variants.split(";")}
    print(f"{len(chosen)} variants, threads {thread_counts}, {a.seconds} s each; GB/s = expert bytes of the call / "
          "median step (best in brackets)", flush=True)
    for shape in a.shapes.split(","):
        hidden, inter, k = SHAPES[shape]
        layout = RowLayout.build(hidden, inter, 256)
        n = int(a.gib * (1 << 30)) // layout.row_bytes
        rows = expert_rows(layout, n)
        x = np.random.default_rng(1).standard_normal((1, hidden)).astype(np.float16)
        call_bytes = k * layout.row_bytes
        print(f"{shape}: {n} experts ({n * layout.row_bytes / 1e9:.2f} GB), top-{k}, {call_bytes / 1e6:.1f} MB per "
              "call", flush=True)
        step = 0
        for threads in thread_counts:
            torch.set_num_threads(threads)
            read0 = read_gbs(2 << 30)
            print(f"  threads {threads}: int64-sum read {read0:.1f} GB/s", flush=True)
            reference = {}
            for label, defines in chosen.items():
                for prec in a.precisions.split(","):
                    nl = cpu_native.NativeLayer(layout, prec, defines=defines)
                    for data in a.data.split(","):
                        med, best, first, step = time_variant(nl, rows, n, k, x, threads, a.seconds,
                                                              data == "cached", step)
                        key = (prec, data)
                        same = "-" if data == "dram" else (
                            "bitwise" if np.array_equal(first, reference.setdefault(key, first)) else "DIFFERS")
                        print(f"  {label:26s} {prec:4s} {data:6s}: {call_bytes / med / 1e9:6.2f} GB/s "
                              f"({call_bytes / best / 1e9:6.2f}) = {call_bytes / med / 1e9 / read0:.2f} of the read; "
                              f"step {1e3 * med:.3f} ms; output {same}", flush=True)
            print(f"  threads {threads}: int64-sum read after {read_gbs(2 << 30):.1f} GB/s", flush=True)
        del rows
    torch.set_num_threads(every)


if __name__ == "__main__":
    main()
