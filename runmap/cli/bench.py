"""runmap bench: run a benchmark campaign and write one JSON record per configuration."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from runmap.engine.budget import size_argument
from runmap.workload.routing import ROUTING_HELP, routing_argument

HELP = "run a benchmark campaign (specs/campaigns/*.yaml): one JSON record per configuration"
DESCRIPTION = """Run every configuration of a campaign spec (model x resident experts per layer x executor x
batch x prompt/decode lengths, plus the transformers-bf16 and fp16-expert baselines) and write

  OUT/<campaign>/records/<config id>.json   one record per configuration (schemas/bench-record.schema.json)
  OUT/<campaign>/campaign.json              run summary: done / failed / skipped configurations

Each configuration: `warmup` untimed runs, then `repeats` timed generate() calls on deterministic
prompts; decode tok/s is their median (min, max kept). Peak GPU memory, cache hits/misses, host->device
bytes, the cache contract's observations and the byte floor (from the model config and the device
copy bandwidth measured at the start of the same run) are recorded; ratios to each baseline are filled
in once every configuration has run. With the run parameter `check: true` a record also holds the logits
check against the reference executor. On the CPU the Triton executors run in the interpreter.

Output is written to a hidden directory in OUT and moved into place at the end. An OUT/<campaign>/ that
already holds campaign.json or records is refused (nothing written) unless --overwrite; a run that fails
never replaces an existing campaign (its output stays in the hidden directory, whose path is printed).

