"""The ``grouped`` executor: one launch per stage for every (token, expert) pair of a layer.

Pairs are numbered p = t * k + j (token t, slot j of topk_ids). Each program serves one expert and a
group of up to BLOCK_M pairs routed to it, so an expert's weight tile is read once per group, and reads
the expert's physical row from ``row_table`` (full and partial residency alike).

Two ways of forming the groups, chosen from the static pair count P = T * k (never from data):

* decode (P <= DECODE_MAX_PAIRS, unless the config asks for SORTED runs, as ``default_config`` does on a GPU past
  DECODE_FORM_MAX_PAIRS): no host-side preparation. Program p owns expert ids[p] if p is its
  first occurrence; it finds the other pairs of that expert by comparing all P ids in registers
  (rank = prefix count) and processes them in chunks of BLOCK_M. Programs of repeated ids do nothing.
* prefill: pairs are sorted by expert with a three-launch Triton counting sort (``sort_pairs``, no host
  sync) into per-expert runs padded to BLOCK_M ("order", -1 = padding), sized for the worst case so nothing
  depends on the data. One program per BLOCK_M slots; empty blocks do nothing.

Stages: (1) gate and up (two dots sharing each activation tile), h = fp16(silu(gate) * up), stored per
pair; (2) down, times the pair's gate weight, stored per pair in fp32; (3) a fixed-order sum over the k
slots of each token into fp16 y. No atomics, so the result is bit-for-bit deterministic.

Large passes (P >= DEQUANT_MIN_PAIRS, a static count): each weight tile is decoded once per pass instead of
once per BLOCK_M pairs. ``dequantize_sections`` writes every expert's three sections as fp16 (E, N, K)
(w = fp16(q * scale), the values the per-element-scale path of the INT4 loop multiplies), then stages (1) and
(2) are plain fp16 grouped GEMMs over the same sorted runs. In the INT4 loop the nibble decoding, not the
tensor cores, bounds a tile at prefill (~200 TFLOP/s on the H200 at 1,024-8,192 tokens,
results/campaigns/h200-floor); decoded once, 64 experts x 6 M values of OLMoE are 0.8 GB of fp16 written and
read per layer, ~0.4 ms, and the fp16 GEMMs then run at 340-430 TFLOP/s. The workspace is that size
(E x 3 x H x I x 2 bytes), so the mode is for large passes only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runmap.kernels import common
from runmap.kernels.core import (chain_wait, dot_tiles, expert_row, expert_site_row, gated_shared_down, gemv_row_sums,
                                 nibbles_f16, prefetch_l2, resolve_row, silu_mul)
from runmap.format.qpack import RowLayout

DECODE_MAX_PAIRS = 128
# pairs up to which ``default_config`` keeps the decode form on a GPU; from there to DECODE_MAX_PAIRS it asks for the
# sorted runs (config SORTED). Measured at 32 pairs (decode form faster) and 64 (sorted faster); between them untested
DECODE_FORM_MAX_PAIRS = 32
# pairs from which a pass decodes the weights once (see the module docstring): 4,096 tokens at top-8. On the H200
# (OLMoE) the decoded mode took 3.34 ms a layer at 8,192 tokens against 4.32 ms, but 1.09 against 0.97 ms at 2,048
# (results/campaigns/h200-floor/probe-0fd2581)
DEQUANT_MIN_PAIRS = 32768
# upper pair counts of the three narrow-row tiles of sorted passes (``default_config``): OLMoE's 32 / 128 / 256 tokens
SMALL_SORTED_PAIRS = (256, 1024, 2048)


@triton.jit
def _gate_up_group(pairs, lane_ok, expert, x_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, n_experts, n_rows, row_bytes,
                   host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, offs_n, n_mask,
                   N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
                   DEQ_ASM: tl.constexpr, SCALE_COLS: tl.constexpr):
    """h[pairs] = fp16(silu(x Wg^T) * (x Wu^T)) for up to BLOCK_M pairs routed to ``expert``."""
    w_row, s_row, ok = expert_site_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes, host_off,
                                       n_host_rows)
    x_rows = x_ptr + (pairs // TOPK).to(tl.int64) * stride_xm  # (BM,) token rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_g, acc_u = dot_tiles(acc_g, acc_u, x_rows, lane_ok & ok, w_row + gate_w, s_row + gate_s,
                             w_row + up_w, s_row + up_s, offs_n, n_mask, K, NB, BLOCK_K, QBLOCK, TILE_SCALE, True,
                             DEQ_ASM, SCALE_COLS)
    h = tl.where(ok, silu_mul(acc_g, acc_u), float("nan"))  # (BM, BN); NaN marks a non-resident expert
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(tl.float16), mask=lane_ok[:, None] & n_mask[None, :])


@triton.jit
def _down_group(pairs, lane_ok, expert, h_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr, n_experts, n_rows,
                row_bytes, host_off, n_host_rows, down_w, down_s, offs_n, n_mask,
                N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
                DEQ_ASM: tl.constexpr, SCALE_COLS: tl.constexpr):
    """ypair[pairs] = gate weight * (h Wd^T) in fp32 for up to BLOCK_M pairs routed to ``expert``."""
    w_row, s_row, ok = expert_site_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes, host_off,
                                       n_host_rows)
    h_rows = h_ptr + pairs.to(tl.int64) * K  # (BM,) rows of h
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc, acc_unused = dot_tiles(acc, acc, h_rows, lane_ok & ok, w_row + down_w, s_row + down_s, w_ptr, s_ptr,
                                offs_n, n_mask,
                                K, NB, BLOCK_K, QBLOCK, TILE_SCALE, False, DEQ_ASM, SCALE_COLS)
    gw = tl.load(wts_ptr + pairs, mask=lane_ok, other=0.0)  # (BM,) fp32 gate weights
    out = tl.where(ok, acc * gw[:, None], float("nan"))
    y_ptrs = ypair_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, out, mask=lane_ok[:, None] & n_mask[None, :])


@triton.jit
def _sorted_group(order_ptr, ids_ptr, pid0, BLOCK_M: tl.constexpr):
    """Prefill: (pairs (BM,), lane_ok (BM,), expert, active) of padded block ``pid0`` of ``order``."""
    pairs = tl.load(order_ptr + pid0 * BLOCK_M + tl.arange(0, BLOCK_M))  # order holds n_blocks * BLOCK_M slots
    first = tl.load(order_ptr + pid0 * BLOCK_M)  # a used block always starts with a real pair
    expert = tl.load(ids_ptr + tl.maximum(first, 0), mask=first >= 0, other=-1)
    return tl.maximum(pairs, 0), pairs >= 0, expert, first >= 0


@triton.jit
def _match_group(ids_ptr, pid0, P, P_PAD: tl.constexpr):
    """Decode: the pairs routed to the same expert as pair ``pid0``, found by comparing all ids.

    Returns (expert, match (P_PAD,) bool, rank (P_PAD,) position within the group, count, owner) where
    owner is True only for the group's first pair, so each expert is computed by exactly one program.
    """
    offs_p = tl.arange(0, P_PAD)
    expert = tl.load(ids_ptr + pid0)
    all_ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1)  # (P_PAD,)
    match = (all_ids == expert) & (offs_p < P)
    earlier = tl.sum((match & (offs_p < pid0)).to(tl.int32), axis=0)
    count = tl.sum(match.to(tl.int32), axis=0)
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    return expert, match, rank, count, earlier == 0


@triton.jit
def _chunk_pairs(match, rank, count, c0, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pairs ranked c0 .. c0+BLOCK_M-1 of a decode group: (pairs (BM,), lane_ok (BM,))."""
    want = c0 + tl.arange(0, BLOCK_M)  # (BM,)
    sel = match[None, :] & (rank[None, :] == want[:, None])  # (BM, P_PAD), at most one True per lane
    pairs = tl.sum(tl.where(sel, tl.arange(0, P_PAD)[None, :], 0), axis=1)  # (BM,)
    return pairs, want < count


