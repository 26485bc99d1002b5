"""Decode GEMV kernels that read the packed weights as 32-bit words (``topk-fused``, KERNEL "words").

Why: at batch 1 the "blocks" GEMV (``runmap.kernels.gemv``) is bound by instruction issue, not by memory. Its
compiled inner loop spends ~14 instructions per weight byte: a byte extract, a sign extension, a shift and
three logic operations to decode each byte's two nibbles, two 16-bit activation loads and two fp16->fp32
conversions per byte, then the FMAs. These kernels cut that by working on whole 32-bit words:

* one word = 4 packed bytes = 8 weights (k = 8w .. 8w+7). A nibble at bit offset s (s <= 16) decodes with one
  logic operation and one FMA, no shift: ``(word & (15 << s)) | 0x4B000000`` is the fp32 2^23 + n * 2^s, so
  ``v * 2^-s - (2^(23-s) + 8)`` is exactly n - 8. The three nibbles above bit 19 come from ``word >> 12``.
* the activation is read as 32-bit words too: word j holds the fp16 pair (x[2j], x[2j+1]) that meets packed
  byte j, so one load serves both nibbles of a byte.
* a word's eight products are summed in registers, then scaled once (one FMA per word for the scale).

Layout and semantics as ``runmap.kernels.gemv`` (same arguments, same NaN for a non-resident expert, fixed-order
slot sum in the down launch); in addition K must be a multiple of 8 and every row / section / activation row
must start 4-byte aligned (the wrappers in ``runmap.kernels.topk_fused`` check this before choosing these kernels).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runmap.kernels.core import chain_wait, expert_row, slot_block_scales, store_pair_h, store_slot_sum, token_slots


@triton.jit
def _nibble(word, magic, SHIFT: tl.constexpr):
    """fp32 q = n - 8 of the nibble n at bits SHIFT .. SHIFT+3 of int32 ``word`` (SHIFT <= 16): exact.
    ``magic`` is 0x4B000000 passed at run time: as a register operand the mask-and-or is one LOP3 (with two
    immediates the compiler emits two)."""
    v = ((word & (15 << SHIFT)) | magic).to(tl.float32, bitcast=True)  # 2^23 + n * 2^SHIFT
    return v * (1.0 / (1 << SHIFT)) - (8388608.0 / (1 << SHIFT) + 8.0)


@triton.jit
def pair_f32(xw):
    """int32 word holding the fp16 pair (a, b) (a in the low half) -> (fp32 a, fp32 b)."""
    a = xw.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    b = (xw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return a, b


@triton.jit
def word_dot(w, magic, e0, o0, e1, o1, e2, o2, e3, o3):
    """sum over the 8 weights of int32 word ``w`` (byte i: low nibble k = 2i, high k = 2i + 1) times the
    activation: e_i / o_i are the fp32 activations of byte i's even / odd k (broadcastable to w)."""
    u = w >> 12  # bits 20..31 of w at 8..19 (sign bits above are masked off by _nibble)
    a = _nibble(w, magic, 0) * e0 + _nibble(w, magic, 4) * o0
    b = _nibble(w, magic, 8) * e1 + _nibble(w, magic, 12) * o1
    a += _nibble(w, magic, 16) * e2 + _nibble(u, magic, 8) * o2
    b += _nibble(u, magic, 12) * e3 + _nibble(u, magic, 16) * o3
    return a + b


