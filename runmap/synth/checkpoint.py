"""Synthetic Hugging Face MoE checkpoints of any supported family, deterministic from a seed.

The output is exactly the on-disk format of a hub checkpoint: ``config.json``, BF16 safetensors with
HF tensor names (one ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when the
total exceeds ``shard_bytes``), a ``generation_config.json`` and a tokenizer (``synth_tokenizer``).

Determinism: every tensor is drawn from its own ``torch.Generator`` seeded by sha256(seed, tensor
key), so a tensor's values depend only on (seed, key, generator device), never on write order. An
expert's key is its per-expert HF name (as the family's adapter spells it) in both layouts, so a ``fused`` and a ``per-expert`` checkpoint
with the same seed hold identical values. Same seed and device -> same bytes (CPU and CUDA generators
draw different streams; the device is recorded in the safetensors metadata).

Streaming: tensors are generated and written one at a time (``st_io.StreamingWriter``), so peak
memory is about one tensor (one layer's fused expert tensor in the fused layout) even for the real
OLMoE-1B-7B dimensions (~7B parameters, ~14 GB BF16).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from runmap.arch.base import EXPERT_LAYOUTS
from runmap.arch.config import ModelConfig
from runmap.format.checkpoint import INDEX_FILE, SINGLE_FILE
from runmap.format.safetensors_io import StreamingWriter
from runmap.synth.tokenizer import write_tokenizer
from runmap.atomic import replace_dir

WEIGHT_STD = 0.02  # the HF initializer_range of both architectures
NORM_STD = 0.05  # norms are 1 + N(0, NORM_STD^2)
DEFAULT_SHARD_BYTES = 2 * 1024**3
EMBED_NAME = "model.embed_tokens.weight"

# How the token embeddings are scaled against the layers' outputs (docs/routing-workloads.md, "The synthetic
# checkpoints' own routing"). Every other tensor is drawn the same way under both.
#   "hf": every weight N(0, WEIGHT_STD^2), embeddings included (transformers' initializer). The residual
#       write of one attention layer then has an RMS of about WEIGHT_STD^2 * sqrt(H * nh * D) (0.82 at
#       OLMoE's H = 2048) against the embeddings' 0.02, so from layer 0 on each router sees mostly the
#       context-averaged attention output, which hardly moves from one token to the next: a few experts win
#       every step (near-constant routing: engine hit rates of 0.98-0.997 at 30 of 64 experts on the H200).
#   "routing": the embeddings' standard deviation is EMBED_RATIO times that attention RMS. The routers then
#       see the current token (variety from token to token) plus the context (the same experts again for a
#       while), as in a trained model; EMBED_RATIO was chosen with tools/explore/probe_synth_routing.py so
#       that the LRU hit-rate curve at OLMoE's dimensions lands on the published points (0.61 at 16 and
#       0.83 at 32 of 64 experts per layer). With tied embeddings the lm_head is scaled too (sharper logits).
#       Because every sublayer reads a normalised residual, scaling the embeddings alone is the same, for
#       routing and logits, as scaling down every residual write; it leaves all other tensors' bytes as "hf".
# "hf" stays the default: the tests compare the engine's routes with transformers' exactly, which holds only
# while the routers' top-k margins are wide; under "routing" some are within FP16 rounding (the docs say
# which test fails). The benchmarks' checkpoints use "routing".
INITS = ("routing", "hf")
DEFAULT_INIT = "hf"
EMBED_RATIO = 0.45


def embedding_std(cfg: ModelConfig, init: str = DEFAULT_INIT) -> float:
    """Standard deviation of the token embeddings under ``init`` (see INITS)."""
    if init == "hf":
        return WEIGHT_STD
    if init == "routing":
        return EMBED_RATIO * WEIGHT_STD**2 * (cfg.hidden_size * cfg.num_heads * cfg.head_dim) ** 0.5
    raise ValueError(f"init must be one of {INITS}, got {init!r}")


def _seed_for(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _draw(seed: int, key: str, shape, device, std: float = WEIGHT_STD) -> torch.Tensor:
    """BF16 tensor of ``shape`` for HF tensor ``key`` with a realistic scale; float32 draw, BF16 round.
    ``std`` scales a weight (not a norm); the draw itself depends only on (seed, key, device)."""
    g = torch.Generator(device=device).manual_seed(_seed_for(seed, key))
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
        x = 1.0 + NORM_STD * x
    else:
        x = std * x
    return x.to(torch.bfloat16)


def tensor_plan(cfg: ModelConfig, expert_layout: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor in write order: embeddings, then per layer its non-routed
    tensors and its experts, then the final norm and lm_head (names and shapes from the adapter)."""
    a = cfg.adapter
    plan = list(a.head_tensors(cfg).values())
    for l in range(cfg.num_layers):
        layer = list(a.layer_tensors(cfg, l).values())
        if expert_layout == "fused" and l in a.routed_layers(cfg):  # transformers' in-memory names (Mixtral's router)
            layer = [(a.fused_layout_name(n), s) for n, s in layer]
        plan += layer
        plan += list(a.routed_expert_tensors(cfg, l, expert_layout).items())
    return plan + list(a.tail_tensors(cfg).values())


