"""What does a prefill of a shape never seen before cost on the host? (issue 17, item 6)

A served join prefills k prompts padded to the longest, P: with 64 distinct prompts the server meets a new
(k, P) at most joins. The load runs show joins costing ~35-50 ms of engine-thread time where a warm prefill of
the same size takes 13-25 ms, and time-to-first-token p99 of 0.8-0.9 s at 8 clients with no Triton compile.
Suspect: PyTorch's scaled_dot_product_attention picks cuDNN attention, which builds an execution plan per new
shape. This times, with the device synchronized around each call, a prefill at a fresh shape (cold) and again
(warm), for the default SDPA backends and with cuDNN attention excluded, and names the attention kernels
that ran.

    PYTHONPATH=. python3 tools/explore/probe_prefill_shapes.py --packed PACK --out OUT.json
"""
import argparse
import json
import random
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from runmap.engine.engine import Engine

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--packed", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--groups", type=int, default=10)
args = ap.parse_args()

dev = torch.device("cuda")
eng = Engine.from_pack(args.packed, device=dev, max_batch=8, max_seq_len=1024)
V = eng.cfg.vocab_size
rng = random.Random(0)
used = set()


def fresh_group():
    while True:
        k = rng.randint(1, 6)
        lens = [rng.randint(40, 362) for _ in range(k)]
        if (k, max(lens)) not in used:
            used.add((k, max(lens)))
            return lens


def prefill(lens):
    P = max(lens)
    toks = torch.randint(3, V, (len(lens), P), device=dev)
    pads = [P - n for n in lens]
    pad = torch.tensor(pads, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.prefill(toks, pad, kv=eng.kv.rows(0, len(lens)), pad_host=pads)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


MODES = {"default": None,
         "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}
rec = {"pack": args.packed, "modes": {}}
eng.model.sdpa_backends = None  # the probe picks the backends itself (the engine's default leaves cuDNN out)
with torch.inference_mode():
    eng.experts.begin()
    prefill([50, 60])  # first use of everything else (cuBLAS handles, Triton kernels of these buckets)
    prefill([300])
    for mode, backends in MODES.items():
        rows = []
        for _ in range(args.groups):
            lens = fresh_group()
            if backends is None:
                cold, warm = prefill(lens), prefill(lens)
            else:
                with sdpa_kernel(backends):
                    cold, warm = prefill(lens), prefill(lens)
            rows.append({"lens": lens, "cold_ms": round(cold, 2), "warm_ms": round(warm, 2)})
        cold = statistics.median(r["cold_ms"] for r in rows)
        warm = statistics.median(r["warm_ms"] for r in rows)
        rec["modes"][mode] = {"rows": rows, "cold_median_ms": cold, "warm_median_ms": warm}
        print(f"{mode:9s} cold median {cold:8.2f} ms  warm median {warm:7.2f} ms  "
              f"cold {[r['cold_ms'] for r in rows]}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    for mode, backends in MODES.items():
        lens = fresh_group()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if backends is None:
                prefill(lens)
            else:
                with sdpa_kernel(backends):
                    prefill(lens)
        names = sorted({e.name for e in prof.events() if "attention" in e.name.lower() or "fmha" in e.name.lower()
                        or "cudnn" in e.name.lower()})
        rec["modes"][mode]["attention_ops"] = names
        print(f"{mode:9s} attention ops: {names[:8]}", flush=True)
    eng.experts.end()

with open(args.out, "w") as f:
    json.dump(rec, f, indent=1)
