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

--mixed-buckets and --rows-step set the step's shape knobs (runmap.engine.mixed_step.MIXED_BUCKETS, MIXED_ROWS_STEP)
for the run, e.g. finer prompt buckets against the padding the default ones compute.

A CPU rehearsal of the script itself (tokens and load stages; the timing stage needs CUDA):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/explore/probe_mixed_step.py --packed TINY_PACK --out /tmp/p.json \
        --device cpu --executor reference --stages tokens,load --requests 4 --max-batch 4 --clients 4 --seconds 3 \
        --max-tokens 8
"""
import argparse
import statistics
import time

import torch

# tools/explore/join_probe.py (this folder is the script's first import path)
from join_probe import ProbeRecord, add_stage_arguments, compare_tokens, ifeval_like_prompts, load_stage
from runmap.bench.cuda_timing import event_times_ms
from runmap.engine import mixed_step
from runmap.engine.engine import Engine

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", default="8,16,31", help="timing: running rows")
ap.add_argument("--prompts", default="64,128,256,362", help="timing: prompt lengths")
ap.add_argument("--repeats", type=int, default=20)
add_stage_arguments(ap, seconds=20.0, modes="whole,mixed")
ap.add_argument("--stages", default="timing,tokens,load")
ap.add_argument("--device", default="cuda")
ap.add_argument("--mixed-buckets", default=None, metavar="B,B,...",
                help="the joining prompt's length buckets (runmap.engine.mixed_step.MIXED_BUCKETS) for this run")
ap.add_argument("--rows-step", type=int, default=None,
                help="decode rows of a mixed step rounded up to a multiple of this (MIXED_ROWS_STEP) for this run")
ap.add_argument("--executor", default="grouped")
args = ap.parse_args()
stages = set(args.stages.split(","))
if args.mixed_buckets:  # knobs of the step's shapes, read at each call: set before anything is captured
    mixed_step.MIXED_BUCKETS = tuple(sorted(int(b) for b in args.mixed_buckets.split(",")))
if args.rows_step:
    mixed_step.MIXED_ROWS_STEP = args.rows_step

record = ProbeRecord(args.out, probe="mixed steps", packed=args.packed, max_batch=args.max_batch,
                     max_tokens=args.max_tokens, mixed_buckets=list(mixed_step.MIXED_BUCKETS),
                     rows_step=mixed_step.MIXED_ROWS_STEP,
                     device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
dev = torch.device(args.device)
t0 = time.perf_counter()
eng = Engine.from_pack(args.packed, device=dev, executor=args.executor, max_batch=args.max_batch, max_seq_len=1024)
load_s, t0 = time.perf_counter() - t0, time.perf_counter()
with torch.inference_mode():
    eng.experts.begin()
    passes, mixed_steps = eng.prepare_join_passes(), eng.prepare_mixed_steps()
    eng.experts.end()
record.data.update(load_s=load_s, prepare_s=time.perf_counter() - t0, join_passes=passes,
                   mixed_steps_captured=mixed_steps)
print(f"load {load_s:.1f} s, prepare {record.data['prepare_s']:.1f} s: {passes} join passes, {mixed_steps} mixed "
      "steps", flush=True)
V = eng.cfg.vocab_size
prompts = ifeval_like_prompts(V, max(args.requests, 64))


def device_ms(fn):
    return statistics.median(event_times_ms(fn, args.repeats, warmup=2))


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
    record.stage("timing", rows_out)

# ---- tokens ----------------------------------------------------------------------------------------------------
if "tokens" in stages:
    with torch.inference_mode():
        record.stage("tokens", compare_tokens(eng, prompts[: args.requests],
                                              {"whole": {"mixed": False}, "mixed": {"mixed": True}}))

# ---- load ------------------------------------------------------------------------------------------------------
if "load" in stages:
    record.stage("load", {})
    for mode in args.modes.split(","):
        record.data["stages"]["load"][mode] = load_stage(
            eng, prompts, clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens,
            mixed_joins=mode == "mixed", concurrent_joins=mode == "concurrent", interleave_joins=mode == "interleaved")
        record.save()
print("end", flush=True)