def _fused_expert_part(cfg: ModelConfig, name: str) -> tuple[int, str] | None:
    """(layer, "gate_up" | "down") when ``name`` is a fused-layout expert tensor, else None."""
    a = cfg.adapter
    for l in a.routed_layers(cfg):
        for part, fused in a.fused_expert_names(l).items():
            if fused == name:
                return l, part
    return None


@functools.lru_cache(maxsize=8)
def _fused_renames(cfg: ModelConfig) -> dict[str, str]:
    """Fused-layout name -> runmap's name for the non-routed tensors a family renames there (Mixtral's router)."""
    a = cfg.adapter
    return {a.fused_layout_name(n): n for n in a.nonrouted_tensors(cfg) if a.fused_layout_name(n) != n}


def _generate(cfg: ModelConfig, name: str, shape, seed: int, device, init: str = DEFAULT_INIT) -> torch.Tensor:
    """The BF16 CPU tensor for ``name``; fused expert tensors are assembled from per-expert draws."""
    fused = _fused_expert_part(cfg, name)
    if fused is None:  # drawn under runmap's name, so both layouts hold the same values
        std = embedding_std(cfg, init) if name == EMBED_NAME else WEIGHT_STD
        return _draw(seed, _fused_renames(cfg).get(name, name), shape, device, std).cpu()
    layer, part = fused
    key = lambda e, proj: cfg.adapter.expert_tensor_name(layer, e, proj)  # noqa: E731  the per-expert draw key
    i = cfg.moe_intermediate_size
    out = torch.empty(shape, dtype=torch.bfloat16)  # (E, 2I, H) or (E, H, I)
    for e in range(cfg.num_experts):
        if part == "gate_up":
            out[e, :i] = _draw(seed, key(e, "gate"), (i, shape[2]), device).cpu()
            out[e, i:] = _draw(seed, key(e, "up"), (i, shape[2]), device).cpu()
        else:
            out[e] = _draw(seed, key(e, "down"), tuple(shape[1:]), device).cpu()
    return out


def _shards(plan, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split of the plan into shards of at most shard_bytes (a tensor larger than that alone)."""
    shards, cur, size = [], [], 0
    for name, shape in plan:
        nbytes = 2 * int(torch.Size(shape).numel())
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


def write_synthetic(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    expert_layout: str = "per-expert",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: str = "cpu",
    tokenizer: bool = True,
    overwrite: bool = False,
    progress: bool = False,
    init: str = DEFAULT_INIT,
) -> Path:
    """Write a synthetic checkpoint of ``cfg`` to ``out_dir`` atomically (temp dir, then rename).

    Args:
        cfg: model dimensions (e.g. ``load_preset("tiny-olmoe")[0]``).
        seed: values depend only on (seed, tensor name, device).
        expert_layout: "per-expert" or "fused" (see runmap.format.checkpoint).
        shard_bytes: above this total, write shards + model.safetensors.index.json.
        device: where random numbers are drawn ("cpu" or "cuda"); part of the identity of the values.
        overwrite: replace an existing out_dir (still atomically).
        init: how the embeddings are scaled against the layers' outputs (INITS; recorded in config.json).
    Returns the output path.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    embedding_std(cfg, init)  # refuses an unknown init before anything is written
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass --force, overwrite=True, to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="." + out.name + ".tmp-", dir=out.parent))
    try:
        plan = tensor_plan(cfg, expert_layout)
        shards = _shards(plan, shard_bytes)
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        meta = {"format": "pt", "runmap_synthetic_seed": str(seed), "runmap_generator_device": device,
                "runmap_expert_layout": expert_layout}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(plan), desc=f"synth {out.name}", unit="tensor")
        weight_map, total = {}, 0
        for fname, shard in zip(names, shards):
            w = StreamingWriter(tmp / fname, [(n, torch.bfloat16, s) for n, s in shard], meta)
            try:
                for name, shape in shard:
                    w.write(name, _generate(cfg, name, shape, seed, device, init))
                    weight_map[name] = fname
                    total += 2 * int(torch.Size(shape).numel())
                    if bar:
                        bar.update(1)
                w.close()
            except BaseException:
                w.abort()
                raise
        if bar:
            bar.close()
        if len(shards) > 1:
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        hf = cfg.to_hf_dict()
        hf["runmap_synthetic"] = {"seed": seed, "expert_layout": expert_layout, "generator_device": device}
        if init != "hf":  # an "hf" checkpoint stays byte-identical to those written before inits existed
            hf["runmap_synthetic"]["init"] = init
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id),
                                 ("pad_token_id", cfg.pad_token_id)) if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer:
            write_tokenizer(cfg, tmp)
        os.chmod(tmp, 0o755)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
