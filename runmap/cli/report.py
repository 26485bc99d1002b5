"""runmap report: render the benchmark report (Markdown + PNG plots) from bench records alone."""
from __future__ import annotations

import sys
from pathlib import Path

HELP = "render results/report.md (tables per model, PNG plots) from benchmark records"
DESCRIPTION = """Read every bench record (records/*.json below the given directories), run the campaign
conformance checks on them, and write a Markdown report: per campaign and model a table of every
configuration (decode/prefill tok/s, TTFT, peak memory, hit rate, host->device traffic, ratios to the
baselines and to the byte floor, required-zero observations), PNG plots of decode tok/s and peak memory
against resident experts per layer with the baselines on the same axes, for partial residency a table of
the engine's hit rate beside the LRU and Belady hit rates replayed over the routes that ran, misses per
token and decode tok/s against the transfer bound (blank where a record has no such field) and, from the
record's record_version, whether its per-token figures count the decode steps alone (bench-record-v2) or the
prompt's misses too (bench-record-v1), and the
one-factor comparisons (residency with the executor fixed, executor with the residency fixed). Pairs that change residency and
executor at once are listed as flagged, with no comparison drawn. Nothing is re-measured.

Examples:
  runmap report                                    # results/campaigns -> results/report.md
  runmap report --records results/campaigns/h200 --out results/campaigns/h200/report.md
Exit status: 0 written, 1 no records / unreadable record, 2 usage.
"""


def add_arguments(p) -> None:
    p.add_argument("--records", nargs="+", default=["results/campaigns"], metavar="DIR",
                   help="directories holding records/*.json (searched recursively; default: results/campaigns)")
    p.add_argument("--out", default="results/report.md", help="Markdown output (default: results/report.md)")
    p.add_argument("--plots-dir", help="where the PNGs go (default: <out dir>/<out stem>-plots)")
    p.add_argument("--headline", action="store_true", help="also print a compact headline table (for the README)")


def run(args) -> int:
    from runmap.bench.campaign import BenchError, load_records
    from runmap.bench.report import headline_table, render

    for d in args.records:
        if not Path(d).exists():
            print(f"runmap report: {d}: no such directory", file=sys.stderr)
            return 1
    try:
        records = load_records(*args.records)
    except BenchError as e:
        print(f"runmap report: {e}", file=sys.stderr)
        return 1
    if not records:
        print(f"runmap report: no bench records under {args.records}", file=sys.stderr)
        return 1
    render(records, Path(args.out), Path(args.plots_dir) if args.plots_dir else None, sources=args.records)
    print(f"report: {len(records)} records -> {args.out}")
    if args.headline:
        print("\n".join(headline_table(records)))
    return 0
