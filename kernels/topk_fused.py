"""The ``topk-fused`` executor (decode): two launches per layer, GEMV-style (one activation row per program).

Launch 1, grid (T*k, I/BLOCK_N): program (p, n) computes gate and up of pair p = t*k + j for one tile of
the intermediate dimension (both weights stream through the same loop over H) and stores
h[p, n-tile] = fp16(silu(gate) * up).
Launch 2, grid (T, H/BLOCK_N): program (t, n) accumulates topk_weights[t, j] * (h[t*k + j] . Wd_e row) over
the k slots of token t in fp32 registers, then stores fp16 y[t, n-tile]. The gate-weighted sum is done in
registers in a fixed order: no atomics, no per-pair buffer, deterministic.
Repeated experts across tokens are read once per pair (this path has no grouping; see ``grouped``).

Three kernel families compute this, chosen by the config's KERNEL key (same quantized weights, FP32
accumulation; only the tiling and the order of the fp32 additions differ):
"words" (default, ``runmap.kernels.gemv_words``: weights and activations read as 32-bit words, fewest instructions
per weight byte), "blocks" (``runmap.kernels.gemv``: whole scale blocks per step, the k slots of the down launch as
one tile) and "tiles" (this module: K tiles of BLOCK_K values, the down launch one flat loop over (slot, K
tile)). A family whose shape or alignment needs a problem does not meet is replaced by the next one:
words -> blocks (needs K % 8 == 0 and 4-byte aligned rows, sections and activation rows) -> tiles (blocks
needs a power-of-two quantization block of at least 16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runmap.kernels import common
from runmap.kernels.core import _scale_tile, expert_row, gemv_tiles, nibbles_f32, silu_mul
from runmap.kernels.gemv import _pair_gate_up_kernel, _token_down_kernel
from runmap.kernels.gemv_words import _words_down_kernel, _words_gate_up_kernel
from runmap.format.qpack import RowLayout


@triton.jit
def _topk_gate_up_kernel(
    x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr,  # x (T, H) fp16, ids (T*k,), h (T*k, I) fp16
    n_experts, n_rows, row_bytes, stride_xm,
    gate_w, gate_s, up_w, up_s,
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr, GROUPS: tl.constexpr,
):
    pid_p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over I
    n_mask = offs_n < N
    w_row, s_row, ok = expert_row(tl.load(ids_ptr + pid_p), row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
    acc_g = tl.zeros((BLOCK_N,), tl.float32)
    acc_u = tl.zeros((BLOCK_N,), tl.float32)
    if ok:
        x_row = x_ptr + (pid_p // TOPK).to(tl.int64) * stride_xm
        acc_g, acc_u = gemv_tiles(acc_g, acc_u, x_row, w_row + gate_w, s_row + gate_s, w_row + up_w, s_row + up_s,
                                  offs_n, n_mask, K, NB, BLOCK_K, QBLOCK, TILE_SCALE, True, GROUPS)
    h = tl.where(ok, silu_mul(acc_g, acc_u), float("nan"))  # NaN marks a non-resident expert, never a substitute
    tl.store(h_ptr + pid_p.to(tl.int64) * N + offs_n, h.to(tl.float16), mask=n_mask)


@triton.jit
def _topk_down_kernel(
    h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr,  # h (T*k, I) fp16, wts (T*k,) fp32, y (T, H)
    n_experts, n_rows, row_bytes, stride_ym, down_w, down_s,
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr, GROUPS: tl.constexpr,
):
    # One flat loop over (slot j, K tile) so the load pipeline runs across the k experts of the token
    # instead of draining at every expert; the gate weight is folded into the per-row scale.
    HALF: tl.constexpr = BLOCK_K // 2
    KB: tl.constexpr = K // 2
    KT: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < N
    offs_j = tl.arange(0, HALF)
    part = tl.zeros((BLOCK_N, HALF), tl.float32)
    poison = tl.zeros((BLOCK_N,), tl.float32)  # becomes NaN if any slot's expert is not resident
    for it in range(TOPK * KT):
        p = t * TOPK + it // KT
        k0 = (it % KT) * BLOCK_K
        expert = tl.load(ids_ptr + p)
        gw = tl.load(wts_ptr + p)
        w_row, s_row, ok = expert_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        hk = tl.load(h_ptr + p.to(tl.int64) * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # (BK,)
        h_even, h_odd = tl.split(tl.reshape(hk, (HALF, 2)))  # (HALF,)
        offs_kb = k0 // 2 + offs_j
        wm = n_mask[:, None] & (offs_kb < KB)[None, :] & ok
        packed = tl.load(w_row + down_w + offs_n[:, None] * KB + offs_kb[None, :], mask=wm, other=0)
        lo, hi = nibbles_f32(packed)  # (BN, HALF)
        prod = lo * h_even[None, :] + hi * h_odd[None, :]
        s_base = s_row + down_s
        if TILE_SCALE:
            part += _scale_tile(prod * gw, s_base, offs_n, n_mask & ok, k0, NB, QBLOCK, GROUPS)
        else:
            s = tl.load(s_base + offs_n[:, None] * NB + (2 * offs_kb[None, :]) // QBLOCK, mask=wm, other=0.0)
            part += prod * (s.to(tl.float32) * gw)
        poison += tl.where(ok, 0.0, float("nan"))
    acc = tl.sum(part, axis=1) + poison
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + offs_n, acc.to(tl.float16), mask=n_mask)


MAGIC_F32 = 0x4B000000  # fp32 bit pattern of 2^23 (runmap.kernels.gemv_words._nibble)


def default_config(device: torch.device, n_pairs: int = 1, down_blocks: int = 4) -> dict:
    """KERNEL "words": runmap.kernels.gemv_words; "blocks": runmap.kernels.gemv (whole scale blocks, SUB per iteration,
    slots vectorized in the down launch); "tiles": the kernels of this module (K tiles of BLOCK_K values).
    BLOCK_N / SUB / num_warps (launch 1) and DOWN_* (launch 2) are the tile of the chosen family; DOWN_KERNEL
    (default KERNEL) picks the family of launch 2 on its own. ``n_pairs`` = T * k and ``down_blocks`` = the
    down projection's scale blocks per row (both static per shape, never read from data; only launch 2 reads
    the DOWN_* keys, so launch 1 may leave ``down_blocks`` at its default): few pairs want more warps per
    program and fewer dependent rounds of loads, many pairs more programs."""
    if common.interpreting(device):
        return {"KERNEL": "words", "BLOCK_N": 512, "BLOCK_K": 256, "SUB": 1,
                "DOWN_BLOCK_N": 512, "DOWN_BLOCK_K": 256, "DOWN_SUB": 1}
    # Best of the H200 sweeps (tools/explore/explore_decode.py, results/kernels/explore/h200-decode-words.json,
    # h200-decode-words-sub*.json): T = 1, 2 (8 / 4-8 pairs) and T = 8 (64 / 32 pairs) of OLMoE / Qwen1.5-MoE.
    # Few pairs: the down launch reads its whole row in one round of loads (DOWN_SUB = the blocks rounded up
    # to a power of two), the gate/up launch in two.
    if n_pairs <= 8:
        return {"KERNEL": "words", "BLOCK_N": 16, "SUB": 4, "num_warps": 8,
                "DOWN_BLOCK_N": 8, "DOWN_SUB": common.next_pow2(down_blocks), "DOWN_num_warps": 4,
                "BLOCK_K": 512, "DOWN_BLOCK_K": 1024}
    return {"KERNEL": "words", "BLOCK_N": 32, "SUB": 2, "num_warps": 4,
            "DOWN_BLOCK_N": 16, "DOWN_SUB": 2, "DOWN_num_warps": 2, "BLOCK_K": 512, "DOWN_BLOCK_K": 1024}


def _family(want: str, layout: RowLayout, k: int, w_offs: tuple[int, ...], storage: torch.Tensor,
            act: torch.Tensor) -> str:
    """The kernel family that runs: ``want``, or the next one down when the problem does not meet its needs
    (see the module docstring). ``w_offs``: byte offsets of every weight section the launch reads as words;
    ``act``: the activation it reads as rows of K."""
    q = layout.block_size
    blocks_ok = q >= 16 and q & (q - 1) == 0
    if want == "words" and blocks_ok and k % 8 == 0 and layout.row_bytes % 4 == 0 \
            and all(off % 4 == 0 for off in w_offs) \
            and storage.data_ptr() % 4 == 0 and act.data_ptr() % 4 == 0 and act.stride(0) % 2 == 0:
        return "words"
    return "blocks" if want in ("words", "blocks") and blocks_ok else "tiles"


def _even(k: int, n: int, nb: int, qblock: int, block_n: int, sub: int) -> bool:
    """Whether the "blocks" kernels may skip every mask: whole scale blocks, whole N tiles, whole SUB groups."""
    return k % qblock == 0 and n % block_n == 0 and nb % sub == 0


def _down_launch_opts(cfg: dict) -> dict:
    """The down launch may use its own warp count (DOWN_num_warps), else the config's."""
    opts = common.launch_opts(cfg)
    if "DOWN_num_warps" in cfg:
        opts["num_warps"] = cfg["DOWN_num_warps"]
    return opts