@triton.jit
def _shared_gemv_rows(q, w, sx_ptr, sw_ptr, sgu_ptr, S_N, S_K: tl.constexpr, S_BLOCK_N: tl.constexpr,
                      S_BLOCK_K: tl.constexpr):
    """Program ``q`` of a one-token shared expert's first GEMV riding in the gate/up launch (``grouped_moe``'s
    ``shared``), after the chain's wait: sgu[n] = fp16(sum_k sx[k] sw[n, k]) for S_BLOCK_N rows n of gate | up | the
    shared expert gate's row (``core.gemv_row_sums``, as ``fused_ops._gemv_kernel``). w: its first K chunk
    (S_BLOCK_N, S_BLOCK_K), which the kernel read before the wait."""
    offs_n = q * S_BLOCK_N + tl.arange(0, S_BLOCK_N)  # (SBN,)
    n_mask = offs_n < S_N
    sums = gemv_row_sums(w, sx_ptr, sw_ptr + offs_n.to(tl.int64)[:, None] * S_K, n_mask, S_K, S_BLOCK_K)
    tl.store(sgu_ptr + offs_n, sums.to(tl.float16), mask=n_mask)


@triton.jit
def _shared_down_rows(q, sgu_ptr, sd_ptr, gs_ptr, S_H, S_I: tl.constexpr, S_BLOCK_N: tl.constexpr,
                      S_BLOCK_K: tl.constexpr):
    """Program ``q`` of a one-token shared expert's down projection riding in the down launch (after the chain's
    wait): gs[n] = sigmoid(gate logit) * fp16(sum_k a[k] sd[n, k]) in fp32 (``core.gated_shared_down``, as
    ``fused_ops._shared_down_kernel``; the sum with the routed output is the k-slot sum's)."""
    offs_n = q * S_BLOCK_N + tl.arange(0, S_BLOCK_N)  # (SBN,) over H
    n_mask = offs_n < S_H
    tl.store(gs_ptr + offs_n, gated_shared_down(sgu_ptr, sd_ptr, offs_n, n_mask, S_I, S_BLOCK_K), mask=n_mask)


# do_not_specialize: the pair count P (and the sort's chunk count) changes with every prompt length; Triton would
# otherwise compile a variant per "== 1" / "% 16 == 0" class of it inside a request (a stall of seconds in a server)
@triton.jit(do_not_specialize=["P", "n_host_rows"])  # host_off: specialized (a multiple of 16: aligned loads)
def _grouped_gate_up_kernel(
    x_ptr, ids_ptr, order_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr,  # x (T, H) fp16, h (P, I) fp16
    P, n_experts, n_rows, row_bytes, host_off, n_host_rows, stride_xm,  # host_*: the host-read site (expert_site_row)
    gate_w, gate_s, up_w, up_s,  # section offsets inside a row (bytes / fp16 elements)
    sx_ptr, sw_ptr, sgu_ptr, S_N,  # SHARED: a one-token shared expert's x (H,), gate|up|gate-row (S_N, H), out (S_N,)
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    SORTED: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
    DEQ_ASM: tl.constexpr, CHAINED: tl.constexpr = False, SCALE_COLS: tl.constexpr = 0,
    SHARED: tl.constexpr = False, S_BLOCK_N: tl.constexpr = 16, S_BLOCK_K: tl.constexpr = 512,
):
    pid0, pid1 = tl.program_id(0), tl.program_id(1)
    if SHARED:
        # decode form only, grid (P + extra, column tiles): the first P x tiles programs in launch order (dimension 0
        # fastest) are the pairs', so they start first; the rest compute the shared expert's GEMV
        lin = pid0 + tl.num_programs(0) * pid1
        n_pair_programs = P * tl.num_programs(1)
        q = lin - n_pair_programs  # < 0 for a pair's program
        offs_sn = q * S_BLOCK_N + tl.arange(0, S_BLOCK_N)  # (SBN,) rows of gate | up | gate row
        offs_sk = tl.arange(0, S_BLOCK_K)
        s_ok = (q >= 0) & (offs_sn < S_N)
        w0 = tl.load(sw_ptr + offs_sn.to(tl.int64)[:, None] * K + offs_sk[None, :],
                     mask=s_ok[:, None] & (offs_sk < K)[None, :], other=0.0)  # its first K chunk, before the wait
    chain_wait(CHAINED)
    if SHARED:
        if q >= 0:
            _shared_gemv_rows(q, w0, sx_ptr, sw_ptr, sgu_ptr, S_N, K, S_BLOCK_N, S_BLOCK_K)
        else:
            _gate_up_programs(x_ptr, ids_ptr, order_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, P, n_experts, n_rows,
                              row_bytes, host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, lin % P, lin // P,
                              N, K, NB, QBLOCK, TOPK, SORTED, P_PAD, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM,
                              SCALE_COLS)
    else:
        _gate_up_programs(x_ptr, ids_ptr, order_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, P, n_experts, n_rows,
                          row_bytes, host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, pid0, pid1,
                          N, K, NB, QBLOCK, TOPK, SORTED, P_PAD, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM,
                          SCALE_COLS)


@triton.jit
def _gate_up_programs(x_ptr, ids_ptr, order_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, P, n_experts, n_rows, row_bytes,
                      host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, pid0, pid1,
                      N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
                      SORTED: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr, DEQ_ASM: tl.constexpr,
                      SCALE_COLS: tl.constexpr):
    """The gate/up launch's program (``pid0``, column tile ``pid1``) of the routed pairs (sorted runs or the decode
    form), after the chain's wait."""
    offs_n = pid1 * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over I
    n_mask = offs_n < N
    if SORTED:
        pairs, lane_ok, expert, active = _sorted_group(order_ptr, ids_ptr, pid0, BLOCK_M)
        if active:
            _gate_up_group(pairs, lane_ok, expert, x_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, n_experts, n_rows,
                           row_bytes, host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, offs_n, n_mask,
                           N, K, NB, QBLOCK, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)
    else:
        expert, match, rank, count, owner = _match_group(ids_ptr, pid0, P, P_PAD)
        for c0 in range(0, P_PAD, BLOCK_M):
            if owner & (c0 < count):
                pairs, lane_ok = _chunk_pairs(match, rank, count, c0, P_PAD, BLOCK_M)
                _gate_up_group(pairs, lane_ok, expert, x_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, n_experts,
                               n_rows, row_bytes, host_off, n_host_rows, stride_xm, gate_w, gate_s, up_w, up_s, offs_n, n_mask,
                               N, K, NB, QBLOCK, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)


