"""How much host time a two-site step's bookkeeping costs per step, one layer at a time (what the one-graph step did
between its joins) against the whole step at once (what it does after its last join):

- the read notes: 16 calls of ``Request.note_host_reads`` with each layer's CPU-site experts against one
  ``ExpertCache.note_host_read_step(cpu=...)`` (the CPU-site experts as per-layer tuples, and as one bool mask);
- the split's check: per layer the host's rule (``TwoSitePlacement.split`` of the layer's absent experts) compared
  with the device's count and keep mask, as ``SegmentDecoder._check_split``, against every layer at once
  (``TwoSitePlacement.split_mask``), as ``SegmentDecoder._check_splits``.

OLMoE's counts (16 layers, 64 experts, top-8, batch 1, 15 resident), tiny rows (the notes never touch them), the
eviction policy lfu-decay, half of each layer's absent experts on the CPU site. Both sides see the same routes;
the median over 350 steps after 50 is printed. Host time only: run it on the machine whose host is measured.

    PYTHONPATH=. python3 tools/explore/probe_note_cost.py
"""
from __future__ import annotations

import time

import numpy as np
import torch

from runmap.engine.placement import TwoSitePlacement
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
    for form in ("a call per layer", "one call per step", "one call per step, one mask"):
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
            elif form == "one call per step":
                cache.note_host_read_step(req, ids, cpu=cpu)
            else:
                mask = np.zeros((LAYERS, EXPERTS), dtype=bool)
                for layer, experts in enumerate(cpu):
                    mask[layer, list(experts)] = True
                t0 = time.perf_counter()  # (the step has the mask already: the check made it)
                cache.note_host_read_step(req, ids, cpu=mask)
            seconds.append(time.perf_counter() - t0)
            req.release()
        print(f"notes, {form}: median {1e6 * np.median(seconds[SKIP:]):.0f} us per step "
              f"({STEPS - SKIP} steps, {LAYERS} layers, top-{TOP_K} of {EXPERTS}, {RESIDENT} resident)")
    _checks(_cache(rows, layout), steps)


def _checks(cache: ExpertCache, steps) -> None:
    """The split's check, per layer against the whole step, on the device's count and keep mask as the rule makes
    them (a correct device: every check passes)."""
    plan = TwoSitePlacement(None, None, share=0.5)
    q = plan.share_q()
    for form in ("a check per layer", "one check per step"):
        seconds = []
        for ids in steps:
            req = cache.admit()
            flat = ids.reshape(LAYERS, -1)
            resident = req.resident_mask()
            pairs = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
            for layer in range(LAYERS):
                np.add.at(pairs[layer], flat[layer], 1)
            rule = TwoSitePlacement.split_mask(pairs, (pairs > 0) & ~resident, q)
            count, keep = rule.sum(1), (~np.take_along_axis(rule, flat, axis=1)).astype(np.int32)  # the device's
            t0 = time.perf_counter()
            if form == "a check per layer":
                for layer in range(LAYERS):
                    mapping = req.mapping(layer)
                    experts, n = np.unique(ids[layer], return_counts=True)
                    absent = [(e, c) for e, c in zip(experts.tolist(), n.tolist()) if e not in mapping]
                    cpu = plan.split(absent, q) if absent else ()
                    assert int(count[layer]) == len(cpu)
                    assert set(flat[layer][keep[layer] == 0].tolist()) == set(cpu)
            else:
                p = np.bincount((flat + EXPERTS * np.arange(LAYERS)[:, None]).ravel(),
                                minlength=LAYERS * EXPERTS).reshape(LAYERS, EXPERTS)
                got = TwoSitePlacement.split_mask(p, (p > 0) & ~req.resident_mask(), q)
                assert (got.sum(1) == count).all()
                assert ((keep == 0) == np.take_along_axis(got, flat, axis=1)).all()
            seconds.append(time.perf_counter() - t0)
            req.release()
        print(f"split check, {form}: median {1e6 * np.median(seconds[SKIP:]):.0f} us per step "
              f"({STEPS - SKIP} steps, {LAYERS} layers, top-{TOP_K} of {EXPERTS}, {RESIDENT} resident, share 1/2)")


if __name__ == "__main__":
    main()
