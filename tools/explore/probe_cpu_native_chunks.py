"""The cpu-native kernel's work split against its batch-1 rate (issue 25, item 1: >= 0.6 of the host read).

At batch 1 on the H200 host the kernel streams 44-54 GB/s of OLMoE expert bytes with 16 threads where an int64 sum
reads 80-96 GB/s (results/cpu-experts/README.md), while one thread reaches 0.5-0.7 of a thread's read. This builds
the kernel with other work splits (kernels/cpu_native.c: ROW_CHUNK output rows per work item of the gate/up loop,
DOWN_CHUNK of the down loop, ROW_SCHEDULE the loops' OpenMP schedule; none changes a result) and times each on
batch-1 layer calls of 8 experts taken in turn from random qpacked rows larger than the last-level cache (best of
the steps in --seconds), in one process, beside an int64-sum read measured before and after. The outputs of every
variant are checked bitwise against the default build's.

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_chunks.py [--seconds 1.5] [--gib 1.25]
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
}


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
    a = ap.parse_args()
    layout = RowLayout.build(2048, 1024, 256)  # OLMoE's expert
    n = int(a.gib * (1 << 30)) // layout.row_bytes
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for sec in ("gate.scale", "up.scale", "down.scale"):  # finite scales: random bytes could be inf / NaN halves
        s = layout.section(sec)
        rows[:, s.offset:s.offset + s.nbytes] = torch.full((s.nbytes // 2,), 0.01, dtype=torch.float16).view(torch.uint8)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    read0 = read_gbs(2 << 30)
    print(f"{n} experts ({n * layout.row_bytes / 1e9:.2f} GB), {threads} threads, int64-sum read {read0:.1f} GB/s",
          flush=True)
    base_flags = cpu_native.COMPILE_FLAGS
    reference = {}
    step = 0
    try:
        for label, extra in VARIANTS.items():
            cpu_native.COMPILE_FLAGS = base_flags + extra
            cpu_native._function.cache_clear()
            for prec in ("fp32", "i16"):
                nl = cpu_native.NativeLayer(layout, prec)
                check = nl.run([rows[e].data_ptr() for e in range(8)], list(range(9)), [0] * 8, [0.125] * 8, x, threads)
                if prec not in reference:
                    reference[prec] = check.clone()
                same = torch.equal(check, reference[prec])
                best, t_end = float("inf"), time.perf_counter() + a.seconds
                while time.perf_counter() < t_end:
                    experts = [(step * 8 + j) % n for j in range(8)]
                    step += 1
                    t0 = time.perf_counter()
                    nl.run([rows[e].data_ptr() for e in experts], list(range(9)), [0] * 8, [0.125] * 8, x,
                                    threads)
                    best = min(best, time.perf_counter() - t0)
                gbs = 8 * layout.row_bytes / best / 1e9
                print(f"{label:28s} {prec:4s}: {gbs:6.2f} GB/s ({gbs / read0:.2f} of the read; best step "
                      f"{1e3 * best:.3f} ms; output {'bitwise the first' if same else 'DIFFERS'})", flush=True)
    finally:
        cpu_native.COMPILE_FLAGS = base_flags
        cpu_native._function.cache_clear()
    print(f"int64-sum read after: {read_gbs(2 << 30):.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