def _check_common(storage, layout, topk_ids, row_table):
    common.check_storage(storage, layout)
    dev = storage.device
    common.check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2, device=dev)
    common.check_tensor("row_table", row_table, torch.int32, 1, device=dev)
    if row_table.numel() < 1:
        raise common.KernelInputError("row_table: empty (no experts)")


def topk_gate_up(x, topk_ids, storage, row_table, layout: RowLayout, config: dict | None = None) -> torch.Tensor:
    """Launch 1: h[t*k + j] = fp16(silu(x[t] Wg_e^T) * (x[t] Wu_e^T)), e = topk_ids[t, j].

    Args:
        x: float16 (T, H) contiguous. topk_ids: int32/int64 (T, k) contiguous.
        storage: uint8 (R, row_bytes) contiguous. row_table: int32 (E,). layout: RowLayout.
    Returns:
        float16 (T*k, I).
    """
    _check_common(storage, layout, topk_ids, row_table)
    common.check_tensor("x", x, torch.float16, 2, shape=(topk_ids.shape[0], layout.hidden_size),
                        device=storage.device)
    t, k = topk_ids.shape
    cfg = dict(default_config(storage.device, t * k), **(config or {}))  # launch 1 reads no DOWN_* key
    g, u = common.proj_sections(layout, "gate"), common.proj_sections(layout, "up")
    h = common.empty((t * k, g.n), torch.float16, x.device)
    if t == 0:
        return h
    grid = (t * k, triton.cdiv(g.n, cfg["BLOCK_N"]))
    family = _family(cfg.get("KERNEL", "tiles"), layout, g.k, (g.w_off, u.w_off), storage, x)
    if family == "words":
        common.launch(_words_gate_up_kernel[grid],
            x, topk_ids, row_table, storage, storage.view(torch.float16), h,
            row_table.numel(), storage.shape[0], layout.row_bytes, x.stride(0),
            g.w_off, g.s_off, u.w_off, u.s_off, MAGIC_F32,
            N=g.n, K=g.k, NB=g.nb, QBLOCK=layout.block_size, TOPK=k,
            BLOCK_N=cfg["BLOCK_N"], SUB=cfg["SUB"],
            EVEN=_even(g.k, g.n, g.nb, layout.block_size, cfg["BLOCK_N"], cfg["SUB"]), **common.launch_opts(cfg),
            **common.chained(x.device),
        )
        return h
    if family == "blocks":
        common.launch(_pair_gate_up_kernel[grid],
            x, topk_ids, row_table, storage, storage.view(torch.float16), h,
            row_table.numel(), storage.shape[0], layout.row_bytes, x.stride(0),
            g.w_off, g.s_off, u.w_off, u.s_off,
            N=g.n, K=g.k, NB=g.nb, QBLOCK=layout.block_size, TOPK=k,
            BLOCK_N=cfg["BLOCK_N"], SUB=cfg["SUB"],
            EVEN=_even(g.k, g.n, g.nb, layout.block_size, cfg["BLOCK_N"], cfg["SUB"]), **common.launch_opts(cfg),
        )
        return h
    bk, groups, tile = common.gemv_block_k(cfg["BLOCK_K"], layout.block_size)
    common.launch(_topk_gate_up_kernel[grid],
        x, topk_ids, row_table, storage, storage.view(torch.float16), h,
        row_table.numel(), storage.shape[0], layout.row_bytes, x.stride(0),
        g.w_off, g.s_off, u.w_off, u.s_off,
        N=g.n, K=g.k, NB=g.nb, QBLOCK=layout.block_size, TOPK=k,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, TILE_SCALE=tile, GROUPS=groups, **common.launch_opts(cfg),
    )
    return h


