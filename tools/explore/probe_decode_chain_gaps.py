"""GPU probe (not a test): the decode step's kernel timeline, to see what programmatic dependent launch (PDL) changes.

    RUNMAP_PDL=0|1 PYTHONPATH=. python3 tools/explore/probe_decode_chain_gaps.py --packed DIR --out $OUT/gaps-pdl1.json

Builds the engine from the pack (full residency, grouped executor, CUDA graphs), times greedy decode of 128 tokens
after a 128-token prompt (three runs: decode tok/s), then records the CUDA kernels of one more 24-token run with the
torch profiler and reads the last 16 decode steps' kernels from its trace: per step the span from the first kernel's
start to the last one's end, the sum of kernel durations (with PDL a kernel's duration includes the time its programs
wait at ``griddepcontrol.wait``), and the gaps between consecutive kernels (negative: the next kernel started before
this one ended). Run once with RUNMAP_PDL=0 and once with 1 (the setting is read at each launch, so each run is its
own process); the JSON has the per-kernel mean durations too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from runmap.atomic import write_json
from runmap.engine.engine import Engine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--markers-per-step", type=int, default=32,
                    help="launches of the one-row GEMV per decode step (OLMoE: q|k|v and o in 16 layers = 32)")
    args = ap.parse_args(argv)
    eng = Engine.from_pack(args.packed, executor="grouped", max_batch=args.batch, max_seq_len=512)
    prompt = list(range(100, 228))  # 128 token ids
    prompts = [prompt] * args.batch
    rates = []
    for _ in range(3):
        run = eng.run(prompts, max_new_tokens=128, ignore_eos=True)
        t = run.timing_dict()
        rates.append(round(t["decode_tok_s"], 1))
    print(f"RUNMAP_PDL={os.environ.get('RUNMAP_PDL', '1')} batch {args.batch}: decode {rates}", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.run(prompts, max_new_tokens=24, ignore_eos=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # a window of one decode step: from one first-layer q|k|v GEMV to the next (the one-row GEMV runs only in decode
    # steps, --markers-per-step times each)
    names = [k["name"] for k in kernels]
    per_step = len(names)
    marker = next((n for n in names if "_gemv_kernel" in n), None)
    starts = [i for i, n in enumerate(names) if n == marker]
    step_starts = starts[::args.markers_per_step] if marker else []
    windows = list(zip(step_starts[-17:-1], step_starts[-16:]))  # the last 16 whole steps (fewer in a short trace)
    steps, by_name = [], defaultdict(list)
    for a, b in windows:
        ks = kernels[a:b]
        gaps = [ks[i + 1]["ts"] - (ks[i]["ts"] + ks[i]["dur"]) for i in range(len(ks) - 1)]
        steps.append({"kernels": len(ks), "span_us": ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"],
                      "sum_dur_us": sum(k["dur"] for k in ks), "gap_sum_us": sum(gaps),
                      "overlaps": sum(g < 0 for g in gaps), "gap_median_us": statistics.median(gaps) if gaps else 0})
        for k in ks:
            by_name[k["name"][:60]].append(k["dur"])
    n_steps = max(len(windows), 1)
    per_kernel = sorted(((n, sum(v) / n_steps, len(v) / n_steps) for n, v in by_name.items()), key=lambda r: -r[1])
    if steps:
        med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        print(f"per step (median of {len(steps)}): {med}")
    for n, us, cnt in per_kernel[:14]:
        print(f"  {us:8.1f} us/step  {cnt:5.1f} launches  {n}")
    write_json(args.out, {"kind": "decode-chain-gaps-probe", "pdl": os.environ.get("RUNMAP_PDL", "1"),
                          "batch": args.batch, "decode_tok_s": rates, "steps": steps, "kernels_in_trace": per_step,
                          "per_kernel_us_per_step": [{"name": n, "us": us, "launches": c} for n, us, c in per_kernel],
                          "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


if __name__ == "__main__":
    main()
