"""``--gpu-budget SIZE``: plan an engine's device memory, then the resident experts per layer that fit.

The plan counts what the engine allocates on the device, in this order:

1. the non-routed FP16 weights (the size of the pack's non-routed file; lm_head included);
2. the KV cache for ``max_batch`` rows of ``max_seq_len`` tokens (FP16 keys and values);
3. workspaces: the activations of the largest forward pass (a prefill chunk of ``prefill_chunk`` tokens per row:
   hidden states, fused q/k/v, the grouped executor's per-pair intermediates and, under full residency for a pass
   of at least ``DEQUANT_MIN_PAIRS`` pairs, every expert of a layer decoded to fp16, the last positions' FP32
   logits and their sampling copy) plus a fixed reserve for the CUDA graph pools, cuBLAS / Triton workspaces and the caching
   allocator's rounding (``FIXED_RESERVE``);
4. per layer, the row tables and, under partial residency, the spare rows that receive a miss group
   (the largest routed group, the engine's default ``max_group``); pinned staging lives in host memory and is
   reported beside the plan, not inside the budget;
5. then as many resident experts per layer as fit (all of them = full residency), with ``FRAGMENTATION_SHARE`` of
   the budget left free for the caching allocator's fragmentation.

A budget below the minimum (everything but experts, plus ``top_k`` resident experts and their spares per layer, plus
the fragmentation share) is refused with the numbers. The engine also caps torch's caching allocator at the budget
(``torch.cuda.set_per_process_memory_fraction``), so the reserved peak cannot exceed it: an estimate that is too
low ends in an out-of-memory error naming the budget, never in a larger footprint.
"""
from __future__ import annotations

import dataclasses
import re

# an engine built with a budget runs prefill passes of this many tokens per row unless told otherwise (the engine's
# default without one is 4,096): activations there compete with resident experts for the same bytes
PREFILL_CHUNK_UNDER_BUDGET = 1024
FIXED_RESERVE = 512 << 20  # CUDA graph pools, cuBLAS / Triton workspaces, allocator rounding (bytes)
# Held back from the budget for the caching allocator's fragmentation: blocks reserved but too small or too split for
# the next request. Without it, plans that counted every allocation still ran out under the cap on the H200
# (Qwen1.5-MoE 8 GiB batch 1: 7.77 GiB allocated, 0.24 GiB reserved but unusable, a 2 MiB request refused; 16 GiB
# batch 8: 15.63 GiB allocated, 0.26 GiB unusable, a 176 MiB request refused: results/residency/gpu-budget-h200-*.log)
FRAGMENTATION_SHARE = 0.05
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


class BudgetError(ValueError):
    """A size that does not parse, or a budget below the least the engine needs."""


def parse_size(text: str) -> int:
    """'6GiB' / '6G' (binary), '6.5GB' (decimal), '800MiB', '123456' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise BudgetError(f"{text!r} is not a size (examples: 6GiB, 6G, 6.5GB, 800MiB, 123456)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n <= 0:
        raise BudgetError(f"size {text!r} must be positive")
    return n


def size_argument(text: str) -> int:
    """argparse ``type=`` of ``--gpu-budget``."""
    import argparse

    try:
        return parse_size(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    budget: int
    nonrouted: int
    kv_cache: int
    workspace: int
    tables_and_spares: int
    experts: int  # resident expert rows, all layers
    resident: int  # experts per layer
    num_experts: int
    spares: int  # spare rows per layer
    staging_host: int  # pinned host staging (v1), outside the device budget

    @property
    def total(self) -> int:
        return self.nonrouted + self.kv_cache + self.workspace + self.tables_and_spares + self.experts

    @property
    def slack(self) -> int:
        """The part of the budget held back for the allocator's fragmentation (FRAGMENTATION_SHARE)."""
        return int(self.budget * FRAGMENTATION_SHARE)

    @property
    def regime(self) -> str:
        return "full" if self.resident == self.num_experts else "partial"

    def parts(self) -> str:
        return (f"non-routed {_gib(self.nonrouted)} + KV cache {_gib(self.kv_cache)} + workspaces "
                f"{_gib(self.workspace)} + row tables and {self.spares} spare rows/layer {_gib(self.tables_and_spares)}"
                f" + {self.resident} of {self.num_experts} experts/layer {_gib(self.experts)} = {_gib(self.total)}"
                f" + allocator slack {_gib(self.slack)}")

    def describe(self, device_type: str = "cuda") -> str:
        """The plan in one line; ``device_type`` "cpu": said to be the residency only (nothing caps a CPU device's
        memory; the plan counts what a GPU would hold)."""
        line = (f"gpu budget {_gib(self.budget)}: {self.parts()} ({self.regime} residency; pinned host staging "
                f"{_gib(self.staging_host)} outside the budget)")
        if device_type != "cuda":
            line += (f"; on the {device_type} device only its residency applies ({self.resident} of {self.num_experts}"
                     f" experts/layer): nothing caps memory there")
        return line

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "slack": self.slack, "regime": self.regime}


