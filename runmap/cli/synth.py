"""``runmap synth``: write a synthetic HF checkpoint (random weights) of a model preset."""
from __future__ import annotations

import sys

from runmap.arch.base import EXPERT_LAYOUTS
from runmap.cli.options import even_block_size, float_in, int_at_least, preset_argument

HELP = "write a deterministic synthetic HF checkpoint (BF16 safetensors + tokenizer) of a model preset"
DESCRIPTION = """\
Write OUT_DIR as a Hugging Face checkpoint of preset NAME (specs/models/NAME.yaml) with random BF16
weights drawn deterministically from --seed: config.json, model.safetensors (or shards plus
model.safetensors.index.json above --shard-size), generation_config.json, and a byte-level BPE
tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat_template) whose vocabulary size
equals the model's vocab_size. Loadable by transformers' from_pretrained / AutoTokenizer offline.
Tensors are written one at a time (low peak memory even for the real OLMoE-1B-7B dimensions); the
directory appears atomically. Same seed and --device -> same bytes.

With --direct-pack, OUT_DIR is a qpack instead (what `runmap pack` writes, same manifest and checks), synthesized
without any checkpoint for speed runs at real dimensions (runmap/synth/direct_pack.py): random INT4 codes with
FP16 scales sized like the synthetic checkpoints' experts, random FP16 non-routed weights, the synthetic
tokenizer. Its manifest carries `synthesized` (kind direct-pack) and every bench record on it says so: its
outputs are no model's. Layers are drawn and written by --workers threads (default: min(16, CPUs)).

Examples:
  runmap synth /data/ck-olmoe --preset olmoe-1b-7b-0924
  runmap synth /data/pk-mixtral --preset mixtral-8x7b-v0.1 --direct-pack      (~26 GB pack, no checkpoint)"""


def add_arguments(p) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR", help="checkpoint directory to create")
    p.add_argument("--preset", required=True, type=preset_argument, help="model preset name, e.g. tiny-olmoe, tiny-qwen2-moe, olmoe-1b-7b-0924")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--direct-pack", action="store_true",
                   help="write OUT_DIR as a pack synthesized directly (random INT4 codes; speed runs only, labelled "
                        "in its manifest) instead of a checkpoint")
    p.add_argument("--workers", type=int_at_least(1), default=None, help="--direct-pack: writer threads (default min(16, CPUs))")
    p.add_argument("--block-size", type=even_block_size, default=None, help="--direct-pack: INT4 scale block (default 256)")
    p.add_argument("--expert-layout", default=None, choices=EXPERT_LAYOUTS,
                   help="per-expert: experts.{e}.{gate,up,down}_proj.weight (hub layout); "
                        "fused: experts.gate_up_proj (E,2I,H) + experts.down_proj (E,H,I)")
    p.add_argument("--shard-size", type=float_in(0.0, low_open=True), default=None, help="maximum shard size in GiB (default 2)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="random number generator device (values differ between cpu and cuda; default cpu)")
    p.add_argument("--init", default=None, choices=["hf", "routing"],
                   help="hf (default): every weight N(0, 0.02^2), embeddings included; its routing is nearly "
                        "constant at real dimensions. routing: embeddings scaled against the layers' outputs so "
                        "the checkpoint's own router routes like a trained model's (docs/routing-workloads.md)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR: the old one is moved aside, the finished new one renamed in, then the old one deleted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from runmap.arch.config import ConfigError, load_preset

    def fail(msg) -> int:
        print(f"runmap synth: error: {msg}", file=sys.stderr)
        return 1

    if args.direct_pack:
        checkpoint_only = [f for f, v in (("--expert-layout", args.expert_layout), ("--device", args.device),
                                          ("--init", args.init), ("--shard-size", args.shard_size)) if v is not None]
        if checkpoint_only:
            return fail(f"{', '.join(checkpoint_only)}: options of a checkpoint; a --direct-pack has no expert "
                        "layout or shards and is drawn on the CPU")
        if args.workers is not None and args.workers < 1:
            return fail(f"--workers {args.workers}: must be >= 1")
        import time

        from runmap.synth.direct_pack import write_direct_pack

        try:
            cfg, _ = load_preset(args.preset)
            t0 = time.perf_counter()
            out = write_direct_pack(cfg, args.out_dir, seed=args.seed, workers=args.workers, overwrite=args.force,
                                    block_size=256 if args.block_size is None else args.block_size,
                                    preset=args.preset,
                                    progress=not args.no_progress)
        except (ConfigError, ValueError) as e:  # PackError, QPackError, UnsupportedLayerError are ValueErrors
            return fail(e)
        secs = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"wrote {out} (pack synthesized directly: {args.preset}, seed {args.seed}; {size / 1e9:.2f} GB in "
              f"{secs:.1f} s, {size / secs / 1e6:.0f} MB/s)")
        return 0
    if args.workers is not None or args.block_size is not None:
        return fail("--workers and --block-size are options of --direct-pack")
    from runmap.synth.checkpoint import DEFAULT_INIT, write_synthetic

    layout, device = args.expert_layout or "per-expert", args.device or "cpu"
    try:
        cfg, _ = load_preset(args.preset)
        out = write_synthetic(cfg, args.out_dir, seed=args.seed, expert_layout=layout,
                              shard_bytes=int((2.0 if args.shard_size is None else args.shard_size) * 1024**3),
                              device=device,
                              overwrite=args.force, progress=not args.no_progress, init=args.init or DEFAULT_INIT)
    except (ConfigError, FileExistsError, ValueError) as e:
        return fail(e)
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {layout}, init {args.init or DEFAULT_INIT})")
    return 0
