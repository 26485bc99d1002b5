"""Where a partial-residency decode step's time goes: the engine at several residencies under a routing
workload, timed, then one run under cProfile (host functions by own time) and a CUDA-event split of the
miss path. Builds the OLMoE-dims synthetic pack on the GPU first if it is missing.

    PYTHONPATH=. python3 tools/explore/probe_partial_decode.py --work /tmp/probe --out $OUT/probe-partial.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch


def build_pack(work: Path, preset: str) -> Path:
    from runmap.arch.config import load_preset
    from runmap.format.pack import pack_checkpoint
    from runmap.synth.checkpoint import write_synthetic

    ck, pk = work / f"ck-{preset}", work / f"pk-{preset}"
    if not (pk / "manifest.json").is_file():
        t0 = time.perf_counter()
        write_synthetic(load_preset(preset)[0], ck, seed=0, device="cuda", overwrite=True)
        pack_checkpoint(ck, pk, device="cuda", overwrite=True)
        print(f"built {pk} in {time.perf_counter() - t0:.1f} s", flush=True)
    return pk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/probe")
    ap.add_argument("--preset", default="olmoe-1b-7b-0924")
    ap.add_argument("--resident", default="64,30,48")
    ap.add_argument("--routing", default="calibrated,model")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--contracts", default="v1,v2")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from runmap.bench.metrics import h2d_bandwidth
    from runmap.engine.engine import Engine

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    pk = build_pack(work, a.preset)
    dev = torch.device("cuda")
    link = h2d_bandwidth(dev)
    print("pinned H2D", link, flush=True)
    rows, host = [], None
    prompts = [[(17 * i + 3 * b) % 1000 + 5 for i in range(32)] for b in range(a.batch)]
    combos = [(routing, r, "v1") for routing in a.routing.split(",") for r in [int(x) for x in a.resident.split(",")]]
    combos += [("calibrated", r, c) for c in a.contracts.split(",") if c != "v1"
               for r in [int(x) for x in a.resident.split(",")] if r < 64]
    for routing, r, contract in combos:
        if True:
            eng = Engine.from_pack(pk, resident=r, device=dev, max_batch=a.batch, max_seq_len=512, routing=routing,
                                   host_source=host, cache_contract=contract)
            host = host or eng.host_source
            t0 = time.perf_counter()
            eng.run(prompts, max_new_tokens=4, ignore_eos=True)
            first = time.perf_counter() - t0
            s0 = eng.stats()
            run = eng.run(prompts, max_new_tokens=a.decode, ignore_eos=True)
            s1 = eng.stats()
            d = s1.since(s0)
            toks = run.new_tokens
            row = {"routing": eng.routing, "contract": contract, "resident": r, "batch": a.batch, "decode_tok_s": run.decode_tok_s,
                   "ttft_s": run.ttft_s, "first_run_s": first, "misses_per_token": d.misses / toks,
                   "h2d_bytes_per_token": d.bytes_h2d / toks, "h2d_seconds": d.h2d_seconds}
            if r < eng.cfg.num_experts and routing == "calibrated" and "profile" not in [x.get("kind") for x in rows]:
                pr = cProfile.Profile()
                pr.enable()
                eng.run(prompts, max_new_tokens=32, ignore_eos=True)
                torch.cuda.synchronize()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
                row["profile_tottime"] = s.getvalue()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
                row["profile_cumulative"] = s.getvalue()
                print(row["profile_tottime"][-6000:], flush=True)
                print(row["profile_cumulative"][-7000:], flush=True)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not k.startswith("profile")},
                  flush=True)
            eng.close()
    if a.out:
        Path(a.out).write_text(json.dumps({"link": link, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
