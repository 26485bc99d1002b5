"""``runmap synth``: write a synthetic HF checkpoint (random weights) of a model preset."""
from __future__ import annotations

import sys

from runmap.arch.base import EXPERT_LAYOUTS

HELP = "write a deterministic synthetic HF checkpoint (BF16 safetensors + tokenizer) of a model preset"
DESCRIPTION = """\
Write OUT_DIR as a Hugging Face checkpoint of preset NAME (specs/models/NAME.yaml) with random BF16
weights drawn deterministically from --seed: config.json, model.safetensors (or shards plus
model.safetensors.index.json above --shard-size), generation_config.json, and a byte-level BPE
tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat_template) whose vocabulary size
equals the model's vocab_size. Loadable by transformers' from_pretrained / AutoTokenizer offline.
Tensors are written one at a time (low peak memory even for the real OLMoE-1B-7B dimensions); the
directory appears atomically. Same seed and --device -> same bytes."""


def add_arguments(p) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR", help="checkpoint directory to create")
    p.add_argument("--preset", required=True, help="model preset name, e.g. tiny-olmoe, tiny-qwen2-moe, olmoe-1b-7b-0924")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--expert-layout", default="per-expert", choices=EXPERT_LAYOUTS,
                   help="per-expert: experts.{e}.{gate,up,down}_proj.weight (hub layout); "
                        "fused: experts.gate_up_proj (E,2I,H) + experts.down_proj (E,H,I)")
    p.add_argument("--shard-size", type=float, default=2.0, help="maximum shard size in GiB (default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="random number generator device (values differ between cpu and cuda; default cpu)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR: the old one is moved aside, the finished new one renamed in, then the old one deleted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from runmap.arch.config import ConfigError, load_preset
    from runmap.synth.checkpoint import write_synthetic

    try:
        cfg, _ = load_preset(args.preset)
        out = write_synthetic(cfg, args.out_dir, seed=args.seed, expert_layout=args.expert_layout,
                              shard_bytes=int(args.shard_size * 1024**3), device=args.device,
                              overwrite=args.force, progress=not args.no_progress)
    except (ConfigError, FileExistsError, ValueError) as e:
        print(f"runmap synth: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {args.expert_layout})")
    return 0