def topk_down(h, topk_ids, topk_weights, storage, row_table, layout: RowLayout,
              config: dict | None = None) -> torch.Tensor:
    """Launch 2: y[t] = fp16(sum_j topk_weights[t, j] * (h[t*k + j] Wd_e^T)), j in order, fp32 sum.

    Args:
        h: float16 (T*k, I) contiguous (launch 1). topk_ids: int32/int64 (T, k). topk_weights: float32 (T, k).
        storage, row_table, layout: as in ``topk_gate_up``.
    Returns:
        float16 (T, H).
    """
    _check_common(storage, layout, topk_ids, row_table)
    dev = storage.device
    t, k = topk_ids.shape
    common.check_tensor("h", h, torch.float16, 2, shape=(t * k, layout.intermediate_size), device=dev)
    common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=(t, k), device=dev)
    d = common.proj_sections(layout, "down")
    cfg = dict(default_config(dev, t * k, d.nb), **(config or {}))
    y = common.empty((t, d.n), torch.float16, dev)
    if t == 0:
        return y
    grid = (t, triton.cdiv(d.n, cfg["DOWN_BLOCK_N"]))
    family = _family(cfg.get("DOWN_KERNEL", cfg.get("KERNEL", "tiles")), layout, d.k, (d.w_off,), storage, h)
    even = _even(d.k, d.n, d.nb, layout.block_size, cfg["DOWN_BLOCK_N"], cfg["DOWN_SUB"]) and k == common.next_pow2(k)
    if family == "words":
        common.launch(_words_down_kernel[grid],
            h, topk_ids, topk_weights, row_table, storage, storage.view(torch.float16), y,
            row_table.numel(), storage.shape[0], layout.row_bytes, y.stride(0), d.w_off, d.s_off, MAGIC_F32,
            N=d.n, K=d.k, NB=d.nb, QBLOCK=layout.block_size, TOPK=k, TOPK_P2=common.next_pow2(k),
            BLOCK_N=cfg["DOWN_BLOCK_N"], SUB=cfg["DOWN_SUB"], EVEN=even, **_down_launch_opts(cfg),
            **common.chained(dev),
        )
        return y
    if family == "blocks":
        common.launch(_token_down_kernel[grid],
            h, topk_ids, topk_weights, row_table, storage, storage.view(torch.float16), y,
            row_table.numel(), storage.shape[0], layout.row_bytes, y.stride(0), d.w_off, d.s_off,
            N=d.n, K=d.k, NB=d.nb, QBLOCK=layout.block_size, TOPK=k, TOPK_P2=common.next_pow2(k),
            BLOCK_N=cfg["DOWN_BLOCK_N"], SUB=cfg["DOWN_SUB"], EVEN=even, **_down_launch_opts(cfg),
        )
        return y
    bk, groups, tile = common.gemv_block_k(cfg["DOWN_BLOCK_K"], layout.block_size)
    common.launch(_topk_down_kernel[grid],
        h, topk_ids, topk_weights, row_table, storage, storage.view(torch.float16), y,
        row_table.numel(), storage.shape[0], layout.row_bytes, y.stride(0), d.w_off, d.s_off,
        N=d.n, K=d.k, NB=d.nb, QBLOCK=layout.block_size, TOPK=k,
        BLOCK_N=cfg["DOWN_BLOCK_N"], BLOCK_K=bk, TILE_SCALE=tile, GROUPS=groups, **_down_launch_opts(cfg),
    )
    return y


def topk_fused_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout,
                   config: dict | None = None) -> torch.Tensor:
    """Both launches. Arguments as ``runmap.kernels.executors.moe_experts``; returns float16 (T, H). No host sync."""
    h = topk_gate_up(x, topk_ids, storage, row_table, layout, config)
    return topk_down(h, topk_ids, topk_weights, storage, row_table, layout, config)
