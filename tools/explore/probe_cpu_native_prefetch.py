"""The cpu-native kernel's software prefetch distance (kernels/cpu_native.c, argument ``prefetch``) against its
rate in GB/s of expert bytes, per precision (fp32, i16) and thread count: batch-1 layer calls of 8 experts (OLMoE
shape) taken in turn from a set of random qpacked rows larger than 1 GiB and than twice the last-level cache, so
every step reads DRAM. Best of the steps in ``--seconds`` per configuration; prints one line each.

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_prefetch.py --prefetch 0,1024,2048,4096 --threads all,1
"""
from __future__ import annotations

import argparse
import time

import torch

from runmap.format.qpack import RowLayout
from runmap.kernels.cpu_native import NativeLayer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefetch", default="0,1024,2048,4096")
    ap.add_argument("--threads", default="all,1")
    ap.add_argument("--seconds", type=float, default=0.6)
    ap.add_argument("--gib", type=float, default=1.25)
    a = ap.parse_args()
    layout = RowLayout.build(2048, 1024, 256)  # OLMoE's expert
    n = int(a.gib * (1 << 30)) // layout.row_bytes
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8)
    for sec in ("gate.scale", "up.scale", "down.scale"):  # finite scales: random bytes could be inf / NaN halves
        s = layout.section(sec)
        rows[:, s.offset:s.offset + s.nbytes] = torch.full((s.nbytes // 2,), 0.01, dtype=torch.float16).view(torch.uint8)
    x = torch.randn(1, 2048)
    every = torch.get_num_threads()
    threads = [every if t == "all" else int(t) for t in a.threads.split(",")]
    print(f"{n} experts ({n * layout.row_bytes / 1e9:.2f} GB), torch threads {every}", flush=True)
    step = 0
    for th in threads:
        for prec in ("fp32", "i16"):
            for pf in [int(v) for v in a.prefetch.split(",")]:
                nl = NativeLayer(layout, prec)
                nl.prefetch_bytes = pf
                best, t_end = float("inf"), time.perf_counter() + a.seconds
                while time.perf_counter() < t_end:
                    experts = [(step * 8 + j) % n for j in range(8)]
                    step += 1
                    t0 = time.perf_counter()
                    nl.run([rows[e].data_ptr() for e in experts], list(range(9)), [0] * 8, [0.125] * 8, x, th)
                    best = min(best, time.perf_counter() - t0)
                print(f"threads {th:2d} {prec:4s} prefetch {pf:5d}: {8 * layout.row_bytes / best / 1e9:6.2f} GB/s "
                      f"(best step {1e3 * best:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
