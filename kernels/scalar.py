"""The ``scalar`` W4A16 kernel: y = x @ dequant(W)^T for ONE expert row and ONE projection.

The scalar executor launches it once per (expert, projection) over the activation rows that chose the
expert. Tensor cores (tl.dot) with BLOCK_M >= 16; rows beyond M are masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runmap.kernels import common
from runmap.kernels.core import dot_tiles
from runmap.format.qpack import PROJECTIONS, RowLayout


@triton.jit
def _w4a16_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,  # x fp16 (M, K); w_ptr uint8 storage; s_ptr fp16 view of it; y fp16 (M, N)
    M, N, stride_xm, stride_ym,
    w_off, s_off,  # absolute offsets of this expert's packed weight (bytes) and scales (fp16 elements)
    K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm  # (BM,) row pointers
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc, _unused = dot_tiles(acc, acc, x_rows, m_mask, w_ptr + w_off, s_ptr + s_off, w_ptr, s_ptr, offs_n, n_mask,
                         K, NB, BLOCK_K, QBLOCK, TILE_SCALE, False)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(tl.float16), mask=m_mask[:, None] & n_mask[None, :])


def default_config(m: int, device: torch.device) -> dict:
    if common.interpreting(device):
        return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 512, "BLOCK_K": 256}
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def w4a16_linear(x: torch.Tensor, storage: torch.Tensor, row: int, layout: RowLayout, proj: str,
                 config: dict | None = None) -> torch.Tensor:
    """One projection of one expert: y = x @ dequant(W_proj)^T, FP32 accumulation.

    Args:
        x: float16 (M, K) contiguous, K = the projection's input size (H for gate/up, I for down).
        storage: uint8 (R, row_bytes) contiguous qpacked rows, same device as x.
        row: python int in [0, R): the physical row holding the expert (already resolved by the caller).
        layout: runmap.format.qpack.RowLayout of the rows.
        proj: "gate", "up" or "down".
        config: optional tile override {BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages}.
    Returns:
        float16 (M, N), N = the projection's output size.
    """
    common.check_storage(storage, layout)
    if proj not in PROJECTIONS:
        raise common.KernelInputError(f"proj: {proj!r}, expected one of {PROJECTIONS}")
    sec = common.proj_sections(layout, proj)
    common.check_tensor("x", x, torch.float16, 2, shape=(None, sec.k), device=storage.device)
    if not isinstance(row, int) or not 0 <= row < storage.shape[0]:
        raise common.KernelInputError(f"row: {row!r} is not a row of storage (R={storage.shape[0]})")
    m = x.shape[0]
    y = common.empty((m, sec.n), torch.float16, x.device)
    if m == 0:
        return y
    cfg = dict(default_config(m, x.device), **(config or {}))
    bk = common.pick_block_k(cfg["BLOCK_K"], layout.block_size)
    row_base = row * layout.row_bytes
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(sec.n, cfg["BLOCK_N"]))
    common.launch(_w4a16_linear_kernel[grid],
        x, storage, storage.view(torch.float16), y,
        m, sec.n, x.stride(0), y.stride(0),
        row_base + sec.w_off, row_base // 2 + sec.s_off,
        K=sec.k, NB=sec.nb, QBLOCK=layout.block_size,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
        TILE_SCALE=common.tile_scale(bk, layout.block_size), **common.launch_opts(cfg),
    )
    return y
