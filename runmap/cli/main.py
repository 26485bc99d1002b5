"""The ``runmap`` command. Each subcommand lives in its own module exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches,
so adding a subcommand is one import and one line in ``SUBCOMMANDS``. The subcommand modules import
torch, Triton and the engine inside ``run`` only, so building the parser (``runmap --help``) stays fast."""
from __future__ import annotations

import argparse
import os
import stat
import sys

from runmap.cli import (bench, check_kernels, contract, generate, gpu_slot, ifeval, logits, pack, replay, report,
                        serve, synth, validate)

SUBCOMMANDS = {
    "synth": synth,
    "pack": pack,
    "validate": validate,
    "check-kernels": check_kernels,
    "contract": contract,
    "logits": logits,
    "generate": generate,
    "replay": replay,
    "bench": bench,
    "report": report,
    "ifeval": ifeval,
    "serve": serve,
    "gpu-slot": gpu_slot,
}


EXIT_STATUS = """\
exit status (the same for every subcommand):
  0    success
  1    bad input (a missing, malformed or corrupt file, an output that already exists: one line naming
       it and what is allowed), a failed check, a failed run, or a requested device that is missing
  2    usage error: unknown subcommand or option, a missing, malformed or out-of-range argument value,
       options that exclude each other (a value out of range only for the input it names, such as
       --resident above a pack's experts per layer, is bad input: 1)
  3    runmap bench only: the run ended at --deadline-s with configurations skipped (listed in campaign.json)
  130  interrupted (Ctrl-C)
  141  the reader of standard output went away (a pipe into `head`): stopped without a message
No input makes runmap end in a Python traceback; RUNMAP_TRACEBACK=1 shows the traceback of an
unexpected error instead of its one-line report. Nothing is written into the current directory
unless a path given on the command line (or a subcommand's documented default) says so."""

UNEXPECTED_HINT = "set RUNMAP_TRACEBACK=1 to see the traceback"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, wrapped at spaces only: an option or a path with a hyphen (--cache-contract,
    docs/cache-contract.md) is never split across two lines."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runmap",
        description=(
            "Horizon RunMap: run Mixture-of-Experts models (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral) on one GPU with routed experts "
            "compressed to INT4 qpacked rows, W4A16 Triton kernels and a strict expert-residency cache."
        ),
        epilog=EXIT_STATUS,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           epilog=getattr(mod, "EXAMPLES", None), formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _select_triton_backend() -> None:
    """Without a CUDA device the Triton kernels can only run in Triton's interpreter (same arithmetic, on
    the CPU), which has to be chosen before any ``@triton.jit`` function is defined. An explicit
    TRITON_INTERPRET in the environment is left alone."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and usage errors end here, before torch is imported
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        if not getattr(args, "_no_torch", False):
            _select_triton_backend()
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an error no subcommand turned into a message: one line, exit 1, no traceback
        if isinstance(e, BrokenPipeError) and _stdout_is_pipe():
            # the reader of our output went away (`runmap bench SPEC --list | head`): stop without a message, with
            # the status of a process ended by SIGPIPE (what the work was doing did not finish)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
            return 141
        if os.environ.get("RUNMAP_TRACEBACK", "0") not in ("", "0"):
            raise
        print(f"runmap {args.command}: error: {type(e).__name__}: {e} ({UNEXPECTED_HINT})", file=sys.stderr)
        return 1


def _stdout_is_pipe() -> bool:
    """Standard output is a pipe (a broken pipe elsewhere, e.g. a client's socket, is an error like any other)."""
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
