"""Timing on the GPU with CUDA events (benchmarks only; never in tests)."""
from __future__ import annotations

from typing import Callable

import torch


def event_times_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``, one pair of CUDA events around each call,
    after ``warmup`` untimed calls (compilation, allocator and cache warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out
