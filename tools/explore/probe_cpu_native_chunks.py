"""The cpu-native kernel's work split against its batch-1 rate (issue 25, item 1: >= 0.6 of the host read).

At batch 1 on the H200 host the kernel streams 44-54 GB/s of OLMoE expert bytes with 16 threads where an int64 sum
reads 80-96 GB/s (results/cpu-experts/README.md), while one thread reaches 0.5-0.7 of a thread's read. This builds
the kernel with other work splits (kernels/cpu_native.c: ROW_CHUNK output rows per work item of the gate/up loop,
DOWN_CHUNK of the down loop, ROW_SCHEDULE the loops' OpenMP schedule; none changes a result) and times each on
batch-1 layer calls of top-k experts (8 for OLMoE, 4 for Qwen1.5-MoE) taken in turn from random qpacked rows larger than the last-level cache (best of
the steps in --seconds), in one process, beside an int64-sum read measured before and after. The outputs of every
variant are checked bitwise against the default build's.

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_chunks.py [--shape olmoe|qwen1.5-moe] [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import time

import torch

from runmap.format.qpack import RowLayout
from runmap.kernels import cpu_native

DYNAMIC = "-DROW_SCHEDULE=dynamic,1"
VARIANTS = {  # the first is the reference of the bitwise check (the default before d9655e8: 16 rows, dynamic)
    "16 rows, dynamic": ("-DROW_CHUNK=16", DYNAMIC),
    "32 rows": ("-DROW_CHUNK=32", DYNAMIC),
    "64 rows": ("-DROW_CHUNK=64", DYNAMIC),
    "64 / down 128 rows": ("-DROW_CHUNK=64", "-DDOWN_CHUNK=128", DYNAMIC),
    "16 rows, static": ("-DROW_CHUNK=16", "-DROW_SCHEDULE=static"),
    "64 rows, guided (default)": (),
    "32 rows, guided": ("-DROW_CHUNK=32", "-DROW_SCHEDULE=guided"),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--gib", type=float, default=1.25)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    ap.add_argument("--variants", default=None, help="labels of VARIANTS separated by semicolons (default: all)")
    a = ap.parse_args()
    hidden, inter, k = SHAPES[a.shape]
    layout = RowLayout.build(hidden, inter, 256)
    n = int(a.gib * (1 << 30)) // layout.row_bytes
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for sec in ("gate.scale", "up.scale", "down.scale"):  # finite scales: random bytes could be inf / NaN halves
        s = layout.section(sec)
        rows[:, s.offset:s.offset + s.nbytes] = torch.full((s.nbytes // 2,), 0.01, dtype=torch.float16).view(torch.uint8)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    read0 = read_gbs(2 << 30)
    print(f"{a.shape}: {n} experts ({n * layout.row_bytes / 1e9:.2f} GB), top-{k}, {threads} threads, int64-sum read "
          f"{read0:.1f} GB/s", flush=True)
    chosen = VARIANTS if a.variants is None else {v: VARIANTS[v] for v in a.variants.split(";")}
    base_flags = cpu_native.COMPILE_FLAGS
    reference = {}
    step = 0
    try:
        for label, extra in chosen.items():
            cpu_native.COMPILE_FLAGS = base_flags + extra
            cpu_native._function.cache_clear()
            for prec in ("fp32", "i16"):
                nl = cpu_native.NativeLayer(layout, prec)
                args = (list(range(k + 1)), [0] * k, [1.0 / k] * k, x, threads)
                check = nl.run([rows[e].data_ptr() for e in range(k)], *args)
                if prec not in reference:
                    reference[prec] = check.clone()
                same = torch.equal(check, reference[prec])
                best, t_end = float("inf"), time.perf_counter() + a.seconds
                while time.perf_counter() < t_end:
                    experts = [(step * k + j) % n for j in range(k)]
                    step += 1
                    t0 = time.perf_counter()
                    nl.run([rows[e].data_ptr() for e in experts], *args)
                    best = min(best, time.perf_counter() - t0)
                gbs = k * layout.row_bytes / best / 1e9
                print(f"{label:28s} {prec:4s}: {gbs:6.2f} GB/s ({gbs / read0:.2f} of the read; best step "
                      f"{1e3 * best:.3f} ms; output {'bitwise the first' if same else 'DIFFERS'})", flush=True)
    finally:
        cpu_native.COMPILE_FLAGS = base_flags
        cpu_native._function.cache_clear()
    print(f"int64-sum read after: {read_gbs(2 << 30):.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