def _group(cfg, resident: int, max_batch: int) -> int:
    """The engine's default max_group (runmap/engine/engine.py from_pack)."""
    k, E = cfg.top_k, cfg.num_experts
    return min(k * max_batch, E) if resident == E else max(k, min(k * max_batch, resident // 2))


def plan(cfg, row_bytes: int, nonrouted_bytes: int, budget: int, *, max_batch: int, max_seq_len: int,
         prefill_chunk: int = PREFILL_CHUNK_UNDER_BUDGET, kv_rows: int | None = None) -> BudgetPlan:
    """The largest residency whose counted bytes fit ``budget`` (module docstring); BudgetError if none does.
    kv_rows: KV-cache rows when a caller keeps more than max_batch (counted instead of max_batch)."""
    L, E, k, H = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size
    kv = 2 * L * (kv_rows or max_batch) * cfg.num_kv_heads * max_seq_len * cfg.head_dim * 2
    t = min(prefill_chunk, max_seq_len) * max_batch  # tokens of the largest forward pass
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    inter = k * cfg.moe_intermediate_size + 2 * cfg.shared_expert_intermediate_size  # per token, fp16
    act = t * (6 * H * 2 + qkv * 2 + inter * 2 + k * H * 4 + 2 * E * 4) + 2 * max_batch * cfg.vocab_size * 4
    from runmap.kernels.grouped import DEQUANT_MIN_PAIRS

    # under full residency the grouped executor decodes a large pass's experts to fp16 once: (E, 3, H, I) fp16
    decoded = E * 3 * H * cfg.moe_intermediate_size * 2 if t * k >= DEQUANT_MIN_PAIRS else 0
    best = None
    for r in range(k, E + 1):
        workspace = act + FIXED_RESERVE + (decoded if r == E else 0)  # partial residency runs without that mode
        spares = 0 if r == E else _group(cfg, r, max_batch)
        tables = L * (spares * row_bytes + 2 * 4 * E)
        p = BudgetPlan(budget, nonrouted_bytes, kv, workspace, tables, L * r * row_bytes, r, E, spares,
                       _group(cfg, r, max_batch) * row_bytes)
        if p.total + p.slack <= budget:
            best = p
        elif best is None:
            raise BudgetError(f"--gpu-budget {_gib(budget)} is below the least this pack needs at batch {max_batch} and "
                              f"max_seq_len {max_seq_len}: {p.parts()}")
    return best


def plan_for_pack(pack_dir, budget: int, *, max_batch: int, max_seq_len: int | None,
                  prefill_chunk: int = PREFILL_CHUNK_UNDER_BUDGET, kv_rows: int | None = None) -> BudgetPlan:
    """``plan`` from a pack's manifest (no tensor is read)."""
    import json
    from pathlib import Path

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
    return plan(cfg, row_bytes, nonrouted, budget, max_batch=max_batch, max_seq_len=msl, prefill_chunk=prefill_chunk,
                kv_rows=kv_rows)
