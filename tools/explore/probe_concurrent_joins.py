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
import time

import torch

# tools/explore/join_probe.py (this folder is the script's first import path)
from join_probe import ProbeRecord, add_stage_arguments, compare_tokens, ifeval_like_prompts, load_stage
from runmap.engine.engine import Engine

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_stage_arguments(ap, seconds=25.0, modes="whole,concurrent")
args = ap.parse_args()

record = ProbeRecord(args.out, probe="concurrent joins", packed=args.packed, max_batch=args.max_batch,
                     max_tokens=args.max_tokens,
                     device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
t0 = time.perf_counter()
eng = Engine.from_pack(args.packed, device=dev, max_batch=args.max_batch, max_seq_len=1024)
eng.prepare_join_passes(concurrent=True)
record.data["load_s"] = time.perf_counter() - t0
prompts = ifeval_like_prompts(eng.cfg.vocab_size, max(args.requests, 64))
with torch.inference_mode():
    record.stage("tokens", compare_tokens(eng, prompts[: args.requests],
                                          {"whole": {"concurrent": False}, "concurrent": {"concurrent": True}}))
record.stage("load", {})
for mode in args.modes.split(","):
    record.data["stages"]["load"][mode] = load_stage(eng, prompts, clients=args.clients, seconds=args.seconds,
                                                     max_tokens=args.max_tokens, concurrent_joins=mode == "concurrent",
                                                     interleave_joins=mode == "interleaved")
    record.save()
print("end", flush=True)
