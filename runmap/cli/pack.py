"""``runmap pack``: quantize a local HF MoE checkpoint's routed experts into a qpack directory."""
from __future__ import annotations

import sys

from runmap.cli.options import even_block_size

HELP = "pack a local HF checkpoint into INT4 qpacked expert rows + FP16 non-routed tensors + manifest.json"
DESCRIPTION = """\
Pack CHECKPOINT_DIR (config.json + model.safetensors or shards with model.safetensors.index.json, an
OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or MixtralForCausalLM, per-expert or fused
expert tensors) into OUT_DIR:

  manifest.json                  source identity (file sizes + sha256), config, quantization rule,
                                 row layout, per-layer file/offset, per-expert sha256, quantization error,
                                 size + sha256 of every other file of the pack; written last
  nonrouted.safetensors          embeddings, attention, norms, router, shared expert, lm_head as FP16
  experts-layer-LLL.safetensors  uint8 (num_experts, row_bytes): one contiguous INT4 row per expert
  config.json, tokenizer files   copied from the checkpoint

Routed experts are quantized to symmetric INT4 with one FP16 scale per BLOCK_SIZE values along K
(the last block of a row may be partial). Streams layer by layer; uses the GPU for the arithmetic
when --device is auto and one is present. The output appears atomically: a failed or interrupted
pack leaves no OUT_DIR (only a hidden .OUT_DIR.tmp-* directory if the process is killed; the next pack
of OUT_DIR removes it). --force replaces OUT_DIR only when it is a pack directory.
Exit status: 0 ok, 1 bad input (message names the file and tensor), 2 usage, 130 interrupted."""
EXAMPLES = """\
examples:
  runmap pack /data/OLMoE-1B-7B-0924-Instruct /data/olmoe-pack --device cuda
  runmap pack results/checkpoints/tiny-olmoe /tmp/tiny-pack --block-size 128 --force"""


def add_arguments(p) -> None:
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="local Hugging Face checkpoint directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="pack directory to create")
    p.add_argument("--block-size", type=even_block_size, default=256, help="values per FP16 scale block along K (even; default 256)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the quantization arithmetic runs (auto: cuda if available); the bytes are identical")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR that is a pack (never a file or another directory): the finished new "
                   "one is swapped in, then the old one deleted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from runmap.format.checkpoint import CheckpointError
    from runmap.arch.config import ConfigError
    from runmap.format.pack import pack_checkpoint
    from runmap.format.packfile import PackError, PackReader
    from runmap.format.qpack import QPackError

    try:
        out = pack_checkpoint(args.checkpoint_dir, args.out_dir, block_size=args.block_size, device=args.device,
                              overwrite=args.force, progress=not args.no_progress)
    except (CheckpointError, ConfigError, PackError, QPackError, FileExistsError) as e:
        print(f"runmap pack: error: {e}", file=sys.stderr)
        return 1
    with PackReader(out, verify=False) as r:  # just written and hashed
        m = r.manifest
        total = sum(l["nbytes"] for l in m["layers"]) + m["nonrouted"]["file_bytes"]
        worst = max(max(v["rel_fro"]) for l in m["layers"] for v in l["quant_error"].values())
        print(f"packed {out}: {r.num_layers} layers x {r.num_experts} experts, row {r.layout.row_bytes} B, "
              f"{total / 1e6:.1f} MB, max rel. Frobenius error {worst:.4f}, {m['timing']['total_s']:.1f} s on "
              f"{m['compute_device']}")
    return 0
