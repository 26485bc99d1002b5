"""What one served join costs, device time against host time (issue 17, item 6).

With the engine in a process of its own (runmap serve --engine-process) a served decode step at 32 rows took
less time than the offline one, yet joins still took ~0.23 of the engine thread at 32 clients (~39 ms per join of
~9 requests) and ~36 ms per join of ~4 at 8 clients: a join cost hardly depends on its size. This probe builds
the load benchmark's situation on one engine (full residency, the first 64 IFEval prompts through the chat
template) and, with the device synchronized around each call, times (median of REPEATS):

  * BatchRunner.admit_many of k = 1, 4, 9 requests into a running batch of 32 - k rows (as ``runmap serve``'s
    whole joins run them: an eager prefill into the free rows, then the move to the shared slot);
  * the same prompts' prefill alone through Engine.prefill into rows 0..k-1: the eager pass, and the captured
    pass (runmap.engine.prefill_graph) where k x bucket fits it;
  * a torch-profiler summary of one admit_many of 9: kernels, device busy time against wall time.

    PYTHONPATH=. python3 tools/explore/probe_join_cost.py --packed PACK [--repeats 5]
"""
import argparse
import json
import statistics
import time

import torch

from runmap.engine.engine import Engine
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence, left_pad

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--prompts", default="data/ifeval/input_data.jsonl")
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--max-batch", type=int, default=32)
args = ap.parse_args()

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
eng = Engine.from_pack(args.packed, device=dev, max_batch=args.max_batch, max_seq_len=1024)
texts = [json.loads(line)["prompt"] for line in open(args.prompts)][:64]
ids = [eng.tokenizer.encode_chat(t) for t in texts]
print(f"prompts: {len(ids)}, tokens {min(map(len, ids))}-{max(map(len, ids))}, mean {statistics.mean(map(len, ids)):.0f}")
cursor = [0]


def take(k):
    out = []
    for _ in range(k):
        out.append(ids[cursor[0] % len(ids)])
        cursor[0] += 1
    return out


def seq(p, n=128):
    return Sequence(p, SamplingParams(max_new_tokens=n, ignore_eos=True))


def median_ms(ts):
    return round(statistics.median(ts) * 1e3, 2)


r = BatchRunner(eng)
for k in (1, 4, 9):
    r.abort_all()
    r.admit_many([seq(p, 512) for p in take(args.max_batch - k)])
    for _ in range(3):
        r.step()
    ts, padded = [], []
    for i in range(args.repeats + 1):
        group = take(k)
        sync()
        t0 = time.perf_counter()
        n = r.admit_many([seq(p, 16) for p in group])
        sync()
        if i:  # the first one warms (compilation)
            ts.append(time.perf_counter() - t0)
            padded.append(n * max(map(len, group)))
        for _ in range(16):  # the joined rows leave
            r.step()
    print(f"admit_many {k} into {args.max_batch - k} running rows: {median_ms(ts)} ms "
          f"(padded tokens median {statistics.median(padded):.0f})", flush=True)
r.abort_all()

for k in (1, 4, 9):
    group = take(k)
    tokens, pad = left_pad(group, eng.pad_id)
    tok_d, pad_d = tokens.to(dev), pad.to(dev)
    for name, kw in (("eager into rows 0..k-1", {"kv": eng.kv.rows(0, k)}), ("graph if it fits", {})):
        ts = []
        for i in range(args.repeats + 1):
            sync()
            t0 = time.perf_counter()
            eng.experts.begin()
            eng.prefill(tok_d, pad_d, pad_host=pad.tolist(), **kw)
            eng.experts.end()
            sync()
            if i:
                ts.append(time.perf_counter() - t0)
        print(f"prefill {k} x {tokens.shape[1]} {name}: {median_ms(ts)} ms (paths {dict(eng.prefill_paths)})",
              flush=True)

if dev.type == "cuda":
    from torch.profiler import ProfilerActivity, profile

    r.admit_many([seq(p, 512) for p in take(args.max_batch - 9)])
    r.step()
    group = take(9)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        r.admit_many([seq(p, 16) for p in group])
        sync()
        wall = time.perf_counter() - t0
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kern) / 1e3
    by = {}
    for e in kern:
        by[e.name[:60]] = by.get(e.name[:60], 0.0) + e.device_time / 1e3
    print(f"profile admit_many 9 (padded to {max(map(len, group))}): wall {wall * 1e3:.2f} ms, {len(kern)} kernels, "
          f"device busy {busy:.2f} ms")
    for name, ms in sorted(by.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {ms:8.2f} ms  {name}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
