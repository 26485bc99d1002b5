"""The ``reference`` executor: dequantize each routed expert to FP32 with runmap.format.qpack, matmul in FP32.

For checks only (slow, host-synchronizing). Nothing is rounded to fp16 until the final output, so it is
the higher-precision truth every Triton path is compared against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runmap.format.qpack import RowLayout


def reference_moe_f32(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, storage: torch.Tensor,
                      row_table: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Same arguments as ``runmap.kernels.executors.moe_experts``; returns float32 (T, H) (not rounded).

    Every routed id must map to a row (row_table[e] >= 0); callers validate first.
    """
    t, _k = topk_ids.shape
    out = torch.zeros(t, layout.hidden_size, dtype=torch.float32, device=x.device)  # (T, H)
    ids = topk_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # (n_e,), (n_e,)
        row = int(row_table[e])
        w = layout.dequantize_expert(storage[row])  # fp32 {"gate": (I, H), "up": (I, H), "down": (H, I)}
        xs = x[tok].to(torch.float32)  # (n_e, H)
        h = F.silu(xs @ w["gate"].T) * (xs @ w["up"].T)  # (n_e, I)
        d = h @ w["down"].T  # (n_e, H)
        out.index_add_(0, tok, d * topk_weights[tok, slot].to(torch.float32)[:, None])
    return out


def reference_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout) -> torch.Tensor:
    """The executor form: float16 (T, H)."""
    return reference_moe_f32(x, topk_ids, topk_weights, storage, row_table, layout).to(torch.float16)