One job per group, then one campaign (what the pipeline's GPU mode runs, one job per GPU):
  runmap bench SPEC --group G --out parts/G             (for every group G of the spec; jobs may run at once)
  runmap bench SPEC --aggregate parts/*  --out OUT        (OUT/<campaign>/records + campaign.json from whatever
                                                         records the parts hold; ratios recomputed across them)

Examples:
  runmap bench specs/campaigns/default.yaml
  runmap bench specs/campaigns/h200.yaml --out $OUT --pack olmoe=/data/olmoe-pack --only 'olmoe.*b1_'
  runmap bench specs/campaigns/h200-partial.yaml --pack olmoe=/data/olmoe-pack --gpu-budget 6GiB --only '^olmoe'
  runmap bench specs/campaigns/h200.yaml --out $OUT --pack olmoe=/data/olmoe-pack \
      --only '^olmoe__(engine__grouped|hf-bf16__hf-bf16)__r64__b1__p32__d256$'    (the README's headline)
Exit status: 0 all configurations ran; 1 a configuration failed, a bad spec, or refused because the campaign
directory already holds a campaign (nothing written; --overwrite replaces it); 2 a bad argument (--only is
not a regular expression, --pack/--checkpoint names no model of the spec); 3 the deadline skipped some.
"""
EXIT_FAILED, EXIT_USAGE, EXIT_DEADLINE = 1, 2, 3
EXIT_EXISTS = EXIT_FAILED  # an output that already exists is bad input (runmap --help: exit status)


def _pairs(items: list[str] | None, flag: str) -> dict:
    from runmap.bench.campaign import UsageError

    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep or not k or not v:
            raise UsageError(f"{flag} {it!r}: expected NAME=DIR")
        out[k] = v
    return out


def _seconds(text: str) -> float:
    """argparse ``type=`` of --deadline-s: a finite number of seconds >= 0 (0: start nothing, list all as skipped)."""
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return v


def add_arguments(p) -> None:
    p.add_argument("spec", help="campaign spec YAML (schemas/campaign-spec.schema.json)")
    p.add_argument("--out", default="results/campaigns", help="output root; records go to OUT/<name>/records/ "
                   "(default: results/campaigns)")
    p.add_argument("--only", metavar="REGEX", help="run only configurations whose id matches REGEX (re.search)")
    p.add_argument("--group", action="append", metavar="NAME", help="run only the configurations of campaign group "
                   "NAME (repeatable; combines with --only)")
    p.add_argument("--aggregate", nargs="+", type=Path, metavar="PART",
                   help="run nothing: join the output folders of earlier --group jobs (each PART the --out of one "
                        "job) into OUT/<campaign>/ (records/ and campaign.json with a `parts` list); a configuration "
                        "no part holds is listed as skipped; exit status as for a run")
    p.add_argument("--pack", action="append", metavar="NAME=DIR", help="pack directory of campaign model NAME "
                   "(overrides the spec; repeatable)")
    p.add_argument("--checkpoint", action="append", metavar="NAME=DIR", help="HF checkpoint of model NAME for the "
                   "hf-bf16 baseline (overrides the spec; repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="override the spec's device")
    p.add_argument("--routing", type=routing_argument, metavar="NAME", help="routing workload of every engine group "
                   "(overrides the spec's run parameter; records carry config.routing). " + ROUTING_HELP)
    p.add_argument("--gpu-budget", action="append", type=size_argument, metavar="SIZE",
                   help="engine groups whose resident is not just `full` run under this GPU budget instead (e.g. 16GiB; "
                        "repeatable: one configuration per budget): the engine's plan (runmap.engine.budget) decides the "
                        "resident experts per layer (host-read and two-site lend all but one of its spare rows to "
                        "residency too), the record's config carries gpu_budget, budget_plan and the resident that "
                        "ran; "
                        "full-residency groups stay (the transfer bound's reference). Overrides the spec's gpu_budget")
    p.add_argument("--deadline-s", type=_seconds, help="start no configuration after this many seconds (the rest is "
                   "listed as skipped in campaign.json)")
    p.add_argument("--keep-going", action="store_true", help="record a failing configuration in campaign.json "
                   "and continue (default: stop at the first failure)")
    p.add_argument("--list", action="store_true", help="print the configuration ids and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace the records and campaign.json of an "
                   "existing OUT/<campaign>/ (default: refuse, exit 1)")


def run(args) -> int:
    from runmap.bench.campaign import (BenchError, OutputExistsError, UsageError, check_model_names, existing_campaign,
                                       expand, filter_configs, load_spec)

    def fail(e: BenchError, code: int) -> int:
        print(f"runmap bench: {e}", file=sys.stderr)
        return code

    try:
        spec = load_spec(args.spec)
        if args.routing:
            for g in spec["groups"]:
                if g["kind"] == "engine":
                    g["params"] = {**g.get("params", {}), "routing": args.routing}
        if args.gpu_budget:
            for g in spec["groups"]:
                if g["kind"] == "engine" and g["resident"] not in ("full", ["full"]):
                    g["resident"] = "budget"
                    g["params"] = {**g.get("params", {}), "gpu_budget": list(args.gpu_budget)}
        packs, checkpoints = _pairs(args.pack, "--pack"), _pairs(args.checkpoint, "--checkpoint")
        check_model_names(spec, packs, "--pack")
        check_model_names(spec, checkpoints, "--checkpoint")
        configs = filter_configs(expand(spec, packs), args.only)
        if args.group:
            unknown = sorted(set(args.group) - {g["name"] for g in spec["groups"]})
            if unknown:
                raise UsageError(f"--group {unknown[0]!r}: the spec has groups "
                                 f"{', '.join(g['name'] for g in spec['groups'])}")
            configs = [c for c in configs if c.group in args.group]
    except UsageError as e:
        return fail(e, EXIT_USAGE)
    except BenchError as e:
        return fail(e, EXIT_FAILED)
    if args.list:
        for c in configs:
            print(c.id)
        return 0
    if not configs:
        print(f"runmap bench: no configuration of {args.spec} matches --only {args.only!r} / --group {args.group}",
              file=sys.stderr)
        return EXIT_USAGE
    if args.aggregate:
        return _aggregate(args, spec, configs)
    found = existing_campaign(Path(args.out) / spec["name"])
    if found and not args.overwrite:
        return fail(OutputExistsError(f"{Path(args.out) / spec['name']} already holds a campaign "
                                      f"({', '.join(found)}); nothing written (pass --overwrite to replace it, "
                                      "or choose another --out)"), EXIT_EXISTS)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"runmap bench: --out {out}: exists and is not a directory (the output root holds one folder per "
              "campaign)", file=sys.stderr)
        return EXIT_FAILED
    from runmap.format.packfile import is_pack_dir

    for name, d in packs.items():
        if not is_pack_dir(Path(d)):
            print(f"runmap bench: --pack {name}={d}: not a runmap pack (no complete manifest.json; make one with "
                  "`runmap pack`)", file=sys.stderr)
            return EXIT_FAILED
    device = args.device or spec["device"]
    if device == "cuda" and not _cuda():
        print("runmap bench: --device cuda (or the spec's device: cuda) but CUDA is not available on this machine; "
              "use --device cpu or auto", file=sys.stderr)
        return EXIT_FAILED
    if device == "cpu" or (device == "auto" and not _cuda()):
        # Triton kernels run on the CPU only in the interpreter; set before kernels are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from runmap.bench.campaign import run_campaign

    command = shlex.join(["runmap", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 and sys.argv[1] == "bench" \
        else shlex.join(["runmap", "bench", args.spec])
    try:
        summary = run_campaign(spec, Path(args.out), configs=configs, device=args.device, packs=packs,
                               checkpoints=checkpoints, command=command, deadline_s=args.deadline_s,
                               keep_going=args.keep_going, progress=not args.no_progress, overwrite=args.overwrite)
    except OutputExistsError as e:
        return fail(e, EXIT_EXISTS)
    except UsageError as e:
        return fail(e, EXIT_USAGE)
    except BenchError as e:
        return fail(e, EXIT_FAILED)
    print(f"{spec['name']}: {len(summary['done'])} done, {len(summary['failed'])} failed, "
          f"{len(summary['skipped'])} skipped in {summary['wall_s']:.1f} s -> {Path(args.out) / spec['name']}")
    for f in summary["failed"]:
        print(f"  FAILED {f['id']}: {f['error']}", file=sys.stderr)
    if summary["failed"]:
        return EXIT_FAILED
    return EXIT_DEADLINE if summary["skipped"] else 0


def _aggregate(args, spec: dict, configs: list) -> int:
    from runmap.bench.aggregate import aggregate_parts
    from runmap.bench.campaign import BenchError, OutputExistsError

    command = shlex.join(["runmap", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 and sys.argv[1] == "bench" \
        else shlex.join(["runmap", "bench", args.spec, "--aggregate", *map(str, args.aggregate)])
    try:
        summary = aggregate_parts(spec, args.aggregate, Path(args.out), configs, command=command,
                                  overwrite=args.overwrite)
    except (BenchError, OutputExistsError, OSError) as e:
        print(f"runmap bench: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{spec['name']}: aggregated {len(summary['parts'])} parts: {len(summary['done'])} done, "
          f"{len(summary['failed'])} failed, {len(summary['skipped'])} skipped -> {Path(args.out) / spec['name']}")
    if summary["failed"]:
        return EXIT_FAILED
    return EXIT_DEADLINE if summary["skipped"] else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
