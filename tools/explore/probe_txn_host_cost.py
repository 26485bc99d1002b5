"""What a miss transaction costs the host, piece by piece (issue 24 item 8: the segment chain's transfer path runs at
~0.47 of its transfer bound, and each transaction took ~230 us of host time for ~1.8 rows on the H200 host).

Two parts, one process, on CUDA:

1. torch calls a transaction makes, each timed alone (median host microseconds of 200): entering and leaving a
   ``torch.cuda.stream`` context, creating and recording an event, a 3.2 MB pinned -> device copy's submission, a
   small table upload (``torch.empty`` on the device + ``record_stream`` + copy), ``wait_stream``, a completed event's
   ``synchronize``; each also inside the copy monitor's function mode (the price the instrument adds per call).
2. Whole transactions of an ``ExpertCache`` over a synthetic host source with OLMoE-sized rows (one layer of 64
   experts, 16 resident, contract v1 and v2, copy monitor on and off): admit, acquire 1 / 2 / 4 absent experts,
   release; host microseconds per transaction (median of 40) against the time its bytes need at the same run's
   pinned copy rate, and the same time cut at the transport's calls (PHASES: before the first copy's submission,
   the submission, submission to the first event wait, the waits, after the last wait).

    PYTHONPATH=. python3 tools/explore/probe_txn_host_cost.py --out $OUT/txn.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def host_us(fn, n: int = 200) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(out), 2)


def torch_calls(dev, row_bytes: int) -> dict:
    from runmap.residency.instruments import ExpertCopyMonitor

    s = torch.cuda.Stream(dev)
    src = torch.empty(row_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(row_bytes, dtype=torch.uint8, device=dev)
    table = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize(dev)
    cur = torch.cuda.current_stream(dev)

    def stream_ctx():
        with torch.cuda.stream(s):
            pass

    def event_record():
        torch.cuda.Event().record(s)

    def copy_row():
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)

    def table_upload():
        with torch.cuda.stream(s):
            out = torch.empty(64, dtype=torch.int32, device=dev)
            out.record_stream(cur)
            out.copy_(table, non_blocking=True)

    calls = {"stream context": stream_ctx, "event create + record": event_record,
             "row copy submit (3.2 MB, in a stream context)": copy_row,
             "table upload (empty + record_stream + copy, in a stream context)": table_upload,
             "wait_stream": lambda: cur.wait_stream(s), "completed event synchronize": done.synchronize}
    monitor = ExpertCopyMonitor("function")
    monitor.watch_storage(dst.view(1, -1))
    rows = {}
    for name, fn in calls.items():
        plain = host_us(fn)
        torch.cuda.synchronize(dev)
        with monitor.scope(transaction=True):
            watched = host_us(fn)
        torch.cuda.synchronize(dev)
        rows[name] = {"us": plain, "us_monitored": watched}
        print(f"  {name:64s} {plain:8.1f} us   monitored {watched:8.1f} us", flush=True)
    return rows


# a transaction's host time, cut at the transport calls: until the first row copy is submitted, the submission, from
# there to the first wait on a copy's event (the table upload and whatever the cache does meanwhile: it overlaps the
# bytes), the waits (first to last), and from the last wait to the lease in hand (publication and the lease's
# bookkeeping)
PHASES = ("before_submit", "submit", "submit_to_wait", "waits", "after_wait")


def _stamp(transport) -> dict:
    """Wrap ``transport``'s copy_rows and wait to record host times: {"copy_rows": (start, end), "wait": (first start,
    last end)} for the transaction in progress (the caller clears it before each)."""
    stamps: dict = {}
    copy_rows, wait = transport.copy_rows, transport.wait

    def timed_copy_rows(jobs, on_submit):
        t = time.perf_counter()
        copy_rows(jobs, on_submit)
        stamps["copy_rows"] = (t, time.perf_counter())

    def timed_wait(ev):
        t = time.perf_counter()
        wait(ev)
        stamps["wait"] = (stamps["wait"][0] if "wait" in stamps else t, time.perf_counter())

    transport.copy_rows, transport.wait = timed_copy_rows, timed_wait
    return stamps


def transactions(dev, preset: str) -> list[dict]:
    from runmap.arch.config import load_preset
    from runmap.bench.metrics import h2d_bandwidth
    from runmap.format.qpack import RowLayout
    from runmap.residency.cache import ExpertCache
    from runmap.residency.host_source import HostSource
    from runmap.residency.transport import default_transport

    cfg = load_preset(preset)[0]
    layout = RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, 256)
    E = cfg.num_experts
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (E, layout.row_bytes), dtype=torch.uint8, generator=g)
    host = HostSource.from_rows([rows], layout)
    link = h2d_bandwidth(dev)["value"]
    print(f"pinned H2D {link:.1f} GB/s; row {layout.row_bytes / 1e6:.2f} MB", flush=True)
    out = []
    for contract in ("v1", "v2"):
        for monitor in (True, False):
            transport = default_transport(dev, contract=contract)
            stamps = _stamp(transport)
            cache = ExpertCache(host, resident=16, max_group=8, device=dev, transport=transport, copy_monitor=monitor)
            for n in (1, 2, 4):
                times, nxt, phases = [], 16, {k: [] for k in PHASES}
                for i in range(44):
                    want = [(nxt + j) % E for j in range(n)]  # never resident: each acquisition is one transaction
                    nxt = (nxt + n) % E
                    req = cache.admit()
                    stamps.clear()
                    t0 = time.perf_counter()
                    req.acquire(0, want)
                    t1 = time.perf_counter()
                    dt = t1 - t0
                    req.release()
                    if i >= 4:
                        times.append(dt)
                        marks = [t0, stamps["copy_rows"][0], stamps["copy_rows"][1], stamps["wait"][0],
                                 stamps["wait"][1], t1]
                        for k, lo, hi in zip(PHASES, marks, marks[1:]):
                            phases[k].append(hi - lo)
                med = statistics.median(times)
                need = n * layout.row_bytes / (link * 1e9)
                row = {"contract": contract, "copy_monitor": monitor, "misses": n, "host_us": round(1e6 * med, 1),
                       "bytes_us_at_link": round(1e6 * need, 1), "overhead_us": round(1e6 * (med - need), 1),
                       "phases_us": {k: round(1e6 * statistics.median(v), 1) for k, v in phases.items()}}
                out.append(row)
                print(f"  {contract} monitor={monitor!s:5s} {n} misses: {row['host_us']:8.1f} us per transaction "
                      f"(bytes need {row['bytes_us_at_link']:.1f} us at the link; overhead {row['overhead_us']:.1f}); "
                      + ", ".join(f"{k} {v:.1f}" for k, v in row["phases_us"].items()), flush=True)
            torch.cuda.synchronize(dev)
            del cache
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="olmoe-1b-7b-0924")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    from runmap.arch.config import load_preset
    from runmap.format.qpack import RowLayout

    cfg = load_preset(a.preset)[0]
    row_bytes = RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, 256).row_bytes
    print("torch calls of a transaction (host us, median of 200):", flush=True)
    result = {"preset": a.preset, "torch_calls": torch_calls(dev, row_bytes)}
    print("whole transactions (one layer, 16 of 64 resident):", flush=True)
    result["transactions"] = transactions(dev, a.preset)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
