"""argparse value types shared by the commands (runmap.cli) and the subcommand definitions below it (runmap.ifeval):
each refuses a bad value with one line that argparse turns into a usage error (exit 2) naming the option."""
from __future__ import annotations


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


def float_in(low: float, high: float = float("inf"), *, low_open: bool = False):
    """argparse ``type=``: a finite float in [low, high] (``low_open``: (low, high]), else one line saying which."""
    import argparse
    import math

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < low or (low_open and v == low) or v > high:
            left = "(" if low_open else "["
            right = f"{high:g}]" if math.isfinite(high) else "inf)"
            raise argparse.ArgumentTypeError(f"must be in {left}{low:g}, {right}, got {text}")
        return v

    return parse


def even_block_size(text: str) -> int:
    """argparse ``type=``: an INT4 scale block size, a positive even integer (qpack's rule)."""
    import argparse

    v = int_at_least(2)(text)
    if v % 2:
        raise argparse.ArgumentTypeError(f"must be even (two INT4 values per byte), got {v}")
    return v


def parsed_by(parse):
    """argparse ``type=``: ``parse(text)``'s value (the option's value is parsed once, here); its ValueError is the
    usage error's one line, without the option name it repeats (argparse names the option): "--shard '3/2': ..." ->
    "'3/2': ..."; "--tokens: ..." -> "..."."""
    import argparse

    def value(text: str):
        try:
            return parse(text)
        except ValueError as e:
            msg = str(e)
            if msg.startswith("--"):
                msg = msg.split(" ", 1)[-1]
            raise argparse.ArgumentTypeError(msg) from None

    return value


def checked_text(check):
    """argparse ``type=``: the text itself once ``check(text)`` accepts it; its error (a ValueError) is the usage
    error's one line, without the option name it repeats (argparse names the option)."""
    def accepted(text: str) -> str:
        check(text)
        return text

    return parsed_by(accepted)
