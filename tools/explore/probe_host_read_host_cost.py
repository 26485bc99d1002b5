"""What a host-read decode step costs the host around its graph replay (issue 24 item 8: placement host-read).

A host-read step (runmap.engine.engine.HostReadDecoder.run) is one CUDA graph; the host's part is what surrounds the
replay: admit a request, point the (L, E) row tables at its generation, note the step's routed ids (hits, host reads,
the eviction policy's uses), release (``serial``: the device waits for these, so they add to every token), and the
promotions from the step before (ExpertCache.promote_step through CachedExperts.promote_pending: per layer at most
one miss transaction), which run while the step's graph does (``beside``; before they ran between steps, serial
too). This times both on the CPU with the engine's own objects (ExpertCache over a synthetic host source,
CachedExperts.enable_host_read / point_host_read_tables / defer_promotion / promote_pending, HostReadPlacement's
lfu-decay half-life) and the calibrated routing workload of the family, batch 1 and batch 8 (independent streams),
in the decoder's order, without the replay.

A promotion's copy here is a host memcpy of a small row (``--row-bytes``, default 4,096), so the figure is the
bookkeeping; a promoted row of the family's real size takes its bytes / 55.07 GB/s more over the H200's link (an
OLMoE row, 3,194,880 bytes: 58 us; results/residency/host-read-h200.log), which the printout adds per promotion where
the promotions are serial, as an estimate.

    PYTHONPATH=. python3 tools/explore/probe_host_read_host_cost.py [--family olmoe --resident 30] [--steps 600]

Prints per-phase host microseconds per step (median and mean over the steps after ``--warmup``), the serial and the
beside-the-step sums, and promotions, host reads and hits per step.

    PYTHONPATH=. python3 tools/explore/probe_host_read_host_cost.py --family olmoe --resident 60 --margins 1,4,16,inf

``--margins`` instead sweeps the promotion margin (uses of lfu-decay; inf = no promotion) in the engine's order
(beside) and prints, per batch and margin, what the margin decides: promotions and host reads per decoded token,
the hit rate, and the rows that cross the link per token (host reads + promotions: each promotion copies one row).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from runmap.engine.engine import CachedExperts
from runmap.engine.placement import HostReadPlacement
from runmap.format.qpack import RowLayout
from runmap.residency.cache import ExpertCache
from runmap.residency.host_source import HostSource
from runmap.workload.calibration import StreamSampler, family_params, popularity

LAYERS = {"olmoe": 16, "qwen2_moe": 24, "mixtral": 32, "qwen3_moe": 48}
# each family's real expert (hidden, intermediate): the promoted row's size over the link
DIMS = {"olmoe": (2048, 1024), "qwen2_moe": (2048, 1408), "mixtral": (4096, 14336), "qwen3_moe": (2048, 768)}
LINK_GB_S = 55.07  # the H200's pinned host -> device rate (results/residency/host-read-h200.log)


def build(family: str, resident: int, row_bytes_hint: int, spares: int):
    fam = family_params(family)
    L, E = LAYERS[family], fam.num_experts
    layout = RowLayout.build(64, 32)  # the smallest even layout; rows are padded to row_bytes_hint below
    nbytes = max(layout.row_bytes, row_bytes_hint)
    layout = RowLayout.build(64, 32 * max(1, nbytes // layout.row_bytes))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (E, layout.row_bytes), dtype=torch.uint8, generator=gen) for _ in range(L)]
    host = HostSource.from_rows(rows, layout)
    policy = HostReadPlacement.eviction_policy(L)  # as Engine.from_pack builds it
    cache = ExpertCache(host, resident=resident, spares=spares, max_group=max(fam.top_k, 1), device="cpu",
                        policy=policy, copy_monitor=True)
    experts = CachedExperts(cache, "grouped", layout, fam.top_k)
    experts.placement = HostReadPlacement()
    experts.enable_host_read()
    return fam, L, E, cache, experts


def run(family: str, resident: int, batch: int, steps: int, warmup: int, row_bytes: int, spares: int, seed: int,
        order: str, margin: float | None = None):
    fam, L, E, cache, ex = build(family, resident, row_bytes, spares)
    if margin is not None:
        ex.placement.margin = margin
    rng = np.random.default_rng(seed)
    pop = np.stack([popularity(fam.params, E, rng) for _ in range(L)])  # (L, E), one model for every stream
    streams = [StreamSampler(fam.params, pop, fam.top_k, np.random.default_rng(seed + 1 + b)) for b in range(batch)]
    names = ("admit", "point_tables", "promote", "note", "release")
    phases = {k: [] for k in names + ("serial", "beside")}
    promoted, reads, hits = [], [], []
    pending = None
    for step in range(steps):
        ids = np.stack([s.next() for s in streams], axis=1)  # (L, B, k), as the step's pinned ids
        h0, r0 = cache.counters["hits"], cache.counters["host_reads"]
        t = [time.perf_counter()]
        req = cache.admit()
        t.append(time.perf_counter())
        ex.point_host_read_tables(req)
        t.append(time.perf_counter())
        done = 0
        if order == "beside" and pending is not None:  # CachedExperts.promote_pending's call (the replay is queued)
            done = sum(map(len, ex._timed(cache.promote_step, pending, ex.placement.margin)))
        t.append(time.perf_counter())
        cache.note_host_read_step(req, ids)
        t.append(time.perf_counter())
        req.release()
        t_release = time.perf_counter()
        pending = ids
        if order == "between":  # after the step, before the next one
            done = sum(map(len, ex._timed(cache.promote_step, ids, ex.placement.margin)))
        t.append(time.perf_counter())
        if step < warmup:
            continue
        us = {name: 1e6 * (b - a) for name, a, b in zip(names, t, t[1:])}
        if order == "between":  # the promotion was timed inside "release"'s interval: split it out, serial
            us["promote"] = 1e6 * (t[5] - t_release)
            us["release"] -= us["promote"]
        us["beside"] = us["promote"] if order == "beside" else 0.0
        us["serial"] = sum(us[n] for n in names) - us["beside"]
        for name, v in us.items():
            phases[name].append(v)
        promoted.append(done)
        reads.append(cache.counters["host_reads"] - r0)
        hits.append(cache.counters["hits"] - h0)
    return phases, promoted, reads, hits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="olmoe", choices=sorted(LAYERS))
    ap.add_argument("--resident", type=int, default=30, help="experts per layer resident (default 30)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--steps", type=int, default=600, help="decode steps per batch size (default 600)")
    ap.add_argument("--warmup", type=int, default=100, help="steps left out of the statistics (default 100)")
    ap.add_argument("--row-bytes", type=int, default=4096, help="host row size of the synthetic source (default 4096)")
    ap.add_argument("--spares", type=int, default=None, help="spare rows per layer (default: the cache's, top-k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--orders", default="between,beside",
                    help="where the promotions run: between (after a step, before the next: serial) and/or beside (while "
                         "the next step runs, as HostReadDecoder does now); default both")
    ap.add_argument("--margins", default=None,
                    help="comma-separated promotion margins to sweep (e.g. 1,4,16,inf); prints counts, not times")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.margins:
        sweep_margins(args)
        return
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread; python "
          f"{platform.python_version()}; torch {torch.__version__}; {args.family} {args.resident} resident, "
          f"{args.steps} steps ({args.warmup} warm-up), row {args.row_bytes} B")
    print("order    batch  phase         median_us  mean_us")
    for order in args.orders.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            phases, promoted, reads, hits = run(args.family, args.resident, b, args.steps, args.warmup, args.row_bytes,
                                                args.spares, args.seed, order)
            for name, xs in phases.items():
                print(f"{order:7s}  {b:5d}  {name:12s}  {statistics.median(xs):9.1f}  {statistics.fmean(xs):7.1f}")
            p, r, h = (statistics.fmean(x) for x in (promoted, reads, hits))
            row_us = RowLayout.build(*DIMS[args.family]).row_bytes / (LINK_GB_S * 1e3)
            link = p * row_us  # the promoted rows' copy time, serial or beside as the promotions are
            serial = statistics.fmean(phases["serial"]) + (link if order == "between" else 0.0)
            print(f"{order:7s}  {b:5d}  per step: promotions {p:.2f}, host reads {r:.1f}, hits {h:.1f} (hit rate "
                  f"{h / (h + r):.3f}); the device waits {serial:.0f} us of it (with {row_us:.0f} us per promoted "
                  f"{args.family} row at {LINK_GB_S} GB/s where serial: an estimate)")


def sweep_margins(args) -> None:
    """--margins: per batch and margin, what the promotions decide (counts over the steps after the warm-up)."""
    print(f"# {args.family} {args.resident} resident, {args.steps} steps ({args.warmup} warm-up), seed {args.seed}, "
          f"order beside")
    print("batch  margin  promotions/token  host reads/token  hit rate  link rows/token")
    for b in (int(x) for x in args.batches.split(",")):
        for margin in (float(x) for x in args.margins.split(",")):
            _phases, promoted, reads, hits = run(args.family, args.resident, b, args.steps, args.warmup,
                                                 args.row_bytes, args.spares, args.seed, "beside", margin)
            p, r, h = (statistics.fmean(x) for x in (promoted, reads, hits))
            print(f"{b:5d}  {margin:6g}  {p / b:16.3f}  {r / b:16.2f}  {h / (h + r):8.3f}  {(p + r) / b:15.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
