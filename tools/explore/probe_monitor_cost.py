"""CPU probe (not a test): host time of the expert cache's acquisitions, miss transactions and releases per decode
step, with the copy monitor at each level and off, so that the monitor's share of a miss-heavy step is priced.

OLMoE-like counts (16 layers, 64 experts, 30 resident, top-8, batch 1) with tiny rows (bookkeeping, not copies),
a step's routes drawn with per-layer popularity and reuse from the step before (~12 misses per step):

    PYTHONPATH=. python3 tools/explore/probe_monitor_cost.py [function|dispatch|off]
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np
import torch

from runmap.format.qpack import RowLayout
from runmap.residency.cache import ExpertCache
from runmap.residency.host_source import HostSource
from runmap.residency.transport import CpuDirectTransport

LAYERS, EXPERTS, TOP_K, RESIDENT = 16, 64, 8, 30


def routes(rng, steps: int) -> list[list[np.ndarray]]:
    """(1, k) expert ids per layer per step: half of the previous step's kept, the rest drawn by popularity."""
    pop = rng.dirichlet(np.ones(EXPERTS) * 0.5, size=LAYERS)
    prev = [rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)]
    out = []
    for _ in range(steps):
        step = []
        for layer in range(LAYERS):
            keep = list(prev[layer][rng.random(TOP_K) < 0.5])
            for e in rng.choice(EXPERTS, 3 * TOP_K, replace=False, p=pop[layer]):
                if len(keep) == TOP_K:
                    break
                if e not in keep:
                    keep.append(e)
            keep += [e for e in range(EXPERTS) if e not in keep][: TOP_K - len(keep)]
            prev[layer] = np.array(keep, dtype=np.int64)
            step.append(prev[layer].reshape(1, TOP_K))
        out.append(step)
    return out


def main() -> None:
    level = sys.argv[1] if len(sys.argv) > 1 else "function"
    layout = RowLayout.build(8, 4, 4)
    rows = [torch.randint(0, 255, (EXPERTS, layout.row_bytes), dtype=torch.uint8) for _ in range(LAYERS)]
    cache = ExpertCache(HostSource.from_rows(rows, layout), resident=RESIDENT, max_group=TOP_K,
                        transport=CpuDirectTransport(), copy_monitor=False if level == "off" else level)
    steps = routes(np.random.default_rng(0), 300)

    def run(block):
        for ids in block:
            req = cache.admit()
            for layer in range(LAYERS):
                req.acquire(layer, ids[layer])
            req.release()

    run(steps[:20])
    m0, t0 = cache.counters["misses"], time.perf_counter()
    run(steps[20:200])
    dt = time.perf_counter() - t0
    print(f"monitor {level}: {dt / 180 * 1e6:.0f} us of host time per step, "
          f"{(cache.counters['misses'] - m0) / 180:.1f} misses per step", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    run(steps[200:])
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