@triton.jit
def _load_pairs(x32, offs_kw, mask, EVEN: tl.constexpr):
    """Activation pairs of weight words ``offs_kw``: x32 points at int32 pairs; word w's byte i meets pair
    4w + i. Returns eight fp32 tensors shaped like offs_kw (e0, o0, ..., e3, o3)."""
    if EVEN:
        w0 = tl.load(x32 + 4 * offs_kw)
        w1 = tl.load(x32 + 4 * offs_kw + 1)
        w2 = tl.load(x32 + 4 * offs_kw + 2)
        w3 = tl.load(x32 + 4 * offs_kw + 3)
    else:
        w0 = tl.load(x32 + 4 * offs_kw, mask=mask, other=0)
        w1 = tl.load(x32 + 4 * offs_kw + 1, mask=mask, other=0)
        w2 = tl.load(x32 + 4 * offs_kw + 2, mask=mask, other=0)
        w3 = tl.load(x32 + 4 * offs_kw + 3, mask=mask, other=0)
    e0, o0 = pair_f32(w0)
    e1, o1 = pair_f32(w1)
    e2, o2 = pair_f32(w2)
    e3, o3 = pair_f32(w3)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _words_gate_up_kernel(
    x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr,  # x (T, H) fp16, ids (T*k,), h (T*k, I) fp16
    n_experts, n_rows, row_bytes, stride_xm,
    gate_w, gate_s, up_w, up_s,  # section offsets inside a row (bytes / fp16 elements)
    magic,  # int32 0x4B000000 (see _nibble)
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr, CHAINED: tl.constexpr = False,
):
    """Program (p, n): h[p, n-tile] = fp16(silu(x[t] Wg^T) * (x[t] Wu^T)) for pair p = t*k + j."""
    chain_wait(CHAINED)
    WPB: tl.constexpr = QBLOCK // 8  # words per scale block of one weight row
    KW: tl.constexpr = K // 8  # words per weight row
    pid_p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over I
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPB)  # (WPB,) word within a scale block
    w_row, s_row, ok = expert_row(tl.load(ids_ptr + pid_p), row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
    x32 = (x_ptr + (pid_p // TOPK).to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int32))
    g_ptrs = (w_row + gate_w).to(tl.pointer_type(tl.int32)) + offs_n[:, None] * KW + offs_w[None, :]  # (BN, WPB)
    u_ptrs = (w_row + up_w).to(tl.pointer_type(tl.int32)) + offs_n[:, None] * KW + offs_w[None, :]
    part_g = tl.zeros((BLOCK_N, WPB), tl.float32)
    part_u = tl.zeros((BLOCK_N, WPB), tl.float32)
    for b0 in range(0, NB, SUB):
        for u in tl.static_range(SUB):
            blk = b0 + u
            offs_kw = blk * WPB + offs_w  # (WPB,) word index within the row
            k_ok = offs_kw < KW
            e0, o0, e1, o1, e2, o2, e3, o3 = _load_pairs(x32, offs_kw, k_ok, EVEN)
            if EVEN:  # no partial block, tile or SUB group: unmasked loads (a non-resident expert reads row 0)
                sg = tl.load(s_row + gate_s + offs_n * NB + blk).to(tl.float32)  # (BN,)
                su = tl.load(s_row + up_s + offs_n * NB + blk).to(tl.float32)
                wg = tl.load(g_ptrs + blk * WPB)  # (BN, WPB) int32
                wu = tl.load(u_ptrs + blk * WPB)
            else:
                wm = (n_mask & ok)[:, None] & k_ok[None, :]
                sm = n_mask & ok & (blk < NB)
                sg = tl.load(s_row + gate_s + offs_n * NB + blk, mask=sm, other=0.0).to(tl.float32)
                su = tl.load(s_row + up_s + offs_n * NB + blk, mask=sm, other=0.0).to(tl.float32)
                wg = tl.load(g_ptrs + blk * WPB, mask=wm, other=0)
                wu = tl.load(u_ptrs + blk * WPB, mask=wm, other=0)
            part_g += word_dot(wg, magic, e0[None, :], o0[None, :], e1[None, :], o1[None, :],
                               e2[None, :], o2[None, :], e3[None, :], o3[None, :]) * sg[:, None]
            part_u += word_dot(wu, magic, e0[None, :], o0[None, :], e1[None, :], o1[None, :],
                               e2[None, :], o2[None, :], e3[None, :], o3[None, :]) * su[:, None]
    store_pair_h(part_g, part_u, ok, h_ptr, pid_p, N, offs_n, n_mask)


@triton.jit
def _words_down_kernel(
    h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr,  # h (T*k, I) fp16, wts (T*k,) fp32, y (T, H) fp16
    n_experts, n_rows, row_bytes, stride_ym, down_w, down_s, magic,
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr, CHAINED: tl.constexpr = False,
):
    """Program (t, n): y[t, n-tile] = fp16(sum_j wts[t, j] * (h[t*k + j] Wd_e^T)), the k slots as one
    (TOPK_P2, BN, QBLOCK/8) tile of words per scale block, summed over j in a fixed order."""
    chain_wait(CHAINED)
    WPB: tl.constexpr = QBLOCK // 8
    KW: tl.constexpr = K // 8
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPB)
    pairs, s_ok, w_row, s_row, ok, gw = token_slots(t, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, n_experts,
                                                    n_rows, row_bytes, TOPK, TOPK_P2)
    w_base = (w_row + down_w).to(tl.pointer_type(tl.int32))  # (S,) int32 pointers
    s_base = s_row + down_s  # (S,) fp16 pointers
    h32 = (h_ptr + pairs.to(tl.int64) * K).to(tl.pointer_type(tl.int32))  # (S,) int32 pair pointers
    w_ptrs = w_base[:, None, None] + (offs_n * KW)[None, :, None] + offs_w[None, None, :]  # (S, BN, WPB)
    part = tl.zeros((TOPK_P2, BLOCK_N, WPB), tl.float32)
    for b0 in range(0, NB, SUB):
        for u in tl.static_range(SUB):
            blk = b0 + u
            offs_kw = blk * WPB + offs_w  # (WPB,)
            k_ok = offs_kw < KW
            hm = ok[:, None] & k_ok[None, :]  # (S, WPB)
            e0, o0, e1, o1, e2, o2, e3, o3 = _load_pairs(h32[:, None], offs_kw[None, :], hm, EVEN)  # (S, WPB)
            s, sm = slot_block_scales(s_base, offs_n, n_mask, ok, blk, NB, EVEN)  # (S, BN) each
            if EVEN:  # k = TOPK_P2 slots, no partial block, tile or SUB group: unmasked loads
                pw = tl.load(w_ptrs + blk * WPB)  # (S, BN, WPB) int32
            else:
                pw = tl.load(w_ptrs + blk * WPB, mask=sm[:, :, None] & k_ok[None, None, :], other=0)
            part += word_dot(pw, magic, e0[:, None, :], o0[:, None, :], e1[:, None, :], o1[:, None, :],
                             e2[:, None, :], o2[:, None, :], e3[:, None, :], o3[:, None, :]) * (s * gw[:, None])[:, :, None]
    store_slot_sum(part, s_ok, ok, y_ptr, t, stride_ym, offs_n, n_mask)
