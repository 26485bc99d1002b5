"""``runmap generate``: stream a completion of one prompt to stdout."""
from __future__ import annotations

from runmap.cli.options import add_residency_arguments, float_in, int_at_least, placement_line
from runmap.kernels.registry import EXECUTOR_NAMES, executor_help
from runmap.workload.routing import ROUTING_HELP, routing_argument

HELP = "generate text from a pack, streaming tokens to stdout"
DESCRIPTION = """\
Build the engine from the pack --packed (its tokenizer and chat template are read from the pack
directory, never from the network) and stream the completion of --prompt to stdout as it is generated.
Greedy by default; --temperature > 0 samples (with --top-p nucleus filtering; --seed makes it
reproducible). Stops at the end-of-sequence token, at any --stop string, or after --max-new-tokens.
Timing goes to stderr; telemetry (schemas/telemetry.schema.json: executor, regime, resident experts,
hits, misses, host->device bytes, generations, contract observations) is written only when asked, to
--telemetry FILE (atomically); nothing is written into the current directory otherwise. Opening the pack
verifies the sha256 of its non-routed and small files (about 0.75 s per GB on one core; set
RUNMAP_PACK_VERIFY=0 to skip), and every expert row is verified when it is loaded into host memory.
Exit status: 0 ok, 1 bad input or a failed run (the message names it), 2 usage, 130 interrupted."""
EXAMPLES = """\
examples:
  runmap generate --packed /data/olmoe-pack --chat --prompt "Name three rivers." --max-new-tokens 64
  runmap generate --packed /data/olmoe-pack --chat --prompt "..." --gpu-budget 4GiB --expert-placement auto
  runmap generate --packed /data/olmoe-pack --prompt "Once" --resident 32 --trace routes.json --telemetry t.json"""


def add_arguments(p) -> None:
    p.add_argument("--packed", required=True, metavar="DIR", help="pack directory (runmap pack)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="format the prompt with the pack's chat template")
    add_residency_arguments(p)
    p.add_argument("--executor", default="grouped", choices=EXECUTOR_NAMES,
                   help="W4A16 executor (default grouped; on a machine without a GPU the Triton executors run in "
                        "Triton's interpreter, slowly). " + executor_help())
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128, metavar="N", help="default 128")
    p.add_argument("--temperature", type=float_in(0.0), default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None, metavar="N",
                   help="KV cache length (default: min(max_position_embeddings, 4096))")
    p.add_argument("--expert-format", default="int4", choices=["int4", "fp16"],
                   help="int4 (default, the product) or fp16 (baseline: dequantized experts, no cache)")
    p.add_argument("--telemetry", default=None, metavar="FILE",
                   help="write the run's telemetry JSON here (default: no telemetry file)")
    p.add_argument("--routing", default="model", type=routing_argument, metavar="NAME", help=ROUTING_HELP)
    p.add_argument("--routing-seed", type=int, default=0, metavar="S", help="seed of the calibrated routing (default 0)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the routed experts of every layer and step here (schemas/route-trace.schema.json; "
                        "read it with `runmap replay FILE` or `--routing trace:FILE`)")


def run(args) -> int:
    import sys

    from runmap.engine import telemetry
    from runmap.engine.engine import Engine

    def on_token(row, token_id, delta):
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    try:
        eng = Engine.from_pack(args.packed, executor=args.executor, resident=args.resident, gpu_budget=args.gpu_budget,
                               device=args.device,
                               max_batch=1, max_seq_len=args.max_seq_len, expert_format=args.expert_format,
                               routing=args.routing, routing_seed=args.routing_seed,
                               record_routes=args.trace is not None, cache_contract=args.cache_contract,
                               expert_placement=args.expert_placement, cpu_executor=args.cpu_executor, prefetch=args.prefetch,
                               host_read_spares=args.host_read_spares, two_site_min_batch=args.two_site_min_batch,
                               prefill_chunk=args.prefill_chunk,
                               # one request: compiling every size class of pass first would only add to its wait
                               warm_up=False)
        if placement_line(eng):
            print(placement_line(eng), file=sys.stderr)
        res = eng.generate([args.prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat, on_token=on_token)[0]
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input, cache fault, kernel/device failure
        print(f"runmap generate: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if eng.budget_plan is not None:
        print(eng.budget_plan.describe(eng.device.type), file=sys.stderr)
    t = eng.last_timing
    if args.telemetry:
        telemetry.write(args.telemetry, eng.telemetry())
    if args.trace:
        from runmap.workload.trace import write_trace

        write_trace(args.trace, eng.routes.trace())
    print(f"[{res.finish_reason}] {t['prompt_tokens']} prompt + {t['new_tokens']} new tokens; ttft {t['ttft_s']:.3f} s, "
          f"decode {t['decode_tok_s']:.1f} tok/s ({eng.executor}, {eng.regime})"
          + (f"; telemetry {args.telemetry}" if args.telemetry else "")
          + (f"; routes {args.trace}" if args.trace else ""), file=sys.stderr)
    return 0