@triton.jit(do_not_specialize=["P", "n_host_rows"])  # host_off: specialized (a multiple of 16: aligned loads)
def _grouped_down_kernel(
    h_ptr, ids_ptr, order_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr,  # h (P, I) fp16, ypair (P, H) fp32
    P, n_experts, n_rows, row_bytes, host_off, n_host_rows, down_w, down_s,
    sgu_ptr, sd_ptr, gs_ptr,  # SHARED: the gate/up launch's g|u|gate logit (2 S_I + 1,) fp16, down (N, S_I), gs (N,) fp32
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
    SORTED: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr,
    DEQ_ASM: tl.constexpr, CHAINED: tl.constexpr = False, PF_LINES: tl.constexpr = 1, SCALE_COLS: tl.constexpr = 0,
    SHARED: tl.constexpr = False, S_I: tl.constexpr = 1, S_BLOCK_N: tl.constexpr = 4, S_BLOCK_K: tl.constexpr = 512,
):
    pid0, pid1 = tl.program_id(0), tl.program_id(1)
    if SHARED:  # decode form only: the first P x tiles programs in launch order are the pairs' (as in gate/up)
        lin = pid0 + tl.num_programs(0) * pid1
        q = lin - P * tl.num_programs(1)  # >= 0: a program of the shared expert's down projection
        pid0, pid1 = tl.where(q < 0, lin % P, 0), tl.where(q < 0, lin // P, 0)
    if CHAINED and not SORTED:
        # a decode step: while the gate/up launch still runs, pull this program's rows of its pair's down weights
        # into L2. The route was written two launches back (complete once the gate/up launch passed its wait, which
        # is before this launch could start); and a prefetch is only a hint, so even a stale id would cost
        # bandwidth, never a value (the row is resolved again below, after the wait).
        # (a host-read row's lines are pulled over the link early: a hint like any other)
        w_row, _s_row, _ok = expert_site_row(tl.load(ids_ptr + pid0), row_table_ptr, w_ptr, s_ptr, n_experts, n_rows,
                                             row_bytes, host_off, n_host_rows)
        n0 = pid1 * BLOCK_N
        span = tl.minimum(BLOCK_N, N - n0) * (K // 2)  # bytes of this program's rows: contiguous, K / 2 each
        if SHARED:
            span = tl.where(q < 0, span, 1)  # a program of the shared expert: one line, nothing to pull
        first = w_row + down_w + n0.to(tl.int64) * (K // 2)
        prefetch_l2(first + tl.minimum(tl.arange(0, PF_LINES) * 128, span - 1))  # PF_LINES >= span / 128
    chain_wait(CHAINED)
    if SHARED:
        if q >= 0:
            _shared_down_rows(q, sgu_ptr, sd_ptr, gs_ptr, N, S_I, S_BLOCK_N, S_BLOCK_K)
        else:
            _down_programs(h_ptr, ids_ptr, order_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr, P, n_experts,
                           n_rows, row_bytes, host_off, n_host_rows, down_w, down_s, pid0, pid1, N, K, NB, QBLOCK,
                           SORTED, P_PAD, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)
    else:
        _down_programs(h_ptr, ids_ptr, order_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr, P, n_experts,
                       n_rows, row_bytes, host_off, n_host_rows, down_w, down_s, pid0, pid1, N, K, NB, QBLOCK, SORTED,
                       P_PAD, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)


@triton.jit
def _down_programs(h_ptr, ids_ptr, order_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr, P, n_experts, n_rows,
                   row_bytes, host_off, n_host_rows, down_w, down_s, pid0, pid1,
                   N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, SORTED: tl.constexpr,
                   P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   TILE_SCALE: tl.constexpr, DEQ_ASM: tl.constexpr, SCALE_COLS: tl.constexpr):
    """The down launch's program (``pid0``, column tile ``pid1``) of the routed pairs (sorted runs or the decode form),
    after the chain's wait."""
    offs_n = pid1 * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < N
    if SORTED:
        pairs, lane_ok, expert, active = _sorted_group(order_ptr, ids_ptr, pid0, BLOCK_M)
        if active:
            _down_group(pairs, lane_ok, expert, h_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr, n_experts,
                        n_rows, row_bytes, host_off, n_host_rows, down_w, down_s, offs_n, n_mask,
                        N, K, NB, QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)
    else:
        expert, match, rank, count, owner = _match_group(ids_ptr, pid0, P, P_PAD)
        for c0 in range(0, P_PAD, BLOCK_M):
            if owner & (c0 < count):
                pairs, lane_ok = _chunk_pairs(match, rank, count, c0, P_PAD, BLOCK_M)
                _down_group(pairs, lane_ok, expert, h_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, ypair_ptr,
                            n_experts, n_rows, row_bytes, host_off, n_host_rows, down_w, down_s, offs_n, n_mask,
                            N, K, NB, QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, TILE_SCALE, DEQ_ASM, SCALE_COLS)


@triton.jit
def _sum_topk_kernel(ypair_ptr, y_ptr, gs_ptr, H, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                     CHAINED: tl.constexpr = False, SHARED: tl.constexpr = False):
    """y[t] = fp16(sum_j ypair[t * TOPK + j]), j ascending (fixed order: deterministic). SHARED (one token): then
    y = fp16(y + gs), gs the shared expert's gated output in fp32 (the down launch's), as fused_ops'
    ``_shared_down_kernel`` adds it to the routed output."""
    chain_wait(CHAINED)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(TOPK):
        acc += tl.load(ypair_ptr + (t * TOPK + j) * H + offs_n, mask=n_mask, other=0.0)
    if SHARED:
        acc = acc.to(tl.float16).to(tl.float32) + tl.load(gs_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + t * H + offs_n, acc.to(tl.float16), mask=n_mask)


@triton.jit
def _dequant_section_kernel(row_table_ptr, w_ptr, s_ptr, out_ptr, n_experts, n_rows, row_bytes, w_off, s_off,
                            N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, n, k] = fp16(q[n, k] * scale[n, k // QBLOCK]) of expert e's section. An expert without a resident
    row is skipped (its slice is left as it was): the GEMMs check the row table themselves and give its pairs
    NaN, and under partial residency most experts of a lease's table are absent."""
    e = tl.program_id(0)
    w_row, s_row, ok = expert_row(e, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
    if ok:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        HALF: tl.constexpr = BLOCK_K // 2
        offs_j = tl.program_id(2) * HALF + tl.arange(0, HALF)  # (HALF,) byte index k // 2
        m = (offs_n < N)[:, None] & (offs_j < K // 2)[None, :]  # (BN, HALF)
        packed = tl.load(w_row + w_off + offs_n[:, None] * (K // 2) + offs_j[None, :], mask=m, other=0)
        lo, hi = nibbles_f16(packed)  # (BN, HALF) fp16 each
        s = tl.load(s_row + s_off + offs_n[:, None] * NB + (2 * offs_j[None, :]) // QBLOCK, mask=m, other=0.0)
        w = tl.reshape(tl.join(lo * s, hi * s), (BLOCK_N, BLOCK_K))  # (BN, BK): columns 2j, 2j + 1 interleaved
        offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        out = out_ptr + e.to(tl.int64) * N * K + offs_n[:, None] * K + offs_k[None, :]
        tl.store(out, w, mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


@triton.jit
def _f16_dot(acc, a_rows, a_mask, w_base, offs_n, n_mask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc (BM, BN) fp32 += A[rows, :K] @ W[offs_n, :K]^T; a_rows (BM,) pointers to fp16 rows, W fp16 (N, K)."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows[:, None] + offs_k[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * K + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # (BK, BN)
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _decoded_group(order_ptr, ids_ptr, row_table_ptr, n_experts, n_rows, N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """A decoded-mode program's block: (offs_n, n_mask, pairs, lane_ok, active, ok, e) where ok is False for the run
    of invalid ids and for an expert without a resident row (its pairs get NaN) and e the int64 expert to read."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs, lane_ok, expert, active = _sorted_group(order_ptr, ids_ptr, tl.program_id(0), BLOCK_M)
    _row, ok = resolve_row(expert, row_table_ptr, n_experts, n_rows)
    return offs_n, offs_n < N, pairs, lane_ok, active, ok, tl.where(ok, expert, 0).to(tl.int64)


@triton.jit(do_not_specialize=["P"])
def _dequant_gate_up_kernel(x_ptr, ids_ptr, order_ptr, row_table_ptr, wg_ptr, wu_ptr, h_ptr, P, n_experts, n_rows,
                            stride_xm,
                            N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Stage 1 over decoded weights wg, wu fp16 (E, N, K): h[pairs] = fp16(silu(x Wg^T) * (x Wu^T))."""
    offs_n, n_mask, pairs, lane_ok, active, ok, e = _decoded_group(order_ptr, ids_ptr, row_table_ptr, n_experts,
                                                                   n_rows, N, BLOCK_M, BLOCK_N)
    if active:
        x_rows = x_ptr + (pairs // TOPK).to(tl.int64) * stride_xm
        acc_g = _f16_dot(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), x_rows, lane_ok, wg_ptr + e * N * K, offs_n,
                         n_mask, K, BLOCK_K)
        acc_u = _f16_dot(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), x_rows, lane_ok, wu_ptr + e * N * K, offs_n,
                         n_mask, K, BLOCK_K)
        h = tl.where(ok, silu_mul(acc_g, acc_u), float("nan"))
        h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(h_ptrs, h.to(tl.float16), mask=lane_ok[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["P"])
def _dequant_down_kernel(h_ptr, ids_ptr, order_ptr, wts_ptr, row_table_ptr, wd_ptr, ypair_ptr, P, n_experts, n_rows,
                         N: tl.constexpr, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Stage 2 over decoded weights wd fp16 (E, N, K): ypair[pairs] = gate weight * (h Wd^T) in fp32."""
    offs_n, n_mask, pairs, lane_ok, active, ok, e = _decoded_group(order_ptr, ids_ptr, row_table_ptr, n_experts,
                                                                   n_rows, N, BLOCK_M, BLOCK_N)
    if active:
        h_rows = h_ptr + pairs.to(tl.int64) * K
        acc = _f16_dot(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), h_rows, lane_ok, wd_ptr + e * N * K, offs_n,
                       n_mask, K, BLOCK_K)
        gw = tl.load(wts_ptr + pairs, mask=lane_ok, other=0.0)
        out = tl.where(ok, acc * gw[:, None], float("nan"))
        tl.store(ypair_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :], out,
                 mask=lane_ok[:, None] & n_mask[None, :])


def default_config(n_pairs: int, device: torch.device) -> dict:
    """Tiles by the static pair count (never by data). DEQ_ASM: inline-PTX nibble decoding
    (``runmap.kernels.core.nibbles_f16_asm``, same values), wherever kernels are compiled for a GPU.
    DEQUANT: decode the weights once per pass (P >= DEQUANT_MIN_PAIRS; the module docstring).
    PRELOAD_SCALES (``scale_cols``): sorted passes only. On the H200 (results/kernels/explore/h200-scale-preload.json)
    it took OLMoE's layer at 512 tokens from 332 to 303 us and Qwen1.5-MoE's from 292 to 263; in the decode form it
    was mixed (OLMoE batch 1 19.2 -> 23.5 us and the engine 1,292.7 -> 1,191.4 tok/s, Qwen1.5-MoE at 32 tokens 137 ->
    151 us; other decode sizes within 3 %): there a layer is one wave of programs whose time is each program's serial
    instruction chain (docs/kernels.md)."""
    decode = n_pairs <= DECODE_MAX_PAIRS
    deq_asm = not common.interpreting(device)
    if common.interpreting(device):  # few, large programs: the interpreter pays per program and per op
        return {"BLOCK_M": 32 if decode else 64, "BLOCK_N": 512, "BLOCK_K": 256, "DOWN_BLOCK_N": 512,
                "DOWN_BLOCK_K": 256, "DEQUANT": n_pairs >= DEQUANT_MIN_PAIRS, "DEQ_ASM": deq_asm,
                "PRELOAD_SCALES": not decode}
    # Best configs of the H200 sweeps (results/kernels/bench/h200.json, explore/h200-prefill.json).
    per_tile = {"DEQUANT": False, "DEQ_ASM": deq_asm, "PRELOAD_SCALES": False}  # a scale load per K tile
    if n_pairs <= DECODE_FORM_MAX_PAIRS:
        bn = 32 if n_pairs <= 16 else 64
        return _tiles(16, bn, 256, 4, 3, **per_tile)
    if decode:
        # sorted runs of 16 rows (config SORTED) where the decode form has more pairs to match: 64 pairs (OLMoE batch 8,
        # Qwen1.5-MoE batch 16) 79.1 / 98.6 us per layer against 88.3 / 108.2, 128 pairs (OLMoE batch 16) 102.9 against
        # 109.0 (results/kernels/explore/h200-sorted-decode.json, sort launches included); at 32 pairs (Qwen1.5-MoE
        # batch 8) the decode form was faster, 73.1 against 75.2-79.3. A candidate not yet judged end to end:
        # BLOCK_K 256 (128 contiguous bytes of each weight row per tile, where 128 reads 64) kept the device time on
        # an H100 (batch 8 over 20 experts, 61.3 against 61.6 us) and read absent experts over the link at 52.4
        # against 44.9 GB/s (host-read steps, whose logits equal full residency's only with the same tiles;
        # results/residency/host-read-tiles-h100.log); with 3 stages it was 82.3 against 79.1 us on the H200's whole
        # layer (results/kernels/explore/h200-sorted-decode.json)
        return _tiles(16, 64, 128, 4, 4, SORTED=True, **per_tile)
    if n_pairs >= DEQUANT_MIN_PAIRS:
        return _tiles(128, 128, 64, 8, 3, DEQUANT=True, DEQ_ASM=deq_asm, PRELOAD_SCALES=True)
    # Sorted passes with few pairs per expert (129-2,048 pairs: at top-8 a served decode step of 17-256 rows, a join of
    # one or two prompts): narrow row groups, scales loaded per K tile, as measured
    # (results/kernels/explore/h200-sorted-small.json, us per layer against the 64-row tile below): OLMoE 32 tokens
    # (256 pairs) 95.8 against 204.9, 128 tokens 136.6 against 207.9, 256 tokens 192.5 against 209.6; Qwen1.5-MoE
    # 128 tokens (512 pairs) 145.9 against 257.4, 256 tokens 185.8 against 258.3
    if n_pairs <= SMALL_SORTED_PAIRS[0]:
        return _tiles(16, 128, 256, 4, 3, **per_tile)
    if n_pairs <= SMALL_SORTED_PAIRS[1]:
        return _tiles(16, 64, 128, 4, 4, **per_tile)
    if n_pairs <= SMALL_SORTED_PAIRS[2]:
        return _tiles(32, 128, 128, 4, 3, **per_tile)
    return _tiles(64, 64, 128, 4, 3, DEQUANT=False, DEQ_ASM=deq_asm, PRELOAD_SCALES=True)


def _tiles(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, **flags) -> dict:
    """A GPU config whose down launch takes the gate/up launch's N and K tiles, plus ``flags``."""
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "DOWN_BLOCK_N": block_n,
            "DOWN_BLOCK_K": block_k, "num_warps": num_warps, "num_stages": num_stages, **flags}


# scale values a program may hold in registers for the whole K loop (BLOCK_N x next_pow2(NB) fp32 per section): a
# decode or prefill tile of OLMoE / Qwen is 32-128 x 8; a long K (Mixtral's down, NB 56) at BLOCK_N 128 is past it
SCALE_PRELOAD_MAX = 4096


def scale_cols(cfg: dict, block_n: int, block_k: int, layout: RowLayout, nb: int) -> int:
    """SCALE_COLS of ``core.dot_tiles`` for a launch: every scale of a program's rows loaded before its K loop
    (config "PRELOAD_SCALES"; ``default_config`` turns it on for sorted passes only) when the tile has one scale per
    row (TILE_SCALE) and they fit in ``SCALE_PRELOAD_MAX`` values; 0 (a load per K tile) otherwise."""
    if not cfg.get("PRELOAD_SCALES", False) or not common.tile_scale(block_k, layout.block_size):
        return 0
    cols = common.next_pow2(nb)
    return cols if block_n * cols <= SCALE_PRELOAD_MAX else 0


def _deq_asm(cfg: dict, device: torch.device) -> bool:
    """The config's DEQ_ASM, refusing inline PTX where it cannot run (never a silent substitute)."""
    deq_asm = bool(cfg.get("DEQ_ASM", False))
    if deq_asm and common.interpreting(device):
        raise common.KernelInputError("config: DEQ_ASM (inline PTX) needs a CUDA device, not the Triton interpreter")
    return deq_asm


@triton.jit(do_not_specialize=["P"])
def _count_experts_kernel(ids_ptr, hist_ptr, P, n_experts, E_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    """hist[c, b] = number of pairs of chunk c (pairs c*BLOCK_P ..) in bucket b (expert id; E = invalid id)."""
    c = tl.program_id(0)
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,) pair indices
    ok = offs < P
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    bucket = tl.where((ids >= 0) & (ids < n_experts), ids, n_experts)  # (BP,)
    onehot = ((bucket[:, None] == tl.arange(0, E_PAD)[None, :]) & ok[:, None]).to(tl.int32)  # (BP, E_PAD)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["n_chunks"])
def _scan_histograms_kernel(hist_ptr, base_ptr, runs_ptr, n_chunks, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                            ROWS: tl.constexpr):
    """One program: the run of each bucket (start slot, pairs, padded length -> runs[0..2, b]) and, for every chunk
    c, the slot of its first pair of each bucket: base[c, b] = run start + pairs of bucket b in chunks before c.
    Scanned ROWS chunks at a time; it replaced a read of every chunk's histogram by every placing program, which
    grew with the square of the pass length (10.4 ms for one 8,192-token pass at top-8 on the H200)."""
    offs_e = tl.arange(0, E_PAD)
    offs_r = tl.arange(0, ROWS)
    # while loops: a runtime bound in range() trips the CPU interpreter (numpy 2 scalars)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    r0 = 0
    while r0 < n_chunks:
        rows = r0 + offs_r
        h = tl.load(hist_ptr + rows[:, None] * E_PAD + offs_e[None, :], mask=(rows < n_chunks)[:, None], other=0)
        counts += tl.sum(h, axis=0)
        r0 += ROWS
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start_pad = tl.cumsum(padded, axis=0) - padded  # (E_PAD,) first slot of each bucket's run
    tl.store(runs_ptr + offs_e, start_pad)
    tl.store(runs_ptr + E_PAD + offs_e, counts)
    tl.store(runs_ptr + 2 * E_PAD + offs_e, padded)
    carry = start_pad
    r1 = 0
    while r1 < n_chunks:
        rows = r1 + offs_r
        ok = (rows < n_chunks)[:, None]
        h = tl.load(hist_ptr + rows[:, None] * E_PAD + offs_e[None, :], mask=ok, other=0)  # (ROWS, E_PAD)
        before = tl.cumsum(h, axis=0) - h  # (ROWS, E_PAD) pairs in earlier chunks of this block
        tl.store(base_ptr + rows[:, None] * E_PAD + offs_e[None, :], carry[None, :] + before, mask=ok)
        carry += tl.sum(h, axis=0)
        r1 += ROWS


@triton.jit(do_not_specialize=["P", "n_chunks"])
def _place_pairs_kernel(ids_ptr, base_ptr, runs_ptr, order_ptr, P, n_experts, n_chunks, n_slots,
                        E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program c writes order slots: the sorted position of chunk c's pairs, the -1 tail slots
    [c*BLOCK_P, (c+1)*BLOCK_P) beyond the last run, and (program 0) the -1 padding of every run."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    start_pad = tl.load(runs_ptr + offs_e)  # (E_PAD,)
    counts = tl.load(runs_ptr + E_PAD + offs_e)
    padded = tl.load(runs_ptr + 2 * E_PAD + offs_e)
    base = tl.load(base_ptr + c * E_PAD + offs_e, mask=(offs_e >= 0) & (c < n_chunks), other=0)  # (E_PAD,)
    # this chunk's pairs, stable: slot = base of the bucket + rank in chunk
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,)
    ok = offs < P
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    bucket = tl.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    onehot = (bucket[:, None] == offs_e[None, :]) & ok[:, None]  # (BP, E_PAD)
    rank = tl.cumsum(onehot.to(tl.int32), axis=0) - 1  # (BP, E_PAD) inclusive count - 1
    slot = tl.sum(tl.where(onehot, rank + base[None, :], 0), axis=1)  # (BP,)
    tl.store(order_ptr + slot, offs.to(tl.int32), mask=ok)
    # slots after the last run (the buffer is sized for the worst case)
    tail = c * BLOCK_P + tl.arange(0, BLOCK_P)
    used = tl.sum(padded, axis=0)
    tl.store(order_ptr + tail, tl.full((BLOCK_P,), -1, tl.int32), mask=(tail >= used) & (tail < n_slots))
    if c == 0:  # padding inside each run: slots start_pad + counts .. start_pad + padded - 1
        offs_j = tl.arange(0, BLOCK_M)
        pad = (start_pad + counts)[:, None] + offs_j[None, :]  # (E_PAD, BM)
        pad_ok = offs_j[None, :] < (padded - counts)[:, None]
        tl.store(order_ptr + pad, tl.full((E_PAD, BLOCK_M), -1, tl.int32), mask=pad_ok)


def sort_pairs(ids_flat: torch.Tensor, n_experts: int, block_m: int) -> torch.Tensor:
    """Group pair indices by expert into runs padded to ``block_m`` slots: three launches, no host sync.

    A counting sort (per-chunk expert histograms; one program scans them into run starts and per-chunk bases;
    each chunk places its pairs after the runs of lower experts and the same expert's pairs of earlier chunks),
    so it is stable and deterministic. It replaced
    ~25 torch ops (argsort, scatter_add, cumsums, index puts) whose host dispatch cost ~0.5 ms per layer on
    the H200 host, longer than the layer's GPU time at prefill (tools/explore/probe_host_overhead.py).

    Args:
        ids_flat: int32/int64 (P,) contiguous expert id of each pair. Ids outside [0, E) go to one extra run
            whose block the kernels mark NaN (they never join a real expert's block).
        n_experts: E. block_m: slots per program.
    Returns:
        int32 (n_blocks * block_m,) pair index per slot, -1 for padding; runs in expert order (the invalid
        run last), pairs ascending within a run; n_blocks is the worst case
        ceil((P + min(E + 1, P) * (block_m - 1)) / block_m), so the size depends only on P, E, block_m.
    """
    common.check_tensor("ids_flat", ids_flat, (torch.int32, torch.int64), 1)
    p = ids_flat.numel()
    dev = ids_flat.device
    e_pad = common.next_pow2(n_experts + 1)  # buckets 0 .. E-1 experts, E invalid ids
    block_p = max(16, min(256, 16384 // e_pad))  # (BLOCK_P, E_PAD) one-hot tiles of at most 16 Ki values
    n_chunks = triton.cdiv(p, block_p)
    n_slots = triton.cdiv(p + min(n_experts + 1, p) * (block_m - 1), block_m) * block_m
    hist = common.empty((n_chunks, e_pad), torch.int32, dev)
    base = common.empty((n_chunks, e_pad), torch.int32, dev)
    runs = common.empty((3, e_pad), torch.int32, dev)
    order = common.empty((n_slots,), torch.int32, dev)
    common.launch(_count_experts_kernel[(n_chunks,)], ids_flat, hist, p, n_experts, E_PAD=e_pad, BLOCK_P=block_p)
    common.launch(_scan_histograms_kernel[(1,)], hist, base, runs, n_chunks, E_PAD=e_pad, BLOCK_M=block_m,
                  ROWS=max(1, 4096 // e_pad))
    common.launch(_place_pairs_kernel[(triton.cdiv(n_slots, block_p),)],
        ids_flat, base, runs, order, p, n_experts, n_chunks, n_slots, E_PAD=e_pad, BLOCK_P=block_p, BLOCK_M=block_m)
    return order


def _plan(n_pairs: int, n_experts: int, cfg: dict, ids_flat: torch.Tensor):
    """-> (order tensor, grid dim 0, SORTED, P_PAD) for the pair-grouping mode. Config "SORTED": True takes the sorted
    runs at any pair count (``default_config`` sets it on a GPU from DECODE_FORM_MAX_PAIRS + 1 to DECODE_MAX_PAIRS
    pairs; False keeps the decode form there, for measurements)."""
    if n_pairs <= DECODE_MAX_PAIRS and not cfg.get("SORTED", False):
        return ids_flat, n_pairs, False, common.next_pow2(max(n_pairs, 2))
    order = sort_pairs(ids_flat, n_experts, cfg["BLOCK_M"])
    return order, order.numel() // cfg["BLOCK_M"], True, 2


def host_site(storage: torch.Tensor, host_rows: torch.Tensor | None, layout: RowLayout) -> tuple[int, int]:
    """-> (host_off, n_host_rows) kernel arguments for the host-read site (``expert_site_row``): host_rows, when given,
    is uint8 (n, row_bytes) on storage's device -- on a GPU registered host memory mapped into the device's address
    space (``runmap.residency.transport.mapped_rows``), read over the link -- and a row table entry R + i names its
    row i. (0, 0) without it: every entry past the device rows is then "not resident" as before."""
    if host_rows is None:
        return 0, 0
    common.check_tensor("host_rows", host_rows, torch.uint8, 2, device=storage.device)
    if host_rows.shape[1] != layout.row_bytes:
        raise common.KernelInputError(f"host_rows: row_bytes {host_rows.shape[1]} != layout.row_bytes {layout.row_bytes}")
    off = host_rows.data_ptr() - storage.data_ptr()
    if off % 16:
        raise common.KernelInputError(f"host_rows: starts {off} bytes from storage, not a multiple of 16 (the kernels' "
                                      "vector loads and the fp16 scale view need aligned rows)")
    return off, host_rows.shape[0]


def _check_routing_args(topk_ids, row_table, device):
    common.check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2, device=device)
    common.check_tensor("row_table", row_table, torch.int32, 1, device=device)
    if row_table.numel() < 1:
        raise common.KernelInputError("row_table: empty (no experts)")


def grouped_gate_up(x, topk_ids, order, row_table, storage, layout: RowLayout, cfg: dict, plan,
                    host_rows: torch.Tensor | None = None, shared: "SharedExpert | None" = None,
                    sgu: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 1: h[p] = fp16(silu(x[t] Wg_e^T) * (x[t] Wu_e^T)) for every pair p = t*k + j, e = topk_ids[t, j].

    Args:
        x: float16 (T, H) contiguous. topk_ids: int32/int64 (T, k) contiguous.
        order: from ``_plan`` (int32 sorted slots for prefill; topk_ids itself for decode).
        row_table: int32 (E,); an entry R + i names row i of host_rows. storage: uint8 (R, row_bytes).
        layout: RowLayout. cfg: tiles and DEQ_ASM (``default_config``).
        host_rows: None, or uint8 (n, row_bytes) the host-read site's rows (``host_site``).
        shared, sgu: a one-token shared expert riding in this launch (``grouped_moe``): its programs write
            sgu float16 (2 Is + 1,) = gate_up_gate @ shared.x.
    Returns:
        float16 (T*k, I).
    """
    common.check_storage(storage, layout)
    dev = storage.device
    common.check_tensor("x", x, torch.float16, 2, shape=(None, layout.hidden_size), device=dev)
    _check_routing_args(topk_ids, row_table, dev)
    t, k = topk_ids.shape
    if t != x.shape[0]:
        raise common.KernelInputError(f"topk_ids: {t} rows but x has {x.shape[0]} tokens")
    g, u = common.proj_sections(layout, "gate"), common.proj_sections(layout, "up")
    host_off, n_host = host_site(storage, host_rows, layout)
    h = common.empty((t * k, g.n), torch.float16, dev)
    deq_asm = _deq_asm(cfg, dev)
    _order, grid0, sorted_mode, p_pad = plan
    bk = common.pick_block_k(cfg["BLOCK_K"], layout.block_size)
    n_tiles = triton.cdiv(g.n, cfg["BLOCK_N"])
    s_args, s_opts = (x, x, h, 0), {}
    if shared is not None:  # its programs come after the pairs' in launch order (the kernel maps them)
        s_n = shared.gate_up_gate.shape[0]
        s_bn = cfg.get("SHARED_BLOCK_N", SHARED_GEMV_BLOCK_N)
        grid0 += triton.cdiv(triton.cdiv(s_n, s_bn), n_tiles)
        s_args = (shared.x, shared.gate_up_gate, sgu, s_n)
        s_opts = {"SHARED": True, "S_BLOCK_N": s_bn, "S_BLOCK_K": cfg.get("SHARED_BLOCK_K", SHARED_BLOCK_K)}
    grid = (grid0, n_tiles)
    common.launch(_grouped_gate_up_kernel[grid],
        x, topk_ids, order, row_table, storage, storage.view(torch.float16), h,
        t * k, row_table.numel(), storage.shape[0], layout.row_bytes, host_off, n_host, x.stride(0),
        g.w_off, g.s_off, u.w_off, u.s_off, *s_args,
        N=g.n, K=g.k, NB=g.nb, QBLOCK=layout.block_size, TOPK=k,
        SORTED=sorted_mode, P_PAD=p_pad,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
        TILE_SCALE=common.tile_scale(bk, layout.block_size), DEQ_ASM=deq_asm,
        SCALE_COLS=scale_cols(cfg, cfg["BLOCK_N"], bk, layout, g.nb), **s_opts,
        **common.launch_opts(cfg), **common.chained(dev),
    )
    return h


def grouped_down(h, topk_ids, topk_weights, order, row_table, storage, layout: RowLayout, cfg: dict,
                 plan, host_rows: torch.Tensor | None = None, shared: "SharedExpert | None" = None,
                 sgu: torch.Tensor | None = None, gs: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: ypair[p] = topk_weights[t, j] * (h[p] Wd_e^T) in fp32.

    Args:
        h: float16 (T*k, I) contiguous (stage 1). topk_ids: int32/int64 (T, k). topk_weights: float32 (T, k).
        order, row_table, storage, layout, host_rows: as in ``grouped_gate_up``.
        shared, sgu, gs: a one-token shared expert riding in this launch (``grouped_moe``): from the gate/up
            launch's sgu its programs write gs float32 (H,) = sigmoid(gate logit) * fp16(down @ fp16(silu(g) * u)).
    Returns:
        float32 (T*k, H).
    """
    common.check_storage(storage, layout)
    dev = storage.device
    _check_routing_args(topk_ids, row_table, dev)
    t, k = topk_ids.shape
    common.check_tensor("h", h, torch.float16, 2, shape=(t * k, layout.intermediate_size), device=dev)
    common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=(t, k), device=dev)
    d = common.proj_sections(layout, "down")
    host_off, n_host = host_site(storage, host_rows, layout)
    ypair = common.empty((t * k, d.n), torch.float32, dev)
    deq_asm = _deq_asm(cfg, dev)
    _order, grid0, sorted_mode, p_pad = plan
    bk = common.pick_block_k(cfg["DOWN_BLOCK_K"], layout.block_size)
    n_tiles = triton.cdiv(d.n, cfg["DOWN_BLOCK_N"])
    s_args, s_opts = (h, h, ypair), {}
    if shared is not None:  # its programs come after the pairs' in launch order (the kernel maps them)
        s_bn = cfg.get("SHARED_DOWN_BLOCK_N", SHARED_DOWN_BLOCK_N)
        grid0 += triton.cdiv(triton.cdiv(d.n, s_bn), n_tiles)
        s_args = (sgu, shared.down, gs)
        s_opts = {"SHARED": True, "S_I": shared.down.shape[1], "S_BLOCK_N": s_bn,
                  "S_BLOCK_K": cfg.get("SHARED_DOWN_BLOCK_K", SHARED_DOWN_BLOCK_K)}
    grid = (grid0, n_tiles)
    common.launch(_grouped_down_kernel[grid],
        h, topk_ids, order, topk_weights, row_table, storage, storage.view(torch.float16), ypair,
        t * k, row_table.numel(), storage.shape[0], layout.row_bytes, host_off, n_host, d.w_off, d.s_off, *s_args,
        N=d.n, K=d.k, NB=d.nb, QBLOCK=layout.block_size,
        SORTED=sorted_mode, P_PAD=p_pad,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["DOWN_BLOCK_N"], BLOCK_K=bk,
        TILE_SCALE=common.tile_scale(bk, layout.block_size), DEQ_ASM=deq_asm,
        PF_LINES=common.next_pow2(triton.cdiv(cfg["DOWN_BLOCK_N"] * (d.k // 2), 128)),
        SCALE_COLS=scale_cols(cfg, cfg["DOWN_BLOCK_N"], bk, layout, d.nb), **s_opts,
        **common.launch_opts(cfg), **common.chained(dev),
    )
    return ypair


def sum_topk(ypair: torch.Tensor, t: int, k: int, gs: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 3: ypair float32 (T*k, H) contiguous -> float16 (T, H), summing the k slots in order; with gs float32
    (H,) (a one-token shared expert's gated output, T = 1) then fp16(y + gs)."""
    common.check_tensor("ypair", ypair, torch.float32, 2, shape=(t * k, None))
    hidden = ypair.shape[1]
    if gs is not None:
        common.check_tensor("gs", gs, torch.float32, 1, shape=(hidden,), device=ypair.device)
        if t != 1:
            raise common.KernelInputError(f"gs: a shared expert's output joins the sum of one token, not {t}")
    y = common.empty((t, hidden), torch.float16, ypair.device)
    block_n = 1024 if common.interpreting(ypair.device) else 256
    common.launch(_sum_topk_kernel[(t, triton.cdiv(hidden, block_n))], ypair, y, ypair if gs is None else gs, hidden,
                  TOPK=k, BLOCK_N=block_n, SHARED=gs is not None, **common.chained(ypair.device))
    return y


def dequantize_sections(storage, row_table, layout: RowLayout) -> dict:
    """Every expert's gate, up and down sections decoded to fp16: {"gate": (E, I, H), "up": (E, I, H),
    "down": (E, H, I)}, w = fp16(q * scale); the slice of an expert whose row_table entry is not a resident row
    is not written (the GEMMs give its pairs NaN from the row table).

    Args:
        storage: uint8 (R, row_bytes). row_table: int32 (E,). layout: RowLayout.
    """
    common.check_storage(storage, layout)
    dev = storage.device
    common.check_tensor("row_table", row_table, torch.int32, 1, device=dev)
    n_experts = row_table.numel()
    interp = common.interpreting(dev)
    bn, bk = 64, 256  # 8 KiB of packed bytes per program
    out = {}
    for proj in ("gate", "up", "down"):
        sec = common.proj_sections(layout, proj)
        w = common.empty((n_experts, sec.n, sec.k), torch.float16, dev)
        grid = (n_experts, triton.cdiv(sec.n, bn), triton.cdiv(sec.k, bk))
        common.launch(_dequant_section_kernel[grid], row_table, storage, storage.view(torch.float16), w,
                      n_experts, storage.shape[0], layout.row_bytes, sec.w_off, sec.s_off,
                      N=sec.n, K=sec.k, NB=sec.nb, QBLOCK=layout.block_size, BLOCK_N=bn, BLOCK_K=bk,
                      **({} if interp else {"num_warps": 4}))
        out[proj] = w
    return out


def _dequant_stages(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout, cfg: dict, plan):
    """Stages 1 and 2 over weights decoded once (``dequantize_sections``) -> ypair float32 (T*k, H)."""
    t, k = topk_ids.shape
    order, grid0, _sorted, _p_pad = plan
    w = dequantize_sections(storage, row_table, layout)
    g, d = common.proj_sections(layout, "gate"), common.proj_sections(layout, "down")
    common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=(t, k), device=x.device)
    h = common.empty((t * k, g.n), torch.float16, x.device)
    common.launch(_dequant_gate_up_kernel[(grid0, triton.cdiv(g.n, cfg["BLOCK_N"]))],
                  x, topk_ids, order, row_table, w["gate"], w["up"], h, t * k, row_table.numel(), storage.shape[0],
                  x.stride(0),
                  N=g.n, K=g.k, TOPK=k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  **common.launch_opts(cfg))
    ypair = common.empty((t * k, d.n), torch.float32, x.device)
    common.launch(_dequant_down_kernel[(grid0, triton.cdiv(d.n, cfg["DOWN_BLOCK_N"]))],
                  h, topk_ids, order, topk_weights, row_table, w["down"], ypair, t * k, row_table.numel(),
                  storage.shape[0],
                  N=d.n, K=d.k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["DOWN_BLOCK_N"], BLOCK_K=cfg["DOWN_BLOCK_K"],
                  **common.launch_opts(cfg))
    return ypair


def grouped_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout,
                config: dict | None = None, host_rows: torch.Tensor | None = None,
                shared: SharedExpert | None = None) -> torch.Tensor:
    """All three stages. Arguments as ``runmap.kernels.executors.moe_experts``; returns float16 (T, H).
    Never synchronizes with the host; buffer sizes depend only on T, k, E and the config. config "DEQUANT"
    (default: P >= DEQUANT_MIN_PAIRS) decodes the weights once for the pass instead of in each tile's loop.
    host_rows: the host-read site's rows (``host_site``); the decoded mode does not read them (its dequantized
    copy of every resident expert is what partial residency has no room for), so it is off with them.
    shared: a one-token (T = 1) shared expert (``SharedExpert``) computed in the same three launches: its GEMV's
    programs follow the pairs' in the gate/up launch, its down projection's in the down launch, and the k-slot sum adds
    its gated output; the result is then fp16(routed + sigmoid(gate logit) * shared), what
    ``runmap.kernels.fused_ops.shared_expert_one_row`` computes after the routed sum, within fp32 summation order (its
    tiles differ; ``SharedExpert`` says why it rides)."""
    common.check_storage(storage, layout)
    _check_routing_args(topk_ids, row_table, storage.device)
    t, k = topk_ids.shape
    if t == 0:
        return common.empty((0, layout.hidden_size), torch.float16, storage.device)
    cfg = dict(default_config(t * k, storage.device), **(config or {}))
    ids_flat = topk_ids.reshape(-1)
    if host_rows is not None:
        cfg["DEQUANT"] = False
    if shared is not None:
        return _grouped_moe_with_shared(x, topk_ids, topk_weights, storage, row_table, layout, cfg, host_rows, shared)
    if cfg.get("DEQUANT") and t * k > DECODE_MAX_PAIRS:  # the decoded path runs over sorted runs only
        common.check_tensor("x", x, torch.float16, 2, shape=(t, layout.hidden_size), device=storage.device)
        plan = _plan(t * k, row_table.numel(), cfg, ids_flat)
        return sum_topk(_dequant_stages(x, topk_ids, topk_weights, storage, row_table, layout, cfg, plan), t, k)
    plan = _plan(t * k, row_table.numel(), cfg, ids_flat)
    order = plan[0]
    h = grouped_gate_up(x, topk_ids, order, row_table, storage, layout, cfg, plan, host_rows)
    ypair = grouped_down(h, topk_ids, topk_weights, order, row_table, storage, layout, cfg, plan, host_rows)
    return sum_topk(ypair, t, k)


class SharedExpert(NamedTuple):
    """A shared expert (Qwen2-MoE) of one token, computed inside ``grouped_moe``'s launches.

    x              float16 (1, H) contiguous: the MoE input of the token
    gate_up_gate   float16 (2 * Is + 1, H) contiguous: gate rows, up rows, then the shared expert gate's row
    down           float16 (H, Is) contiguous

    Why it rides in the routed launches instead of two launches of its own after them: at batch 1 the routed launches
    have few programs (Qwen1.5-MoE: 4 pairs x 44 column tiles) whose time is each one's serial chain
    (docs/kernels.md), so the device has bandwidth and room beside them for the shared expert's 69 MB of fp16
    weights, and a layer has two launches fewer in its chain."""
    x: torch.Tensor
    gate_up_gate: torch.Tensor
    down: torch.Tensor


# The riding shared expert's tiles; a config's SHARED_BLOCK_N, SHARED_BLOCK_K, SHARED_DOWN_BLOCK_N and SHARED_DOWN_BLOCK_K
# replace them. The best of tools/explore/probe_shared_ride.py on an H100 (results/kernels/explore/h100-shared-ride.json,
# Qwen1.5-MoE, 16 layers per CUDA graph): the one-row GEMV's tiles for the first GEMV, and down rows 8 x 1024 columns per
# step (40.0 us a layer, 1.31x the two launches after the routed ones; the one-row GEMV's 4 x 512, 46.3 us, 1.13x: its
# 11 dependent steps over Is = 5,632 in two waves of programs)
SHARED_GEMV_BLOCK_N = 16
SHARED_BLOCK_K = 512
SHARED_DOWN_BLOCK_N = 8
SHARED_DOWN_BLOCK_K = 1024


def _check_shared(shared: SharedExpert, x: torch.Tensor, t: int, layout: RowLayout) -> None:
    hid = layout.hidden_size
    if t != 1:
        raise common.KernelInputError(f"shared: a shared expert rides in the launches of one token, not {t}")
    common.check_tensor("shared.x", shared.x, torch.float16, 2, shape=(1, hid), device=x.device)
    common.check_tensor("shared.gate_up_gate", shared.gate_up_gate, torch.float16, 2, shape=(None, hid),
                        device=x.device)
    common.check_tensor("shared.down", shared.down, torch.float16, 2, shape=(hid, None), device=x.device)
    n3 = shared.gate_up_gate.shape[0]
    if shared.down.shape[1] < 1 or shared.down.shape[1] * 2 + 1 != n3:
        raise common.KernelInputError(f"shared.gate_up_gate: {n3} rows, expected 2 * Is + 1 with Is = down's "
                                      f"{shared.down.shape[1]} columns")


def _grouped_moe_with_shared(x, topk_ids, topk_weights, storage, row_table, layout, cfg, host_rows, shared):
    """``grouped_moe`` of one token with its shared expert in the same three launches (the decode form)."""
    t, k = topk_ids.shape
    _check_shared(shared, x, t, layout)
    plan = _plan(t * k, row_table.numel(), cfg, topk_ids.reshape(-1))
    if plan[2]:  # the SHARED programs' mapping assumes the decode form's grid (P programs along dimension 0)
        raise common.KernelInputError(f"shared: rides in the decode form only; {t * k} pairs with config SORTED "
                                      f"{cfg.get('SORTED', False)} take sorted runs")
    dev = storage.device
    sgu = common.empty((shared.gate_up_gate.shape[0],), torch.float16, dev)  # g | u | the gate's logit
    gs = common.empty((layout.hidden_size,), torch.float32, dev)
    h = grouped_gate_up(x, topk_ids, plan[0], row_table, storage, layout, cfg, plan, host_rows, shared, sgu)
    ypair = grouped_down(h, topk_ids, topk_weights, plan[0], row_table, storage, layout, cfg, plan, host_rows, shared,
                         sgu, gs)
    return sum_topk(ypair, t, k, gs)
