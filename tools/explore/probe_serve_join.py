"""Where a served request's join costs go (issue 17, item 6): the load run spends ~30 ms of engine-thread time
per joining request while a decode step at batch 8 takes ~2 ms, so joins, not steps, bound served throughput.

On one engine (full residency) this times, with the device synchronized around each call (median of REPEATS):
  * a prefill at batch 1 for several prompt lengths, and padded prefills at batch k (k prompts at once);
  * the same batch-1 prefill with the executor's host check off (validate=False) and with the copy monitor off,
    to see what each host round trip costs;
  * decode steps (CUDA graphs) at batch 1 / 8 / 32 at two KV-length buckets;
  * BatchRunner.admit into a running batch of 8 (the prefill into a free row + the move to the shared slot);
  * a torch-profiler summary of one batch-1 prefill: kernels launched, host syncs, GPU busy time vs wall.

    PYTHONPATH=. python3 tools/explore/probe_serve_join.py --packed PACK --out OUT.json
"""
import argparse
import json
import statistics
import time

import torch

from runmap.engine.engine import Engine
from runmap.engine.model import run_pieces
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--max-batch", type=int, default=32)
args = ap.parse_args()

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
eng = Engine.from_pack(args.packed, device=dev, max_batch=args.max_batch, max_seq_len=1024)
V = eng.cfg.vocab_size
gen = torch.Generator().manual_seed(0)
rec = {"pack": args.packed, "rows": []}


def timed(fn, repeats=args.repeats):
    fn()  # warm (compilation, capture)
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def prompt(n):
    return torch.randint(0, V, (n,), generator=gen).tolist()


def prefill_fn(lens):
    P = max(lens)
    toks = torch.zeros(len(lens), P, dtype=torch.long)
    for b, n in enumerate(lens):
        toks[b, P - n:] = torch.tensor(prompt(n))
    toks = toks.to(dev)
    pad = torch.tensor([P - n for n in lens], device=dev)

    def run():
        eng.experts.begin()
        try:  # a server's join runs the eager pass (short Engine.prefill calls replay captured graphs)
            run_pieces(eng.prefill_pieces(toks, pad))
        finally:
            eng.experts.end()
    return run


def row(name, ms, **kw):
    r = {"name": name, "ms": round(ms, 3), **kw}
    rec["rows"].append(r)
    print(f"{name:48s} {ms:9.3f} ms  {kw if kw else ''}", flush=True)


with torch.inference_mode():
    for n in (44, 126, 362):
        row(f"prefill b1 len {n}", timed(prefill_fn([n])), tokens=n)
    for k in (2, 4, 8, 16):
        lens = [int(x) for x in torch.randint(44, 250, (k,), generator=gen)]
        row(f"prefill b{k} padded (max {max(lens)})", timed(prefill_fn(lens)), tokens=sum(lens), padded_to=max(lens))
    eng.experts.validate = False
    row("prefill b1 len 126, validate off", timed(prefill_fn([126])))
    eng.experts.validate = True
    mon = eng.experts.cache.copy_monitor
    eng.experts.cache.copy_monitor = None
    row("prefill b1 len 126, copy monitor off", timed(prefill_fn([126])))
    eng.experts.validate = False
    row("prefill b1 len 126, both off", timed(prefill_fn([126])))
    eng.experts.validate = True
    eng.experts.cache.copy_monitor = mon

    for B in (1, 8, 32):
        for slot in (300, 900):
            tok = torch.zeros(B, dtype=torch.long, device=dev)
            pad = torch.zeros(B, dtype=torch.long, device=dev)

            def step():
                eng.experts.begin()
                try:
                    eng.decode(tok, slot, pad)
                finally:
                    eng.experts.end()
            row(f"decode b{B} slot {slot}", timed(step, 20))

    # a join into a running batch of 8 (what the scheduler does per request)
    r = BatchRunner(eng)
    for _ in range(8):
        r.admit(Sequence(prompt(126), SamplingParams(max_new_tokens=512, ignore_eos=True)))
    for _ in range(4):
        r.step()
    ts = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        r.admit(Sequence(prompt(126), SamplingParams(max_new_tokens=64, ignore_eos=True)))
        sync()
        ts.append(time.perf_counter() - t0)
        r.step()
    row("BatchRunner.admit len 126 into running batch", statistics.median(ts) * 1e3, rows=r.rows)
    r.abort_all()
    # the same, eight requests joining together (one joint prefill, padded to the longest)
    for _ in range(8):
        r.admit(Sequence(prompt(126), SamplingParams(max_new_tokens=512, ignore_eos=True)))
    r.step()
    ts = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        n = r.admit_many([Sequence(prompt(int(x)), SamplingParams(max_new_tokens=16, ignore_eos=True))
                          for x in torch.randint(44, 250, (8,), generator=gen)])
        sync()
        ts.append(time.perf_counter() - t0)
        for _ in range(17):
            r.step()
    row("BatchRunner.admit_many 8 x len 44-250 into running batch", statistics.median(ts) * 1e3, joined=n)
    r.abort_all()

    # what the copy monitor's function mode sees during one batch-1 prefill (calls by function)
    from runmap.residency import instruments
    seen = {}
    orig = instruments._FunctionMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__qualname__", None) or str(func)
        seen[name] = seen.get(name, 0) + 1
        return orig(self, func, types, args, kwargs)
    instruments._FunctionMode.__torch_function__ = counting
    prefill_fn([126])()
    sync()
    instruments._FunctionMode.__torch_function__ = orig
    top_calls = sorted(seen.items(), key=lambda kv: -kv[1])
    rec["monitor_calls_prefill_b1_126"] = {"total": sum(seen.values()), "by_function": dict(top_calls)}
    print(f"copy monitor, one prefill: {sum(seen.values())} torch calls; top: {top_calls[:25]}")

    # profiler: one batch-1 prefill of 126 tokens
    run = prefill_fn([126])
    run()
    sync()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
        t0 = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - t0
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kern) / 1e3
    syncs = [e for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")]
    names = {}
    for e in syncs:
        names[e.name] = names.get(e.name, 0) + 1
    top = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    print(top)
    rec["profile_prefill_b1_126"] = {"wall_ms": wall * 1e3, "kernels": len(kern), "gpu_busy_ms": busy,
                                     "sync_like_calls": names, "table": top}
    print(f"profile: wall {wall * 1e3:.2f} ms, {len(kern)} kernels, GPU busy {busy:.2f} ms, {names}")

with open(args.out, "w") as f:
    json.dump(rec, f, indent=1)
