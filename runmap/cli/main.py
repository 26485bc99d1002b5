"""The ``runmap`` command. Each subcommand lives in its own module exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches,
so adding a subcommand is one line in ``SUBCOMMANDS``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module. Modules are imported lazily so `runmap --help` stays fast.
SUBCOMMANDS = {
    "synth": "runmap.cli.synth",
    "pack": "runmap.cli.pack",
    "validate": "runmap.cli.validate",
    "check-kernels": "runmap.cli.check_kernels",
    "contract": "runmap.cli.contract",
    "logits": "runmap.cli.logits",
    "generate": "runmap.cli.generate",
    "bench": "runmap.cli.bench",
    "report": "runmap.cli.report",
    "ifeval": "runmap.cli.ifeval",
}


def _available():
    for name, mod in SUBCOMMANDS.items():
        try:
            yield name, importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # a real missing dependency inside an existing module: surface it
                raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runmap",
        description=(
            "Horizon RunMap: run Mixture-of-Experts models (OLMoE, Qwen2-MoE) on one GPU with routed experts "
            "compressed to INT4 qpacked rows, W4A16 Triton kernels and a strict expert-residency cache."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in _available():
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
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
    _select_triton_backend()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
