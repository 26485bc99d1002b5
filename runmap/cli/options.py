"""Options several subcommands share, defined once so that their names, checks and help agree."""
from __future__ import annotations

from runmap.engine.budget import size_argument


def int_at_least(minimum: int):
    """argparse ``type=``: an integer >= ``minimum``, else one line saying which."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {v}")
        return v

    return parse


def add_residency_arguments(p) -> None:
    """``--resident N | --gpu-budget SIZE`` (mutually exclusive): how many experts per layer stay on the GPU."""
    res = p.add_mutually_exclusive_group()
    res.add_argument("--resident", type=int, default=None, metavar="N",
                     help="routed experts per layer on the device (default: all = full residency)")
    res.add_argument("--gpu-budget", type=size_argument, default=None, metavar="SIZE",
                     help="instead of --resident: plan the GPU memory (non-routed weights, KV cache, workspaces, spare "
                          "rows), keep as many experts per layer as fit SIZE (e.g. 8GiB) and cap torch's allocator at "
                          "SIZE; the plan is printed. A budget below the minimum is refused")
