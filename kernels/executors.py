"""The executor entry point ``moe_experts`` (interface: kernels/__init__.py docstring).

| executor     | launches per layer                                  | host sync          |
|--------------|-----------------------------------------------------|--------------------|
| reference    | torch, FP32 dequantize + matmul                     | yes                |
| scalar       | 3 W4A16 launches per distinct routed expert         | yes (host loop)    |
| grouped      | gate+up, down, k-sum (+ 3 sort launches, sorted runs)| no (validate=False)|
| topk-fused   | gate+up+SiLU·mul, down+weighted sum                 | no (validate=False)|

Numerics: FP16 activations in and out, FP32 accumulation, the intermediate silu(gate)*up rounded to fp16
(scalar also rounds gate and up to fp16, being one launch per projection).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runmap.kernels import common
from runmap.kernels.scalar import w4a16_linear
from runmap.format.qpack import RowLayout

from runmap.kernels.registry import EXECUTOR_NAMES, EXECUTORS


class NotResidentError(ValueError):
    """A routed expert has no resident row (row_table == -1): an error, never a substitution."""


@common.metadata_only
def check_inputs(x, topk_ids, topk_weights, storage, row_table, layout) -> None:
    """Metadata checks shared by every executor (no device sync)."""
    common.check_storage(storage, layout)
    dev = storage.device
    common.check_tensor("x", x, torch.float16, 2, shape=(None, layout.hidden_size), device=dev)
    common.check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2, shape=(x.shape[0], None), device=dev)
    common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=tuple(topk_ids.shape), device=dev)
    common.check_tensor("row_table", row_table, torch.int32, 1, device=dev)
    if row_table.numel() < 1:
        raise common.KernelInputError("row_table: empty (no experts)")
    if topk_ids.shape[1] < 1:
        raise common.KernelInputError("topk_ids: k = 0 experts per token")


def check_routing(topk_ids: torch.Tensor, row_table: torch.Tensor, n_rows: int) -> None:
    """Host check (synchronizes): every routed id is an expert, resident, and its row exists."""
    ids = topk_ids.detach().to("cpu", torch.int64)  # (T, k)
    table = row_table.detach().to("cpu", torch.int64)  # (E,)
    n_experts = table.numel()
    bad = (ids < 0) | (ids >= n_experts)
    if bad.any():
        t, j = (int(v) for v in bad.nonzero()[0])
        raise common.KernelInputError(f"topk_ids[{t}, {j}] = {int(ids[t, j])} is not an expert id in [0, {n_experts})")
    rows = table[ids]  # (T, k)
    missing = rows < 0
    if missing.any():
        t, j = (int(v) for v in missing.nonzero()[0])
        e = int(ids[t, j])
        raise NotResidentError(
            f"expert {e} (routed by token {t}, slot {j}) is not resident: row_table[{e}] = {int(table[e])}; "
            "a routed expert is never dropped or substituted")
    beyond = rows >= n_rows
    if beyond.any():
        t, j = (int(v) for v in beyond.nonzero()[0])
        e = int(ids[t, j])
        raise common.KernelInputError(f"row_table[{e}] = {int(table[e])} is outside storage rows [0, {n_rows})")


def scalar_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout, config=None) -> torch.Tensor:
    """One W4A16 launch per (distinct routed expert, projection) over the tokens that chose it."""
    out = torch.zeros(x.shape[0], layout.hidden_size, dtype=torch.float32, device=x.device)  # (T, H)
    ids = topk_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # (n_e,)
        row = int(row_table[e])
        if row < 0:  # reached only with validate=False; still never substitute
            raise NotResidentError(f"expert {e} is not resident: row_table[{e}] = {row}")
        xs = x[tok].contiguous()  # (n_e, H) fp16
        g = w4a16_linear(xs, storage, row, layout, "gate", config)  # (n_e, I) fp16
        u = w4a16_linear(xs, storage, row, layout, "up", config)
        h = (F.silu(g.float()) * u.float()).to(torch.float16)  # (n_e, I)
        d = w4a16_linear(h, storage, row, layout, "down", config)  # (n_e, H)
        out.index_add_(0, tok, d.float() * topk_weights[tok, slot][:, None])
    return out.to(torch.float16)


def moe_experts(executor: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                storage: torch.Tensor, row_table: torch.Tensor, layout: RowLayout, *, validate: bool = True,
                config: dict | None = None, host_rows: torch.Tensor | None = None, shared=None) -> torch.Tensor:
    """Routed-expert MoE output of one layer.

    Args:
        executor: a name of runmap.kernels.registry.EXECUTORS.
        x: float16 (T, H) contiguous. topk_ids: int32/int64 (T, k) contiguous, ids in [0, E).
        topk_weights: float32 (T, k) contiguous, final gate weights. storage: uint8 (R, row_bytes) contiguous.
        row_table: int32 (E,) contiguous; -1 = not resident. layout: runmap.format.qpack.RowLayout.
        validate: True checks on the host that every routed id is resident (NotResidentError naming the
            expert) -- this synchronizes. False skips it and never synchronizes for grouped/topk-fused
            (CUDA-graph capturable); a non-resident id then yields NaN rows, never another expert.
        config: optional tile override passed to the kernel wrappers (benchmarks).
        host_rows: the host-read site (grouped only): uint8 (n, row_bytes), on a GPU registered host memory mapped
            into the device's address space; row_table entries R .. R + n - 1 then name its rows, which the kernels
            read over the link. Needs validate=False (the host check knows device rows only).
        shared: a one-token shared expert (runmap.kernels.grouped.SharedExpert; grouped only) computed in the same
            launches and added to the result: fp16(routed + sigmoid(gate logit) * shared expert).
    Returns:
        float16 (T, H).
    """
    if executor not in EXECUTORS:
        raise common.KernelInputError(f"executor: {executor!r}, expected one of {EXECUTOR_NAMES}")
    check_inputs(x, topk_ids, topk_weights, storage, row_table, layout)
    if shared is not None and (executor != "grouped" or host_rows is not None):
        raise common.KernelInputError(f"shared: a shared expert rides in the grouped executor's device-row launches "
                                      f"only, not {executor!r}{' with host rows' if host_rows is not None else ''}")
    if host_rows is not None:
        if executor != "grouped":
            raise common.KernelInputError(f"host_rows: the host-read site runs on the grouped executor only, not "
                                          f"{executor!r}")
        if validate:
            raise common.KernelInputError("host_rows: needs validate=False (host rows are past the device rows the "
                                          "routing check knows)")
        return EXECUTORS[executor].load()(x, topk_ids, topk_weights, storage, row_table, layout, config,
                                          host_rows=host_rows)
    if validate or not EXECUTORS[executor].graph_safe:  # the host-synchronizing paths always check routing
        check_routing(topk_ids, row_table, storage.shape[0])
    if shared is not None:  # grouped (checked above)
        return EXECUTORS[executor].load()(x, topk_ids, topk_weights, storage, row_table, layout, config, shared=shared)
    return EXECUTORS[executor].load()(x, topk_ids, topk_weights, storage, row_table, layout, config)
