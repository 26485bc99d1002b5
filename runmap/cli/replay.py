"""``runmap replay``: cache hit rates of a route trace under LRU, LFU-decay and Belady's optimum."""
from __future__ import annotations

HELP = "replay a route trace: LRU, LFU-decay and Belady hit rates at each residency"
DESCRIPTION = """\
Read a route trace (written by `runmap generate --trace FILE`;
schemas/route-trace.schema.json) and replay each stream's routes, layer by layer, through a cache of N experts
per layer for every N in --resident (default: top_k, 2 x top_k, 4 x top_k, ... up to the expert count), under
LRU, LFU with decay (the engine's lfu-decay policy) and Belady's clairvoyant optimum, which no online policy
can beat. Each stream starts from an empty cache; cold misses count. --decode-only leaves the prompt's steps
out of the count (they still fill the cache first). Prints a table; --json FILE writes the numbers
(atomically). Exit status: 0 ok, 1 bad input (a missing or malformed trace: the message names it), 2 usage."""
EXAMPLES = """\
examples:
  runmap generate --packed /data/olmoe-pack --prompt "..." --trace routes.json && runmap replay routes.json
  runmap replay routes.json --resident 8,16,32 --decode-only --json hit-rates.json"""


def _capacities(text: str) -> list[int]:
    import argparse

    try:
        vals = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"cache sizes must be integers >= 1, got {text!r}")
    return vals


def add_arguments(p) -> None:
    p.add_argument("trace", metavar="TRACE", help="route trace JSON file")
    p.add_argument("--resident", type=_capacities, default=None, metavar="N[,N...]",
                   help="cache sizes (experts per layer) to replay; each must be in [top_k, num_experts]")
    p.add_argument("--decode-only", action="store_true", help="count only the decode steps' lookups")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")


def replay_table(trace, capacities, decode_only: bool) -> list[dict]:
    from runmap.workload import replay

    warm = [p if decode_only else 0 for p in trace.prompt_tokens]
    rows = []
    for c in capacities:
        row = {"resident": c}
        for policy in replay.REPLAY_POLICIES:
            routes, warmup = [], []
            for layer in range(trace.num_layers):
                routes += trace.layer_steps(layer)
                warmup += warm
            row[policy] = replay.hit_rate(routes, c, policy, warmup)
        rows.append(row)
    return rows


def run(args) -> int:
    import sys

    from runmap import atomic
    from runmap.workload.trace import TraceError, read_trace

    try:
        trace = read_trace(args.trace)
    except TraceError as e:
        print(f"runmap replay: {e}", file=sys.stderr)
        return 1
    E, k = trace.num_experts, trace.top_k
    caps = args.resident
    if caps is None:
        caps, c = [], k
        while c < E:
            caps.append(c)
            c *= 2
        caps.append(E)
    bad = [c for c in caps if not k <= c <= E]
    if bad:
        print(f"runmap replay: --resident {bad}: each must be in [top_k={k}, num_experts={E}]", file=sys.stderr)
        return 2
    rows = replay_table(trace, caps, args.decode_only)
    steps = sum(s.shape[0] for s in trace.streams)
    print(f"{args.trace}: {trace.arch}, {trace.num_layers} layers x {E} experts, top-{k}, routing {trace.routing}; "
          f"{len(trace.streams)} streams, {steps} steps" + (" (decode steps counted)" if args.decode_only else ""))
    print(f"{'resident':>8}  {'lru':>6}  {'lfu-decay':>9}  {'belady':>6}")
    for r in rows:
        print(f"{r['resident']:>8}  {r['lru']:6.3f}  {r['lfu-decay']:9.3f}  {r['belady']:6.3f}")
    if args.json:
        atomic.write_json(args.json, {"trace": str(args.trace), "routing": trace.routing, "decode_only": args.decode_only,
                                      "rows": rows})
    return 0
