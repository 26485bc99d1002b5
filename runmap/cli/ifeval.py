"""``runmap ifeval``: generate IFEval answers with the engine, and score response files."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runmap.cli.options import int_at_least

HELP = "IFEval: generate answers with a packed model (generate, optionally one shard), merge shards, score"
DESCRIPTION = """\
IFEval (instruction-following evaluation), two steps:

  runmap ifeval generate --packed DIR --out answers.jsonl [--inputs FILE] [--limit N]
      Greedy answers with the model's chat template, batched, resumable: every finished answer is
      appended to --out and synced to disk; a rerun skips prompts already answered. Writes the
      metadata sidecar answers.jsonl.meta.json (model, pack, executor, regime, settings, timing).

  runmap ifeval generate ... --shard I/N --out shard-I.jsonl      (one job per shard, any machines)
  runmap ifeval merge --inputs FILE [--limit N] --out answers.jsonl shard-1.jsonl ... shard-N.jsonl
      Joins the N shard files into one answers file + sidecar of the unsharded format (input order),
      after checking they are shards 1..N of one split, complete, from the same inputs, pack and settings,
      answering every selected prompt exactly once; anything else is refused with one line. Greedy answers
      do not depend on the batch, so the merged file scores prompt by prompt as the unsharded run does.

  runmap ifeval score --inputs FILE --responses answers.jsonl --out DIR
      Checks every instruction (if-verifiable's IFEval checks, deterministic), writes DIR/results.jsonl
      (one line per prompt: strict and loose follow lists) and DIR/summary.json (prompt- and
      instruction-level accuracy, strict and loose, per-instruction breakdown, generation metadata).

Data (prompts, GPT-4 reference responses, NLTK punkt_tab) is vendored in data/ifeval/; nothing is downloaded.
Exit status: 0 ok, 1 bad input (a missing or malformed file, naming it and the line) or a failed run,
2 usage (no STEP, unknown option), 130 interrupted.
"""
EXAMPLES = """\
examples:
  runmap ifeval generate --packed /data/olmoe-pack --out answers.jsonl
  runmap ifeval generate --packed /data/olmoe-pack --out quick.jsonl --limit 20
  runmap ifeval score --responses answers.jsonl --out score/"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from runmap.ifeval.generate import add_generate_arguments
    from runmap.ifeval.score import DEFAULT_INPUTS

    sub = parser.add_subparsers(dest="ifeval_command", metavar="STEP")
    sc = sub.add_parser(
        "score", help="score a response file against IFEval inputs",
        description="Score a response JSONL (fields 'prompt' and 'response') against IFEval inputs. Every "
                    "input prompt needs exactly one response; a missing, extra or malformed line is an "
                    "error naming the line.")
    sc.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS,
                    help=f"IFEval input JSONL (key, prompt, instruction_id_list, kwargs); default {DEFAULT_INPUTS}")
    sc.add_argument("--responses", type=Path, required=True, help="response JSONL: 'prompt' and 'response' per line")
    sc.add_argument("--out", type=Path, required=True, help="output folder for results.jsonl and summary.json")
    sc.add_argument("--meta", type=Path, default=None,
                    help="generation metadata JSON (default: RESPONSES.meta.json when it exists)")
    sc.add_argument("--limit", type=int_at_least(1), default=None, metavar="N",
                    help="score the first N prompts of --inputs only (default: the --limit the responses were "
                         "generated with, from the metadata; else every prompt)")
    sc.add_argument("--no-progress", action="store_true", help="no progress bar")
    sc.set_defaults(_ifeval_run=_run_score)

    mg = sub.add_parser(
        "merge", help="join `generate --shard I/N` answer files into one answers file + sidecar",
        description="Merge the answer files of `runmap ifeval generate --shard I/N` (I = 1..N) into one answers "
                    "JSONL (input order) and its sidecar OUT.meta.json, both written atomically, then score OUT as "
                    "an unsharded run. Refused (exit 1, one line) if a shard is missing, given twice, incomplete, "
                    "or made from other inputs, pack or settings, or if a prompt is answered twice or not at all.")
    mg.add_argument("shards", nargs="+", type=Path, metavar="SHARD.jsonl",
                    help="shard answer files (each with its SHARD.jsonl.meta.json), any order")
    mg.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS,
                    help=f"the IFEval input JSONL the shards were generated from (default {DEFAULT_INPUTS})")
    mg.add_argument("--limit", type=int_at_least(1), default=None, help="the --limit the shards were generated with")
    mg.add_argument("--out", type=Path, required=True, help="merged answers JSONL; sidecar OUT.meta.json")
    mg.set_defaults(_ifeval_run=_run_merge)

    gen = sub.add_parser(
        "generate", help="generate answers to IFEval prompts with a packed model (resumable)",
        description="Greedy generation of IFEval answers with the packed model's chat template. Batched; "
                    "each finished answer is appended to --out with flush+fsync, so an interruption loses "
                    "no written answer and a rerun continues where it stopped.")
    add_generate_arguments(gen)
    gen.set_defaults(_ifeval_run=_run_generate)


def _run_score(args) -> int:
    from runmap.ifeval.score import IFEvalError, format_table, score_files, write_outputs

    try:
        results, summary = score_files(args.inputs, args.responses, meta=args.meta, progress=not args.no_progress,
                                       limit=args.limit)
        res_path, sum_path = write_outputs(args.out, results, summary)
    except (IFEvalError, OSError) as e:  # bad input file or unwritable output: exit 1 (2 is for usage errors)
        print(f"runmap ifeval score: error: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    print(f"wrote {res_path} and {sum_path}")
    return 0


def _run_generate(args) -> int:
    from runmap.ifeval.generate import IFEvalGenerateError, run_cli

    try:
        return run_cli(args)
    except (IFEvalGenerateError, OSError) as e:
        print(f"runmap ifeval generate: error: {e}", file=sys.stderr)
        return 1


def _run_merge(args) -> int:
    from runmap.ifeval.generate import IFEvalGenerateError, sidecar_path
    from runmap.ifeval.shard import merge_shards

    try:
        meta = merge_shards(args.shards, args.inputs, args.out, limit=args.limit)
    except (IFEvalGenerateError, OSError) as e:
        print(f"runmap ifeval merge: error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(meta['merged_from'])} shards: {meta['counts']['answered']} answers")
    print(f"wrote {args.out} and {sidecar_path(args.out)}")
    return 0


def run(args) -> int:
    fn = getattr(args, "_ifeval_run", None)
    if fn is None:
        print("runmap ifeval: choose a step: generate, merge or score (see runmap ifeval --help)", file=sys.stderr)
        return 2
    return fn(args)
