"""`--gpu-budget SIZE` against the memory the engine really reserves (issue 24, item 6).

For each pack and budget: plan (runmap/engine/budget.py, printed), build the engine under the budget, run the
largest forward passes the plan provides for (a prefill of PROMPT tokens in prefill-chunk pieces, then DECODE
steps under the routing workload, so misses fill the spare rows and staging), and read torch's peak reserved and
allocated bytes and the device's used bytes (cudaMemGetInfo, which also counts the CUDA context, outside any
budget a process can cap). A budget the plan refuses is recorded with its error line. One JSON record, written
atomically; schema schemas/gpu-budget.schema.json.

    PYTHONPATH=. python3 benchmarks/gpu_budget.py --pack olmoe=/tmp/pk-olmoe --budgets olmoe=3,4,6,12 \\
        --pack qwen=/tmp/pk-qwen --budgets qwen=6,8,10,16 --out $OUT/gpu-budget-h200.json
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"gpu_budget: {what} {v!r} must be NAME=VALUE")
        out[name] = rest
    return out


def _weights(packs: dict[str, str]) -> str:
    """Each pack's weights as a bench record names them (runmap.synth.direct_pack.weights_label)."""
    from runmap.synth.direct_pack import weights_label

    return "; ".join(f"{name}: {weights_label(pack)}" for name, pack in packs.items()) + ", at the presets' dimensions"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", action="append", required=True, metavar="NAME=DIR", help="a pack to plan for")
    ap.add_argument("--budgets", action="append", required=True, metavar="NAME=G1,G2",
                    help="budgets in GiB for the pack NAME")
    ap.add_argument("--batches", default="1,8", help="max_batch values (a plan that refuses one is recorded)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row (prefill in chunks)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps after the prefill")
    ap.add_argument("--routing", default="calibrated", help="routing workload of the decode (runmap --routing)")
    ap.add_argument("--contract", default="v1", choices=("v1", "v2"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    packs, budgets = _pairs(a.pack, "--pack"), _pairs(a.budgets, "--budgets")
    try:  # every value checked before a GPU is touched: one line, exit 2
        gib = {n: [float(x) for x in budgets[n].split(",") if x] for n in budgets}
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError as e:
        raise SystemExit(f"gpu_budget: --budgets / --batches: {e} (GiB numbers and batch sizes, comma-separated)")
    if set(gib) != set(packs) or not all(gib.values()) or any(g <= 0 for v in gib.values() for g in v) or \
            not batches or min(batches) < 1:
        raise SystemExit(f"gpu_budget: give positive budgets for exactly the packs named by --pack ({sorted(packs)}; "
                         f"budgets for {sorted(gib)}) and batch sizes >= 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_budget: needs a CUDA device (the budget caps torch's CUDA allocator)")

    from runmap.atomic import write_json
    from runmap.engine.budget import BudgetError, plan_for_pack
    from runmap.engine.engine import Engine, EngineError
    from runmap.provenance import device_name, library_versions, utc_timestamp

    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    rows = []
    rec = {"schema": "runmap-gpu-budget-v1", "created_utc": utc_timestamp(), "device": device_name(dev),
           "device_total_bytes": total, "libraries": library_versions("torch", "triton"),
           "command": "PYTHONPATH=. python3 benchmarks/gpu_budget.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "workload": {"prompt_tokens": a.prompt, "decode_steps": a.decode, "routing": a.routing,
                        "weights": _weights(packs)},
           "complete": False, "rows": rows}

    def publish():  # after every row, atomically: a run cut by its time limit keeps the rows it measured
        write_json(Path(a.out), rec)

    def measure(eng, row, p, free0, t0):  # one engine under its budget: a prefill, then decode steps
        load_s = time.perf_counter() - t0
        V = eng.cfg.vocab_size
        prompt_len = min(a.prompt, eng.max_seq_len - a.decode - 1)
        prompts = [[(31 * i + 7 * b) % (V - 10) + 5 for i in range(prompt_len)] for b in range(row['max_batch'])]
        s0 = eng.stats()
        run = eng.run(prompts, max_new_tokens=a.decode, ignore_eos=True)
        d = eng.stats().since(s0)
        torch.cuda.synchronize(dev)
        free1, _ = torch.cuda.mem_get_info(dev)
        peak_reserved = torch.cuda.max_memory_reserved(dev)
        row.update(refused=False, plan=p.to_dict(), max_seq_len=eng.max_seq_len, prompt_tokens=prompt_len,
                   decode_steps=a.decode, routing=eng.routing, cache_contract=a.contract,
                   resident_per_layer=eng.experts.cache.resident,
                   peak_reserved_bytes=peak_reserved, peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                   device_used_delta_bytes=free0 - free1, within_budget=peak_reserved <= row['budget_bytes'], oom=False,
                   plan_accuracy=peak_reserved / p.total,
                   load_s=load_s, decode_tok_s=run.decode_tok_s, hit_rate=d.hits / max(d.hits + d.misses, 1),
                   misses_per_token=d.misses / max(run.new_tokens, 1))
        print(f"{row['model']} {row['budget_gib']:g} GiB batch {row['max_batch']}: {p.resident}/{p.num_experts} "
              f"resident, peak reserved "
              f"{peak_reserved / 2**30:.2f} GiB ({'within' if row['within_budget'] else 'OVER'} budget), "
              f"device used +{(free0 - free1) / 2**30:.2f} GiB, decode {run.decode_tok_s:.1f} tok/s, "
              f"hit rate {row['hit_rate']:.3f}", flush=True)

    publish()  # an --out that cannot be written fails here, before any engine is built
    for name, pack in packs.items():
        for g in gib[name]:
            for batch in batches:
                budget = int(g * 2**30)
                max_seq_len = None
                row = {"model": name, "pack": str(pack), "budget_gib": g, "budget_bytes": budget, "max_batch": batch}
                try:
                    p = plan_for_pack(pack, budget, max_batch=batch, max_seq_len=max_seq_len)
                except BudgetError as e:
                    row.update(refused=True, error=str(e))
                    rows.append(row)
                    publish()
                    print(f"{name} {g:g} GiB batch {batch}: refused: {e}", flush=True)
                    continue
                print(p.describe(), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
                free0, _ = torch.cuda.mem_get_info(dev)
                t0 = time.perf_counter()
                eng = None
                try:
                    eng = Engine.from_pack(pack, device=dev, max_batch=batch, gpu_budget=budget, routing=a.routing,
                                           cache_contract=a.contract)
                    measure(eng, row, p, free0, t0)
                except (torch.cuda.OutOfMemoryError, EngineError) as e:
                    # the plan underestimated: the allocator cap turned the overrun into this error (the failure
                    # the benchmark exists to find): recorded, the run goes on, the exit status says so
                    row.update(refused=False, plan=p.to_dict(), oom=True, within_budget=False,
                               error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
                    print(f"{name} {g:g} GiB batch {batch}: FAILED under the cap: {row['error']}", flush=True)
                finally:
                    if eng is not None:
                        eng.close()
                    del eng
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.set_per_process_memory_fraction(1.0, dev)  # also after a build that failed
                rows.append(row)
                publish()

    rec["complete"] = True
    publish()
    bad = [r for r in rows if not r.get("refused") and not r["within_budget"]]
    print(f"{len(rows)} rows, {len(bad)} over budget or out of memory under the cap -> {a.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
