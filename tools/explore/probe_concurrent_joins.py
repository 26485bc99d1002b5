"""Concurrent joins on the GPU (runmap serve --join-mode concurrent; issue 17, item 6): do they compute what whole
joins compute, do they survive a server's load, and what do they serve per second against whole joins?

Two stages on one engine (full residency, CUDA graphs), each written to --out as soon as it ends (a device fault
ends the process; the stages before it stay recorded):

  tokens   the same requests through BatchRunner three ways: alone (Engine.generate), whole joins and concurrent
           joins on one fixed schedule of arrivals (rows join when their pass is done, read by event query, so
           the concurrent run's steps and joins differ from the whole run's). Reports how many requests equal
           their alone tokens and where the others first differ: a stream-ordering bug shows as early, wholesale
           divergence in the concurrent run only; near-tie rounding as late divergences in both.
  load     runmap.serve.scheduler.Scheduler itself (no HTTP) under --clients threads that each submit a greedy
           request of --max-tokens tokens as soon as their last one finished, for --seconds per join mode: tokens
           per second, joins, concurrent joins and the checks that found a pass not yet done (one at the boundary
           where each join began, the others at later ones). The join passes are captured once, for concurrent
           joins (their own pool); a whole join replays the same passes in line.

    PYTHONPATH=. python3 tools/explore/probe_concurrent_joins.py --packed PACK --out OUT.json
"""
import argparse
import json
import os
import random
import threading
import time

import torch

from runmap.engine.engine import Engine
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence
from runmap.serve.scheduler import Scheduler, Ticket

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--requests", type=int, default=24, help="requests of the tokens stage")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--max-batch", type=int, default=32)
ap.add_argument("--clients", type=int, default=32)
ap.add_argument("--seconds", type=float, default=25.0, help="load stage: seconds per join mode")
ap.add_argument("--modes", default="whole,concurrent", help="load stage: join modes, in this order")
args = ap.parse_args()

record = {"probe": "concurrent joins", "packed": args.packed, "max_batch": args.max_batch,
          "max_tokens": args.max_tokens, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
          "stages": {}}


def save():
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, args.out)


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
t0 = time.perf_counter()
eng = Engine.from_pack(args.packed, device=dev, max_batch=args.max_batch, max_seq_len=1024)
eng.prepare_join_passes(concurrent=True)
record["load_s"] = time.perf_counter() - t0
rng = random.Random(0)
V = eng.cfg.vocab_size
# prompt lengths of the served IFEval set under the chat template (44-362 tokens, mean ~126)
prompts = [[rng.randrange(3, V) for _ in range(min(362, max(44, int(rng.lognormvariate(4.7, 0.45)))))]
           for _ in range(max(args.requests, 64))]

# ---- tokens ----------------------------------------------------------------------------------------------------
with torch.inference_mode():
    reqs = prompts[: args.requests]
    alone = [eng.generate([p], max_new_tokens=48, ignore_eos=True)[0].token_ids for p in reqs]

    def run(concurrent: bool):
        r = BatchRunner(eng, concurrent=concurrent)
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

    record["stages"]["tokens"] = {"whole": run(False), "concurrent": run(True)}
    save()
    print("tokens:", {k: (v["equal_to_alone"], v["first_differences"][:6], v["counters"]["concurrent_joins"],
                          v["counters"]["join_not_done"]) for k, v in record["stages"]["tokens"].items()}, flush=True)

# ---- load ------------------------------------------------------------------------------------------------------
record["stages"]["load"] = {}
for mode in args.modes.split(","):
    sched = Scheduler(eng, decode=eng.tokenizer.decode, concurrent_joins=mode == "concurrent",
                      interleave_joins=mode == "interleaved")
    sched.start()
    while not sched.ready:
        if sched.failed:
            raise SystemExit(f"scheduler failed: {sched.failed}")
        time.sleep(0.05)
    stop_at = time.perf_counter() + args.seconds
    done_tokens, errors = [0], []

    def client(cid):
        k = cid
        while time.perf_counter() < stop_at:
            ev = threading.Event()

            def sink(e, ev=ev):
                if e[0] == "token":
                    done_tokens[0] += 1
                elif e[0] in ("done", "error"):
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
    point = {"clients": args.clients, "seconds": wall, "tok_s": (sched.totals["generated_tokens"] - gen0) / wall,
             "errors": errors[:5], "n_errors": len(errors), "failed": sched.failed,
             "counters": {k: c1[k] - c0.get(k, 0) for k in c1}, "time_in": dict(sched.time_in)}
    sched.stop()
    record["stages"]["load"][mode] = point
    save()
    print(f"load {mode}: {point['tok_s']:.0f} tok/s, joins {point['counters']['joins']}, concurrent "
          f"{point['counters']['concurrent_joins']}, not done {point['counters']['join_not_done']}, steps "
          f"{point['counters']['steps']}, errors {len(errors)}, failed {sched.failed}", flush=True)
print("end", flush=True)
