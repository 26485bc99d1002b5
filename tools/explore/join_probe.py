"""The stages the join-mode probes share (probe_concurrent_joins.py, probe_mixed_step.py): prompts shaped like the
served IFEval set, the tokens stage (the same requests through BatchRunner on one fixed schedule of arrivals, against
their run alone) and the load stage (the scheduler itself, no HTTP, under closed-loop client threads)."""
import json
import os
import random
import threading
import time

import torch

from runmap.serve.batching import BatchRunner, SamplingParams, Sequence
from runmap.serve.scheduler import Scheduler, Ticket


class ProbeRecord:
    """The probe's JSON record, rewritten atomically after each stage (a device fault ends the process; the stages
    before it stay recorded)."""

    def __init__(self, path: str, **fields):
        self.path, self.data = path, {**fields, "stages": {}}

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def stage(self, name: str, value) -> None:
        self.data["stages"][name] = value
        self.save()


def add_stage_arguments(ap, *, seconds: float, modes: str) -> None:
    """The arguments of the stages here, which both join-mode probes take: the pack, the record, the tokens stage's
    requests and the load stage's clients, window and join modes (defaults ``seconds`` and ``modes``)."""
    ap.add_argument("--packed", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=24, help="requests of the tokens stage")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=seconds, help="load stage: seconds per join mode")
    ap.add_argument("--modes", default=modes, help="load stage: join modes, in this order")


def ifeval_like_prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts with the lengths of the served IFEval set under the chat template (44-362 tokens, mean
    ~126)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(min(362, max(44, int(rng.lognormvariate(4.7, 0.45)))))]
            for _ in range(n)]


def first_diff(a, b):
    """The first index where two token lists differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare_tokens(eng, reqs, variants: dict, *, max_new_tokens: int = 48) -> dict:
    """``reqs`` alone (Engine.generate), then through ``tokens_stage`` once per variant (name -> BatchRunner
    keyword arguments); returns {name: tokens_stage's result}, printing a line per variant with its counters."""
    alone = [eng.generate([p], max_new_tokens=max_new_tokens, ignore_eos=True)[0].token_ids for p in reqs]
    out = {name: tokens_stage(eng, reqs, alone, max_new_tokens=max_new_tokens, **kw) for name, kw in variants.items()}
    for name, v in out.items():
        c = v["counters"]
        print(f"tokens {name}: {v['equal_to_alone']} of {v['requests']} equal alone, first differences "
              f"{v['first_differences'][:6]}, joins {c['joins']} (concurrent {c['concurrent_joins']}, mixed "
              f"{c['mixed_joins']}, not done {c['join_not_done']})", flush=True)
    return out


def tokens_stage(eng, reqs, alone, *, max_new_tokens: int = 48, **runner_kwargs) -> dict:
    """``reqs`` (prompt ids) through ``BatchRunner(eng, **runner_kwargs)``: 1-3 arrivals join at a step boundary with
    probability 0.3 (seeded, so every mode sees the same arrivals); how many equal ``alone`` (their token ids) and
    where the others first differ."""
    r = BatchRunner(eng, **runner_kwargs)
    seqs = [Sequence(p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)) for p in reqs]
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
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    diffs = [first_diff(s.token_ids, a) for s, a in zip(seqs, alone)]
    return {"equal_to_alone": sum(d is None for d in diffs), "requests": len(seqs),
            "first_differences": sorted(d for d in diffs if d is not None), "steps": steps, "counters": dict(r.counters)}


def load_stage(eng, prompts, *, clients: int, seconds: float, max_tokens: int, **scheduler_kwargs) -> dict:
    """``Scheduler(eng, **scheduler_kwargs)`` under ``clients`` threads, each submitting a greedy request of
    ``max_tokens`` tokens (``prompts`` in turn) as soon as its last one finished, for ``seconds``: tokens per second,
    the runner's counters over the window, errors."""
    sched = Scheduler(eng, decode=eng.tokenizer.decode, **scheduler_kwargs)
    sched.start()
    while not sched.ready:
        if sched.failed:
            raise SystemExit(f"scheduler failed: {sched.failed}")
        time.sleep(0.05)
    stop_at = time.perf_counter() + seconds
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
            sched.submit(Ticket(prompts[k % len(prompts)], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True),
                                sink))
            k += clients
            if not ev.wait(120):
                errors.append("no answer in 120 s")
                return
    c0, t_start = dict(sched.runner.counters), time.perf_counter()
    gen0 = sched.totals["generated_tokens"]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    c1 = dict(sched.runner.counters)
    point = {"clients": clients, "seconds": wall, "tok_s": (sched.totals["generated_tokens"] - gen0) / wall,
             "errors": errors[:5], "n_errors": len(errors), "failed": sched.failed,
             "counters": {k: c1[k] - c0.get(k, 0) for k in c1}, "time_in": dict(sched.time_in)}
    sched.stop()
    c = point["counters"]
    print(f"load {scheduler_kwargs}: {point['tok_s']:.0f} tok/s, joins {c['joins']} (concurrent "
          f"{c['concurrent_joins']}, mixed {c['mixed_joins']}, not done {c['join_not_done']}), steps {c['steps']}, "
          f"errors {point['n_errors']}, failed {point['failed']}", flush=True)
    return point
