"""How much host time a two-site step's read notes cost per step: 16 layers noted one call at a time
(``Request.note_host_reads`` with each layer's CPU-site experts, as the one-graph step did between its joins) against
one call for the whole step (``ExpertCache.note_host_read_step(cpu=...)``, what it does after its last join).

OLMoE's counts (16 layers, 64 experts, top-8, batch 1, 15 resident), tiny rows (the notes never touch them), the
eviction policy lfu-decay, half of each layer's absent experts on the CPU site. Both sides see the same routes;
the median over 350 steps after 50 is printed. Host time only: run it on the machine whose host is measured.

    PYTHONPATH=. python3 tools/explore/probe_note_cost.py
"""
from __future__ import annotations

import time

import numpy as np
import torch

from runmap.format.qpack import RowLayout
from runmap.residency.cache import ExpertCache
from runmap.residency.host_source import HostSource

LAYERS, EXPERTS, TOP_K, RESIDENT, STEPS, SKIP = 16, 64, 8, 15, 400, 50


def _cache(rows, layout) -> ExpertCache:
    return ExpertCache(HostSource.from_rows(rows, layout), resident=RESIDENT, max_group=TOP_K, policy="lfu-decay",
                       prefill=True)


def main() -> None:
    layout = RowLayout.build(64, 64, 64)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (EXPERTS, layout.row_bytes), dtype=torch.uint8, generator=gen)
            for _ in range(LAYERS)]
    rng = np.random.default_rng(0)
    steps = [np.stack([rng.choice(EXPERTS, TOP_K, replace=False)[None, :] for _ in range(LAYERS)])  # (L, 1, k)
             for _ in range(STEPS)]
    for form in ("a call per layer", "one call per step"):
        cache, seconds = _cache(rows, layout), []
        for ids in steps:
            req = cache.admit()
            cpu = []
            for layer in range(LAYERS):
                absent = [e for e in ids[layer, 0].tolist() if e not in req.mapping(layer)]
                cpu.append(tuple(absent[:len(absent) // 2]))
            t0 = time.perf_counter()
            if form == "a call per layer":
                for layer in range(LAYERS):
                    req.note_host_reads(layer, ids[layer], cpu=cpu[layer])
            else:
                cache.note_host_read_step(req, ids, cpu=cpu)
            seconds.append(time.perf_counter() - t0)
            req.release()
        print(f"{form}: median {1e6 * np.median(seconds[SKIP:]):.0f} us per step "
              f"({STEPS - SKIP} steps, {LAYERS} layers, top-{TOP_K} of {EXPERTS}, {RESIDENT} resident)")


if __name__ == "__main__":
    main()
