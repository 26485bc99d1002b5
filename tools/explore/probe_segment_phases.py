"""Where the host time of a partial-residency segment decode step goes (issue 24, item 8).

The segment decoder alternates GPU segments and host decisions; this probe wraps the functions of one step with
wall-clock accumulators (inclusive times, so nested ones overlap) and reports microseconds per token for: graph
replays, host event waits (the segment before a decision, and the miss copies inside a transaction), the lease
(admission + acquisition), the miss transaction and its parts, the copy monitor. Variants: contract v1 / v2, the
copy monitor on / off (off only here, to price it: the product never runs without it), and the mixed chain of
placement cpu or auto (``--variants``: the CPU part's start and collection, the row-table / keep-mask write, the CPU
site's call and kernel, on the job thread: inclusive times there overlap the main thread's), or placement two-site
(``calibrated:v2:monitor:two-site``: its host split per layer, ``segment._split_sites``, the event waits, the CPU part),
with a cProfile of one mixed-chain decode (``--profile``). ``--batch 8`` decodes 8 rows (per token = over every row's
tokens): past max_group / top_k the grouped chain runs, and its group decisions, group-row writes and per-layer
group runs are timed too.

    PYTHONPATH=. python3 tools/explore/probe_segment_phases.py --work /tmp/probe --out $OUT/phases.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

import torch

ACC: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[name] += time.perf_counter() - t0
            CALLS[name] += 1
    return wrapper


def instrument():
    from runmap.engine import engine as eng_mod
    from runmap.residency import cache as cache_mod
    from runmap.residency import transport as tr_mod

    torch.cuda.Event.synchronize = timed("event.synchronize", torch.cuda.Event.synchronize)
    torch.cuda.CUDAGraph.replay = timed("graph.replay", torch.cuda.CUDAGraph.replay)
    S = eng_mod.SegmentDecoder
    S._lease = timed("segment._lease", S._lease)
    S._release = timed("segment._release", S._release)
    S.run = timed("segment.run (step)", S.run)
    C = cache_mod.ExpertCache
    for name in ("admit", "_acquire", "_release", "_transaction", "_copy_rows", "_wait_all", "_group",
                 "_reclaim_retiring", "_reclaim_fenced"):
        setattr(C, name, timed(f"cache.{name}", getattr(C, name)))
    for name in ("_cpu_part", "_write_slots", "_start_cpu_part", "_run_groups", "_expert_groups", "_write_group",
                 "_split_sites"):
        setattr(S, name, timed(f"segment.{name}", getattr(S, name)))
    from runmap.kernels import cpu_int4, cpu_native  # the engine's module names (kernels/ is runmap.kernels)

    site = cpu_int4.CpuExpertSite
    for name in ("moe_subset", "moe_subset_arrays", "_native_call", "_check_layer_call"):
        setattr(site, name, timed(f"site.{name}", getattr(site, name)))
    cpu_native.NativeLayer.run = timed("native.run (kernel)", cpu_native.NativeLayer.run)
    native = cpu_native.NativeLayer
    native.run_arrays = timed("native.run_arrays (kernel, job thread)", native.run_arrays)
    X = eng_mod.CachedExperts
    for name in ("acquire", "observe_cpu", "static_experts"):
        setattr(X, name, timed(f"experts.{name}", getattr(X, name)))
    for cls in (tr_mod.CudaTransport, tr_mod.PinnedSourceTransport):
        for name in ("copy_rows", "upload_table_async", "wait", "after_publish", "note_release"):
            if name in cls.__dict__:
                setattr(cls, name, timed(f"{cls.__name__}.{name}", cls.__dict__[name]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/probe")
    ap.add_argument("--preset", default="olmoe-1b-7b-0924")
    ap.add_argument("--resident", type=int, default=30)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1,
                    help="rows decoded together (past max_group / top_k the grouped chain runs; times are per token)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="calibrated:v1:monitor,calibrated:v2:monitor,calibrated:v2:off,model:v2:monitor",
                    help="routing:contract:monitor|off[:PLACEMENT] (cpu: placement cpu, the mixed chain; two-site: "
                         "its chain, contract v2)")
    ap.add_argument("--profile", action="store_true", help="cProfile one 16-token decode of each cpu variant")
    a = ap.parse_args()
    from tools.explore.probe_partial_decode import build_pack

    from runmap.bench.metrics import h2d_bandwidth
    from runmap.engine.engine import Engine

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    pk = build_pack(work, a.preset)
    dev = torch.device("cuda")
    link = h2d_bandwidth(dev)
    print("pinned H2D", link, flush=True)
    instrument()
    prompts = [[(17 * i + 3 + 101 * b) % 1000 + 5 for i in range(32)] for b in range(a.batch)]
    rows, host = [], None
    for variant in a.variants.split(","):
        routing, contract, mon, *rest = variant.split(":")
        monitor, placement = mon == "monitor", (rest[0] if rest else "gpu")
        eng = Engine.from_pack(pk, resident=a.resident, device=dev, max_batch=a.batch, max_seq_len=512, routing=routing,
                               host_source=host, cache_contract=contract, expert_placement=placement)
        host = host or eng.host_source
        cache = eng.experts.cache
        saved_monitor = cache.copy_monitor
        if not monitor:
            cache.copy_monitor = None
        eng.run(prompts, max_new_tokens=8, ignore_eos=True)  # capture + warm
        ACC.clear(), CALLS.clear()
        s0 = eng.stats()
        run = eng.run(prompts, max_new_tokens=a.decode, ignore_eos=True)
        d = eng.stats().since(s0)
        n = run.new_tokens
        phases = {k: {"us_per_token": v / n * 1e6, "calls_per_token": CALLS[k] / n} for k, v in sorted(ACC.items())}
        if a.profile and placement != "gpu":
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            eng.run(prompts, max_new_tokens=16, ignore_eos=True)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(buf.getvalue(), flush=True)
        row = {"routing": eng.routing, "contract": contract, "copy_monitor": monitor, "placement": placement,
               "batch": a.batch,
               "decode_paths": dict(eng.decode_paths), "resident": a.resident,
               "decode_tok_s": run.decode_tok_s, "misses_per_token": d.misses / n,
               "h2d_bytes_per_token": d.bytes_h2d / n, "phases": phases}
        rows.append(row)
        print(f"\n{eng.routing} {contract} monitor={monitor} placement={placement}: {run.decode_tok_s:.1f} tok/s, "
              f"{d.misses / n:.1f} misses/token", flush=True)
        for k, v in phases.items():
            print(f"  {k:38s} {v['us_per_token']:9.1f} us/token  {v['calls_per_token']:6.1f} calls/token")
        cache.copy_monitor = saved_monitor
        eng.close()
    if a.out:
        Path(a.out).write_text(json.dumps({"link": link, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
