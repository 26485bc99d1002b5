"""runmap bench: run a benchmark campaign and write one JSON record per configuration."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

HELP = "run a benchmark campaign (specs/campaigns/*.yaml): one JSON record per configuration"
DESCRIPTION = """Run every configuration of a campaign spec (model x resident experts per layer x executor x
batch x prompt/decode lengths, plus the transformers-bf16 and fp16-expert baselines) and write

  OUT/<campaign>/records/<config id>.json   one record per configuration (schemas/bench-record.schema.json)
  OUT/<campaign>/campaign.json              run summary: done / failed / skipped configurations

Each configuration: `warmup` untimed runs, then `repeats` timed generate() calls on deterministic
prompts; decode tok/s is their median (min, max kept). Peak GPU memory, cache hits/misses, host->device
bytes, the cache contract's observations and the byte floor (from the model config and the device
copy bandwidth measured at the start of the same run) are recorded; ratios to each baseline are filled
in once every configuration has run. On the CPU the Triton executors run in the interpreter.

Examples:
  runmap bench specs/campaigns/default.yaml
  runmap bench specs/campaigns/h200.yaml --out $OUT --pack olmoe=/data/olmoe-pack --only 'olmoe.*b1_'
Exit status: 0 all configurations ran, 1 a configuration failed (or a bad spec), 3 the deadline skipped some.
"""


def _pairs(items: list[str] | None, flag: str) -> dict:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"{flag} {it!r}: expected NAME=DIR")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def add_arguments(p) -> None:
    p.add_argument("spec", help="campaign spec YAML (schemas/campaign-spec.schema.json)")
    p.add_argument("--out", default="results/campaigns", help="output root; records go to OUT/<name>/records/ "
                   "(default: results/campaigns)")
    p.add_argument("--only", metavar="REGEX", help="run only configurations whose id matches REGEX (re.search)")
    p.add_argument("--pack", action="append", metavar="NAME=DIR", help="pack directory of campaign model NAME "
                   "(overrides the spec; repeatable)")
    p.add_argument("--checkpoint", action="append", metavar="NAME=DIR", help="HF checkpoint of model NAME for the "
                   "hf-bf16 baseline (overrides the spec; repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="override the spec's device")
    p.add_argument("--deadline-s", type=float, help="start no configuration after this many seconds (the rest is "
                   "listed as skipped in campaign.json)")
    p.add_argument("--keep-going", action="store_true", help="record a failing configuration in campaign.json "
                   "and continue (default: stop at the first failure)")
    p.add_argument("--list", action="store_true", help="print the configuration ids and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from runmap.bench.campaign import BenchError, expand, filter_configs, load_spec

    try:
        spec = load_spec(args.spec)
        configs = filter_configs(expand(spec), args.only)
    except BenchError as e:
        print(f"runmap bench: {e}", file=sys.stderr)
        return 1
    if args.list:
        for c in configs:
            print(c.id)
        return 0
    if not configs:
        print(f"runmap bench: no configuration of {args.spec} matches --only {args.only!r}", file=sys.stderr)
        return 1
    device = args.device or spec["device"]
    if device == "cpu" or (device == "auto" and not _cuda()):
        # Triton kernels run on the CPU only in the interpreter; set before kernels are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from runmap.bench.campaign import run_campaign

    command = shlex.join(["runmap", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 and sys.argv[1] == "bench" \
        else shlex.join(["runmap", "bench", args.spec])
    try:
        summary = run_campaign(spec, Path(args.out), configs=configs, device=args.device,
                               packs=_pairs(args.pack, "--pack"), checkpoints=_pairs(args.checkpoint, "--checkpoint"),
                               command=command, deadline_s=args.deadline_s, keep_going=args.keep_going,
                               progress=not args.no_progress)
    except BenchError as e:
        print(f"runmap bench: {e}", file=sys.stderr)
        return 1
    print(f"{spec['name']}: {len(summary['done'])} done, {len(summary['failed'])} failed, "
          f"{len(summary['skipped'])} skipped in {summary['wall_s']:.1f} s -> {Path(args.out) / spec['name']}")
    for f in summary["failed"]:
        print(f"  FAILED {f['id']}: {f['error']}", file=sys.stderr)
    if summary["failed"]:
        return 1
    return 3 if summary["skipped"] else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
