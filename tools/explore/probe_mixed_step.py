"""Mixed steps on the GPU (runmap serve --join-mode mixed; issue 17, item 6): what does a decode step that also
computes a joining prompt cost against a decode step plus that prompt's own captured join pass, do requests keep
their tokens, and what does the scheduler serve per second with mixed joins against whole ones?

Three stages on one engine (full residency, CUDA graphs), each written to --out as soon as it ends:

  timing   device time (CUDA events, median of --repeats) at KV slots 400 and 800 of: a decode step of B rows, the
           captured one-row join pass of a P-token prompt into the cache's last row, and the mixed step of both, for
           B in --rows and P in --prompts. saved_ms = decode + join - mixed: the device time a mixed join saves.
  tokens   the same requests through BatchRunner three ways: alone (Engine.generate), whole joins and mixed joins on
           one fixed schedule of arrivals. Reports how many requests equal their alone tokens and where the others
           first differ (near-tie rounding shows as late divergences; a wrong slot, pad or row as early ones).
  load     runmap.serve.scheduler.Scheduler itself (no HTTP) under --clients threads that each submit a greedy
           request of --max-tokens tokens as soon as their last one finished, for --seconds per join mode.

    PYTHONPATH=. python3 tools/explore/probe_mixed_step.py --packed PACK --out OUT.json

A CPU rehearsal of the script itself (tokens and load stages; the timing stage needs CUDA):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/explore/probe_mixed_step.py --packed TINY_PACK --out /tmp/p.json \
        --device cpu --executor reference --stages tokens,load --requests 4 --max-batch 4 --clients 4 --seconds 3 \
        --max-tokens 8
"""
import argparse
import json
import os
import random
import statistics
import threading
import time

import torch

from runmap.engine.engine import Engine
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence
from runmap.serve.scheduler import Scheduler, Ticket

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--rows", default="8,16,31", help="timing: running rows")
ap.add_argument("--prompts", default="64,128,256,362", help="timing: prompt lengths")
ap.add_argument("--repeats", type=int, default=20)
ap.add_argument("--requests", type=int, default=24, help="requests of the tokens stage")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--max-batch", type=int, default=32)
ap.add_argument("--clients", type=int, default=32)
ap.add_argument("--seconds", type=float, default=20.0, help="load stage: seconds per join mode")
ap.add_argument("--modes", default="whole,mixed", help="load stage: join modes, in this order")
ap.add_argument("--stages", default="timing,tokens,load")
ap.add_argument("--device", default="cuda")
ap.add_argument("--executor", default="grouped")
args = ap.parse_args()
stages = set(args.stages.split(","))

record = {"probe": "mixed steps", "packed": args.packed, "max_batch": args.max_batch, "max_tokens": args.max_tokens,
          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "stages": {}}


def save():
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, args.out)


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


