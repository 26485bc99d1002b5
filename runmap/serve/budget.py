"""``--gpu-budget SIZE``: the most resident experts per layer whose device memory fits a budget.

What is counted (bytes the engine allocates on the device once, at startup): the non-routed FP16 weights
(the size of the pack's ``nonrouted.safetensors``), the KV cache (max_batch rows plus the server's one
scratch row for joining prompts, FP16 keys and values), and per layer ``resident + spares`` expert rows
with their row tables, spares being the largest routed group under partial residency (the engine's
default ``max_group``) and none under full residency. Activations, the CUDA-graph pools and the CUDA
context are not counted: leave headroom for them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


class BudgetError(ValueError):
    """A size that does not parse, or a budget no residency fits."""


def parse_size(text: str) -> int:
    """'6GiB', '6G' (binary), '6.5GB' (decimal), '800MiB', '123456' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise BudgetError(f"{text!r} is not a size (examples: 6GiB, 6G, 6.5GB, 800MiB, 123456)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n <= 0:
        raise BudgetError(f"size {text!r} must be positive")
    return n


def device_bytes(cfg, row_bytes: int, nonrouted_bytes: int, resident: int, max_batch: int, max_seq_len: int) -> dict:
    """The counted device bytes of an engine with ``resident`` experts per layer, by part."""
    E, k, L = cfg.num_experts, cfg.top_k, cfg.num_layers
    group = min(k * max_batch, E) if resident == E else max(k, min(k * max_batch, resident // 2))
    spares = 0 if resident == E else group
    kv = 2 * L * (max_batch + 1) * cfg.num_kv_heads * max_seq_len * cfg.head_dim * 2
    experts = L * ((resident + spares) * row_bytes + 2 * 4 * E)
    return {"nonrouted": nonrouted_bytes, "kv_cache": kv, "experts": experts,
            "total": nonrouted_bytes + kv + experts}


def resident_for_budget(pack_dir, budget: int, *, max_batch: int, max_seq_len: int | None) -> tuple[int, dict]:
    """(resident experts per layer, the counted bytes) for the largest residency within ``budget``."""
    from runmap.arch.config import ModelConfig

    pack_dir = Path(pack_dir)
    try:
        man = json.loads((pack_dir / "manifest.json").read_text())
        cfg = ModelConfig(**man["model"])
        row_bytes = int(man["row_layout"]["row_bytes"])
        nonrouted = int(man["nonrouted"]["file_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BudgetError(f"{pack_dir}: cannot read the pack's manifest for --gpu-budget ({type(e).__name__}: {e})") \
            from None
    msl = max_seq_len if max_seq_len is not None else min(cfg.max_position_embeddings, 4096)
    best = None
    for r in range(cfg.top_k, cfg.num_experts + 1):
        need = device_bytes(cfg, row_bytes, nonrouted, r, max_batch, msl)
        if need["total"] <= budget:
            best = (r, need)
    if best is None:
        need = device_bytes(cfg, row_bytes, nonrouted, cfg.top_k, max_batch, msl)
        raise BudgetError(f"--gpu-budget {budget / 2**30:.2f} GiB is below the least this pack needs at --max-batch "
                          f"{max_batch} and --max-seq-len {msl}: {need['total'] / 2**30:.2f} GiB (non-routed "
                          f"{need['nonrouted'] / 2**30:.2f}, KV cache {need['kv_cache'] / 2**30:.2f}, top_k="
                          f"{cfg.top_k} experts per layer {need['experts'] / 2**30:.2f})")
    return best
