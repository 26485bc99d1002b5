"""Decode GEMV kernels of the ``topk-fused`` executor, organised around whole scale blocks.

Why a second GEMV formulation (``runmap.kernels.core.gemv_tiles`` is the first): at batch 1 a layer's expert
kernels are latency-bound, not bandwidth-bound. These kernels therefore

* walk K one scale block (QBLOCK values = QBLOCK/2 bytes per weight row) at a time, SUB blocks per loop
  iteration as independent loads, so that many bytes are in flight per program;
* read the activation's even / odd columns with two strided loads (no register reshape / split, which
  costs a shared-memory round trip per tile);
* apply one scale per (row, block) to the block's partial products, accumulated in (BN, QBLOCK/2) fp32
  registers and reduced across K once at the end;
* (down) hold all k slots of a token as a leading tensor dimension, so the k experts' weight tiles are
  loaded together instead of one expert after the other, and the gate-weighted sum over the slots is a
  fixed-order register reduction: no atomics, no per-pair buffer, deterministic.

Packed weights and scales as in ``runmap.kernels.core``: uint8 (N, K/2), byte j of a row = k 2j (low nibble) and
2j + 1 (high nibble), value q + 8; fp16 scales (N, NB), NB = ceil(K / QBLOCK). QBLOCK must be a power of
two (the wrappers check it); a partial last block is masked.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runmap.kernels.core import expert_row, nibbles_f32, slot_block_scales, store_pair_h, store_slot_sum, token_slots


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr,  # x (T, H) fp16, ids (T*k,), h (T*k, I) fp16
    n_experts, n_rows, row_bytes, stride_xm,
    gate_w, gate_s, up_w, up_s,  # section offsets inside a row (bytes / fp16 elements)
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr,
):
    """Program (p, n): h[p, n-tile] = fp16(silu(x[t] Wg^T) * (x[t] Wu^T)) for pair p = t*k + j."""
    HALF: tl.constexpr = QBLOCK // 2
    KB: tl.constexpr = K // 2
    pid_p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over I
    n_mask = offs_n < N
    offs_j = tl.arange(0, HALF)  # (HALF,) byte within a scale block
    w_row, s_row, ok = expert_row(tl.load(ids_ptr + pid_p), row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
    x_row = x_ptr + (pid_p // TOPK).to(tl.int64) * stride_xm
    g_ptrs = w_row + gate_w + offs_n[:, None] * KB + offs_j[None, :]  # (BN, HALF)
    u_ptrs = w_row + up_w + offs_n[:, None] * KB + offs_j[None, :]
    part_g = tl.zeros((BLOCK_N, HALF), tl.float32)
    part_u = tl.zeros((BLOCK_N, HALF), tl.float32)
    for b0 in range(0, NB, SUB):
        for u in tl.static_range(SUB):
            blk = b0 + u
            offs_kb = blk * HALF + offs_j  # (HALF,) byte index = k // 2
            if EVEN:  # no partial block, tile or SUB group: unmasked loads (a non-resident expert reads row 0)
                xe = tl.load(x_row + 2 * offs_kb).to(tl.float32)  # (HALF,) even k
                xo = tl.load(x_row + 2 * offs_kb + 1).to(tl.float32)  # (HALF,) odd k
                sg = tl.load(s_row + gate_s + offs_n * NB + blk).to(tl.float32)  # (BN,)
                su = tl.load(s_row + up_s + offs_n * NB + blk).to(tl.float32)
                pg = tl.load(g_ptrs + blk * HALF)  # (BN, HALF) uint8
                pu = tl.load(u_ptrs + blk * HALF)
            else:
                k_ok = offs_kb < KB
                wm = (n_mask & ok)[:, None] & k_ok[None, :]
                sm = n_mask & ok & (blk < NB)
                xe = tl.load(x_row + 2 * offs_kb, mask=k_ok, other=0.0).to(tl.float32)
                xo = tl.load(x_row + 2 * offs_kb + 1, mask=k_ok, other=0.0).to(tl.float32)
                sg = tl.load(s_row + gate_s + offs_n * NB + blk, mask=sm, other=0.0).to(tl.float32)
                su = tl.load(s_row + up_s + offs_n * NB + blk, mask=sm, other=0.0).to(tl.float32)
                pg = tl.load(g_ptrs + blk * HALF, mask=wm, other=0)
                pu = tl.load(u_ptrs + blk * HALF, mask=wm, other=0)
            lo, hi = nibbles_f32(pg)  # (BN, HALF) fp32
            part_g += (lo * xe[None, :] + hi * xo[None, :]) * sg[:, None]
            lo, hi = nibbles_f32(pu)
            part_u += (lo * xe[None, :] + hi * xo[None, :]) * su[:, None]
    store_pair_h(part_g, part_u, ok, h_ptr, pid_p, N, offs_n, n_mask)


@triton.jit
def _token_down_kernel(
    h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr,  # h (T*k, I) fp16, wts (T*k,) fp32, y (T, H) fp16
    n_experts, n_rows, row_bytes, stride_ym, down_w, down_s,
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr,
):
    """Program (t, n): y[t, n-tile] = fp16(sum_j wts[t, j] * (h[t*k + j] Wd_e^T)), the k slots as one
    (TOPK_P2, BN, QBLOCK/2) tile per scale block, summed over j in a fixed order."""
    HALF: tl.constexpr = QBLOCK // 2
    KB: tl.constexpr = K // 2
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < N
    offs_j = tl.arange(0, HALF)
    pairs, s_ok, w_row, s_row, ok, gw = token_slots(t, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, n_experts,
                                                    n_rows, row_bytes, TOPK, TOPK_P2)
    w_base = w_row + down_w  # (S,) uint8 pointers
    s_base = s_row + down_s  # (S,) fp16 pointers
    h_base = h_ptr + pairs.to(tl.int64) * K  # (S,)
    w_ptrs = w_base[:, None, None] + (offs_n * KB)[None, :, None] + offs_j[None, None, :]  # (S, BN, HALF)
    part = tl.zeros((TOPK_P2, BLOCK_N, HALF), tl.float32)
    for b0 in range(0, NB, SUB):
        for u in tl.static_range(SUB):
            blk = b0 + u
            offs_kb = blk * HALF + offs_j
            k_ok = offs_kb < KB
            if EVEN:  # k = TOPK_P2 slots, no partial block, tile or SUB group: unmasked loads
                he = tl.load(h_base[:, None] + 2 * offs_kb[None, :]).to(tl.float32)  # (S, HALF)
                ho = tl.load(h_base[:, None] + 2 * offs_kb[None, :] + 1).to(tl.float32)
            else:
                hm = ok[:, None] & k_ok[None, :]  # (S, HALF)
                he = tl.load(h_base[:, None] + 2 * offs_kb[None, :], mask=hm, other=0.0).to(tl.float32)
                ho = tl.load(h_base[:, None] + 2 * offs_kb[None, :] + 1, mask=hm, other=0.0).to(tl.float32)
            s, sm = slot_block_scales(s_base, offs_n, n_mask, ok, blk, NB, EVEN)  # (S, BN) each
            if EVEN:
                pw = tl.load(w_ptrs + blk * HALF)  # (S, BN, HALF) uint8
            else:
                pw = tl.load(w_ptrs + blk * HALF, mask=sm[:, :, None] & k_ok[None, None, :], other=0)
            lo, hi = nibbles_f32(pw)  # (S, BN, HALF) fp32
            part += (lo * he[:, None, :] + hi * ho[:, None, :]) * (s * gw[:, None])[:, :, None]
    store_slot_sum(part, s_ok, ok, y_ptr, t, stride_ym, offs_n, n_mask)
