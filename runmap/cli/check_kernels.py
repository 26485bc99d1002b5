"""`runmap check-kernels`: every W4A16 executor against the FP32 reference; writes results/kernels/<device>.json."""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from runmap.atomic import write_json
from runmap.kernels.registry import EXECUTOR_NAMES
from runmap.provenance import utc_timestamp

HELP = "check every W4A16 executor against the FP32 reference over expert shapes x token counts"
DESCRIPTION = """\
Runs each executor (reference, scalar, grouped, topk-fused; on cpu also the CPU sites cpu-int4 and cpu-native) over expert
shapes x token counts M. Every case draws fresh random experts (3/4 of them resident, in shuffled physical
rows), activations, routing with experts repeated across tokens, and gate weights; every buffer the kernel
wrappers allocate starts as NaN.
A case passes when the output is finite and ||y - ref|| / ||ref|| <= 2e-3 (1e-2 for cpu-int4, whose torch
kernel computes in bfloat16; cpu-native computes in FP32), ref = dequantize to FP32 + FP32 matmuls (kernels/reference.py).

Shapes: tiny = four small synthetic expert shapes (a partial last block of the down projection, block 64, and
the Qwen3-MoE and Mixtral block structures at interpreter size); full = the four families' expert shapes: OLMoE
(2048x1024, top-8), Qwen1.5-MoE (2048x1408, down K = 5.5 blocks, top-4), Qwen3-MoE (2048x768, 128 experts, top-8)
and Mixtral (4096x14336, top-2). On CUDA the default M reaches 16,400 tokens (the grouped executor's
decoded-weights mode). On the CPU the kernels run in Triton's interpreter (slow: use tiny).

Writes JSON (schemas/kernel-check.schema.json) atomically; exit status 1 if any case fails.

  runmap check-kernels                                        # CPU interpreter, tiny shapes
  runmap check-kernels --device cuda --shapes full --out results/kernels/h200.json
  PYTHONPATH=. python3 -m runmap.cli.check_kernels --device cuda   # from a source tree
"""

FORMAT = "kernel-check-v1"


def add_arguments(p) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: Triton interpreter; cuda: compiled kernels on GPU 0 (default cpu)")
    p.add_argument("--shapes", choices=("tiny", "full"), default="tiny", help="expert shape set (default tiny)")
    p.add_argument("--m", default=None,
                   help="comma-separated token counts; default 1,3,17,64 on cpu and "
                        "1,2,3,8,17,64,300,4100,8200,16400 on cuda (runmap.kernels.check.M_DEFAULT)")
    p.add_argument("--executors", default=None,
                   help=f"comma-separated subset of {','.join(EXECUTOR_NAMES)} (default: all on cpu; on cuda all but "
                        "the CPU sites, which never read device rows)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each case derives its own (default 0)")
    p.add_argument("--out", default=None, help="output JSON (default results/kernels/<device>.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _command_line() -> str:
    args = sys.argv[1:]
    if args and args[0] == "check-kernels":
        args = args[1:]
    return " ".join(["runmap check-kernels"] + [shlex.quote(a) for a in args])


def run(args) -> int:
    if args.device == "cpu":
        # Must precede the first import of kernels: @triton.jit picks the interpreter at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from runmap.kernels import check as kc

    if args.device == "cuda" and not torch.cuda.is_available():
        print("runmap check-kernels: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 1
    if args.executors is None:
        executors = [e for e in kc.EXECUTORS if args.device == "cpu" or kc.REGISTRY[e].site != "cpu"]
    else:
        executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    unknown = [e for e in executors if e not in kc.EXECUTORS]
    if unknown or not executors:
        print(f"runmap check-kernels: unknown executor(s) {unknown}; choose from {kc.EXECUTORS}", file=sys.stderr)
        return 2
    cpu_sites = [e for e in executors if kc.REGISTRY[e].site == "cpu"]
    if args.device == "cuda" and cpu_sites:
        print(f"runmap check-kernels: {cpu_sites} compute on the CPU from host rows; check them with --device cpu",
              file=sys.stderr)
        return 2
    try:
        ms = tuple(int(v) for v in args.m.split(",")) if args.m else kc.M_DEFAULT[args.device]
    except ValueError:
        print(f"runmap check-kernels: --m must be comma-separated integers, got {args.m!r}", file=sys.stderr)
        return 2
    if any(m < 1 for m in ms):
        print("runmap check-kernels: every --m must be >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    out = Path(args.out or f"results/kernels/{args.device}.json")
    shapes = kc.SHAPES[args.shapes]
    plan = [(s, m, e) for s in shapes for m in ms for e in executors]

    restore = kc.poison_allocations()
    cases = []
    t0 = time.time()
    try:
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(plan), desc="kernel cases", unit="case", file=sys.stderr)
        for n, (shape, m, executor) in enumerate(plan):
            case = kc.run_case(executor, shape, m, device, seed=args.seed * 100_003 + n)
            cases.append(case)
            if bar is not None:
                bar.set_postfix_str(f"{executor} {shape.name} M={m} err={case['error']}")
                bar.update(1)
        if bar is not None:
            bar.close()
    finally:
        restore()
    failed = [c for c in cases if not c["pass"]]
    doc = {
        "format": FORMAT,
        "created": utc_timestamp(),
        "command": _command_line(),
        "device": kc.device_info(device, interpreter),
        "versions": kc.versions(),
        "shape_set": args.shapes,
        "shapes": {s.name: s.to_dict() for s in shapes},
        "tolerance": kc.TOLERANCE,
        "seed": args.seed,
        "seconds": round(time.time() - t0, 2),
        "cases": cases,
        "summary": {"cases": len(cases), "passed": len(cases) - len(failed), "failed": len(failed)},
        "pass": not failed,
    }
    write_json(out, doc)
    width = max(len(e) for e in executors)
    print(f"{'executor':<{width}}  {'shape':<12} {'M':>4}  {'rel.err':>9}  result")
    for c in cases:
        err = "n/a" if c["error"] is None else f"{c['error']:.2e}"
        print(f"{c['executor']:<{width}}  {c['shape']:<12} {c['m']:>4}  {err:>9}  "
              f"{'pass' if c['pass'] else 'FAIL ' + c.get('message', 'non-finite or over tolerance')}")
    by_tol: dict = {}  # a CPU site is held to its own bound (kernels/check.py tolerance)
    for e in executors:
        by_tol.setdefault(kc.tolerance(e), []).append(e)
    tol = "; ".join(f"{t} for {', '.join(es)}" for t, es in by_tol.items())
    print(f"{len(cases) - len(failed)}/{len(cases)} cases pass (tolerance {tol}); wrote {out}")
    return 0 if not failed else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m runmap.cli.check_kernels", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
