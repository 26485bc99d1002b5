"""``runmap logits``: one prompt's logits at every position, for checking the engine against anything else."""
from __future__ import annotations

from pathlib import Path
from runmap.atomic import atomic_path
from runmap.argtypes import parsed_by
from runmap.cli.options import add_residency_arguments, placement_line
from runmap.kernels.registry import EXECUTOR_NAMES

HELP = "write a prompt's logits (every position) to a safetensors file"
DESCRIPTION = """\
Run one prefill of the token ids given by --tokens through the engine built from the pack --packed and
write FILE.safetensors with
  logits  float32 (T, vocab_size)   the logits of every position
  tokens  int64 (T,)                the prompt
and metadata (executor, regime, resident experts per layer, pack identity). Anyone can compare these
logits with another implementation of the same checkpoint (e.g. transformers with the dequantized experts).
Telemetry (schemas/telemetry.schema.json) goes to --telemetry (default: telemetry-<FILE stem>.json beside
the output). Exit status: 0 ok, 1 bad input (the message names it), 2 usage."""
EXAMPLES = """\
examples:
  runmap logits --packed /data/olmoe-pack --tokens 1,2,3,4 --out logits.safetensors
  runmap logits --packed /data/olmoe-pack --tokens 1,2,3,4 --executor grouped --resident 16 --out partial.safetensors"""


def add_arguments(p) -> None:
    p.add_argument("--packed", required=True, metavar="DIR", help="pack directory (runmap pack)")
    p.add_argument("--tokens", required=True, metavar="IDS", type=parsed_by(parse_tokens),
                   help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--executor", default="reference", choices=EXECUTOR_NAMES,
                   help="default reference: the FP32 torch truth")
    add_residency_arguments(p)
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="output file (written atomically)")
    p.add_argument("--telemetry", default=None, metavar="FILE", help="telemetry JSON path")


def parse_tokens(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError as e:
        raise ValueError(f"--tokens: expected comma-separated integers, got {text!r}") from e
    if not ids:
        raise ValueError("--tokens: no token ids given")
    return ids


def run(args) -> int:
    import sys

    import torch
    from safetensors.torch import save_file

    from runmap.engine import telemetry
    from runmap.engine.engine import Engine

    try:
        ids = args.tokens  # int ids (parsed by the option's type)
        out = Path(args.out)
        eng = Engine.from_pack(args.packed, executor=args.executor, resident=args.resident, gpu_budget=args.gpu_budget,
                               device=args.device,
                               max_batch=1, max_seq_len=max(len(ids), 16), cuda_graphs=False,
                               expert_placement=args.expert_placement, cpu_executor=args.cpu_executor, prefetch=args.prefetch,
                               host_read_spares=args.host_read_spares, two_site_min_batch=args.two_site_min_batch,
                               cache_contract=args.cache_contract,
                               prefill_chunk=args.prefill_chunk, warm_up=False)  # one request
        if placement_line(eng):
            print(placement_line(eng), file=sys.stderr)
        if eng.budget_plan is not None:
            print(eng.budget_plan.describe(eng.device.type), file=sys.stderr)
        logits = eng.logits(ids)  # (T, V) fp32
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad input, cache fault, kernel/device failure
        print(f"runmap logits: error: {e}", file=sys.stderr)
        return 1
    meta = {"executor": eng.executor, "regime": eng.regime, "resident": str(eng.resident),
            "pack": str(args.packed), "pack_identity": str(eng.pack_identity), "arch": eng.cfg.arch}
    with atomic_path(out) as tmp:
        save_file({"logits": logits.contiguous(), "tokens": torch.tensor(ids, dtype=torch.int64)}, str(tmp),
                  metadata=meta)
    tpath = Path(args.telemetry) if args.telemetry else out.parent / f"telemetry-{out.stem}.json"
    telemetry.write(tpath, eng.telemetry())
    print(f"wrote {out}: logits {tuple(logits.shape)} ({eng.executor}, {eng.regime}); telemetry {tpath}",
          file=sys.stderr)
    return 0
