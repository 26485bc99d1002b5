"""Do interleaved joins compute what whole joins compute on the GPU? (issue 17, item 6)

On the CPU the tests check that every request's tokens equal its run alone whatever the schedule, interleaved
joins included. On CUDA two things are new: the joining prefill runs on a stream of its own while the running
rows' decode graphs replay on the compute stream, and the grouped executor's rows need not be bit-identical at
different batch sizes (so "equal to alone" can fail at a near-tie without any bug). This probe runs the same
requests three ways on one engine (full residency, CUDA graphs):

  alone        Engine.generate, one request at a time (batch 1)
  whole        BatchRunner, a fixed schedule of arrivals, every join prefilled whole at a step boundary
  interleaved  the same arrivals, each join begun with begin_join and advanced one piece per step boundary

and reports, for whole and interleaved, how many requests equal their alone tokens and where the others first
differ. A stream-ordering bug (a decode step reading rows a prefill has not written, a prefill writing rows a
move still reads) shows as early, wholesale divergence in the interleaved run only; near-tie rounding shows
as the same late divergences in both.

    PYTHONPATH=. python3 tools/explore/probe_interleaved_joins.py --packed PACK --out OUT.json
"""
import argparse
import json
import random

import torch

from runmap.engine.engine import Engine
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--requests", type=int, default=24)
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--max-batch", type=int, default=8)
args = ap.parse_args()

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
eng = Engine.from_pack(args.packed, device=dev, max_batch=args.max_batch, max_seq_len=1024)
rng = random.Random(0)
V = eng.cfg.vocab_size
prompts = [[rng.randrange(3, V) for _ in range(rng.randint(20, 300))] for _ in range(args.requests)]
params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)

with torch.inference_mode():
    alone = [eng.generate([p], max_new_tokens=args.max_tokens, ignore_eos=True)[0].token_ids for p in prompts]

    def run(interleave: bool):
        r = BatchRunner(eng, interleave=interleave)
        seqs = [Sequence(p, params) for p in prompts]
        waiting, arrivals = list(seqs), random.Random(1)
        steps = 0
        while waiting or r.rows or r.joining:
            if r.joining:
                r.advance_join(0.0)  # one piece per boundary: the most interleaving
                r.finish_join()
            elif waiting and (not r.rows or arrivals.random() < 0.3):
                take = waiting[: arrivals.randint(1, 3)]
                if interleave and r.can_interleave():
                    n = r.begin_join(take)
                else:  # into an empty batch (or the whole-join run): prefilled at once
                    n = r.admit_many(take)
                del waiting[:n]
            if r.rows:
                r.step()
            steps += 1
            assert steps < 100_000
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return seqs, dict(r.counters)

    rec = {"pack": args.packed, "requests": args.requests, "max_tokens": args.max_tokens,
           "max_batch": args.max_batch, "runs": {}}
    for name, inter in (("whole", False), ("interleaved", True)):
        seqs, counters = run(inter)
        first_diff = []
        for s, a in zip(seqs, alone):
            d = next((i for i, (x, y) in enumerate(zip(s.token_ids, a)) if x != y), None)
            if d is None and len(s.token_ids) != len(a):
                d = min(len(s.token_ids), len(a))
            first_diff.append(d)
        equal = sum(d is None for d in first_diff)
        rec["runs"][name] = {"equal_to_alone": equal, "first_difference": first_diff, "counters": counters}
        print(f"{name:12s} equal to alone {equal}/{len(seqs)}; first differences "
              f"{sorted(d for d in first_diff if d is not None)}; joins {counters['joins']} "
              f"(interleaved {counters['interleaved_joins']})", flush=True)

with open(args.out, "w") as f:
    json.dump(rec, f, indent=1)