dev = torch.device(args.device)
t0 = time.perf_counter()
eng = Engine.from_pack(args.packed, device=dev, executor=args.executor, max_batch=args.max_batch, max_seq_len=1024)
record["load_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
with torch.inference_mode():
    eng.experts.begin()
    record["join_passes"] = eng.prepare_join_passes()
    record["mixed_steps_captured"] = eng.prepare_mixed_steps()
    eng.experts.end()
record["prepare_s"] = time.perf_counter() - t0
print(f"load {record['load_s']:.1f} s, prepare {record['prepare_s']:.1f} s: {record['join_passes']} join passes, "
      f"{record['mixed_steps_captured']} mixed steps", flush=True)
rng = random.Random(0)
V = eng.cfg.vocab_size
# prompt lengths of the served IFEval set under the chat template (44-362 tokens, mean ~126)
prompts = [[rng.randrange(3, V) for _ in range(min(362, max(44, int(rng.lognormvariate(4.7, 0.45)))))]
           for _ in range(max(args.requests, 64))]


def device_ms(fn):
    ts = []
    for _ in range(args.repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[2:])


# ---- timing ----------------------------------------------------------------------------------------------------
if "timing" in stages and dev.type == "cuda":
    rows_out = []
    with torch.inference_mode():
        eng.experts.begin()
        try:
            for slot in (400, 800):
                for B in [int(x) for x in args.rows.split(",")]:
                    tok = torch.randint(3, V, (B,), device=dev)
                    pad = torch.full((B,), slot - 200, dtype=torch.long, device=dev)
                    dec = device_ms(lambda: eng.decode(tok, slot, pad))
                    for P in [int(x) for x in args.prompts.split(",")]:
                        prompt = torch.randint(3, V, (P,), device=dev)
                        zero = torch.zeros(1, dtype=torch.long, device=dev)
                        join = device_ms(lambda: eng.prefill(prompt[None], zero, pad_host=[0],
                                                             kv_row0=args.max_batch - 1, padded_pass=False))
                        key = eng.mixed_step_key(B, P, slot)
                        mixed = device_ms(lambda: eng.mixed_step(tok, slot, pad, prompt, key))
                        row = {"slot": slot, "rows": B, "prompt": P, "key": list(key), "decode_ms": dec,
                               "join_pass_ms": join, "mixed_ms": mixed, "saved_ms": dec + join - mixed}
                        rows_out.append(row)
                        print(f"slot {slot} B {B:2d} P {P:3d}: decode {dec:.3f} join {join:.3f} mixed {mixed:.3f} "
                              f"saved {dec + join - mixed:.3f} ms", flush=True)
        finally:
            eng.experts.end()
    record["stages"]["timing"] = rows_out
    save()

# ---- tokens ----------------------------------------------------------------------------------------------------
if "tokens" in stages:
    with torch.inference_mode():
        reqs = prompts[: args.requests]
        alone = [eng.generate([p], max_new_tokens=48, ignore_eos=True)[0].token_ids for p in reqs]

        def run(mixed: bool):
            r = BatchRunner(eng, mixed=mixed)
            seqs = [Sequence(p, SamplingParams(max_new_tokens=48, ignore_eos=True)) for p in reqs]
            waiting, arrivals, steps = list(seqs), random.Random(1), 0
            while waiting or r.rows or r.joining:
                if r.joining:
                    r.advance_join(None)
                    r.finish_join()
                elif waiting and (not r.rows or arrivals.random() < 0.3):
                    n = r.begin_join(waiting[: arrivals.randint(1, 3)], interleave=False)
                    del waiting[:n]
                    if n and not r.rows:
                        r.advance_join(None)
                        r.finish_join()
                r.step()
                steps += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            diffs = [first_diff(s.token_ids, a) for s, a in zip(seqs, alone)]
            return {"equal_to_alone": sum(d is None for d in diffs), "requests": len(seqs),
                    "first_differences": sorted(d for d in diffs if d is not None), "steps": steps,
                    "counters": dict(r.counters)}

        record["stages"]["tokens"] = {"whole": run(False), "mixed": run(True)}
        save()
        print("tokens:", {k: (v["equal_to_alone"], v["first_differences"][:6], v["counters"]["mixed_joins"],
                              v["counters"]["joins"]) for k, v in record["stages"]["tokens"].items()}, flush=True)

# ---- load ------------------------------------------------------------------------------------------------------
if "load" in stages:
    record["stages"]["load"] = {}
    for mode in args.modes.split(","):
        sched = Scheduler(eng, decode=eng.tokenizer.decode, mixed_joins=mode == "mixed",
                          concurrent_joins=mode == "concurrent", interleave_joins=mode == "interleaved")
        sched.start()
        while not sched.ready:
            if sched.failed:
                raise SystemExit(f"scheduler failed: {sched.failed}")
            time.sleep(0.05)
        stop_at = time.perf_counter() + args.seconds
        errors = []

        def client(cid):
            k = cid
            while time.perf_counter() < stop_at:
                ev = threading.Event()

                def sink(e, ev=ev):
                    if e[0] in ("done", "error"):
                        if e[0] == "error":
                            errors.append(str(e[1]))
                        ev.set()
                sched.submit(Ticket(prompts[k % len(prompts)], SamplingParams(max_new_tokens=args.max_tokens,
                                                                              ignore_eos=True), sink))
                k += args.clients
                if not ev.wait(120):
                    errors.append("no answer in 120 s")
                    return
        c0, t_start = dict(sched.runner.counters), time.perf_counter()
        gen0 = sched.totals["generated_tokens"]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_start
        c1 = dict(sched.runner.counters)
        gen = sched.totals["generated_tokens"] - gen0
        sched.stop()
        out = {"tok_s": gen / wall, "wall_s": wall, "errors": errors[:5],
               "counters": {k: c1[k] - c0.get(k, 0) for k in c1}}
        record["stages"]["load"][mode] = out
        save()
        print(f"load {mode}: {out['tok_s']:.0f} tok/s, joins {out['counters']['joins']}, "
              f"mixed {out['counters']['mixed_joins']}, steps {out['counters']['steps']}, errors {len(errors)}",
              flush=True)
