"""One-launch decode layer for ``topk-fused`` (KERNEL "fused"): the "words" gate/up and down tiles of
``kernels.gemv_words`` as the work items of a single launch.

Why: a pure read of one OLMoE decode layer's expert bytes takes 8.2 us in one launch and 10.3 us in two
(scripts/probe_read_floor.py, results/kernels/explore/h200-read-floor.json): the boundary between the gate/up
and the down launch costs a launch gap, the tail of one and the ramp of the other. Here the down tiles start
while gate/up tiles are still running, load their weights and scales (which do not depend on h), and wait only
for h of their token.

Work items, in this order: G = T*k*ceil(I/BLOCK_N) gate/up tiles (pair p = t*k + j, tile of I), then
D = T*ceil(H/DOWN_BLOCK_N) down tiles (token t, tile of H). Each program takes the next item from a ticket
counter (an atomic add) instead of its program id: every item below a program's ticket was taken by a program
that is already running, so a down tile that waits only for gate/up items (which never wait) cannot deadlock,
however many programs the GPU keeps resident.

Synchronization, in an int32 workspace of 1 + 2T counters ``sync`` = [ticket, done[0..T), taken[0..T)]:
* a gate/up tile stores its h tile, then (barrier, then one release atomic) adds 1 to done[t];
* a down tile of token t spins until done[t] = k * ceil(I/BLOCK_N) (acquire), reads h around the L1, then adds
  1 to taken[t]; the last down tile of t resets done[t] and taken[t] to 0, and the program that drew the last
  ticket resets the ticket: the workspace is all zeros again when the launch ends, so one workspace serves every
  call on a stream (``workspace``) and a CUDA graph replays with no reset launch.
Same arithmetic as the two "words" launches (same tiles, same fixed-order slot sum, same NaN rule): the result
is bit-for-bit that of KERNEL "words" with the same tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import common
from kernels.core import store_slot_sum, token_slots
from kernels.gemv_words import _load_pairs, word_dot, words_down_tile, words_gate_up_tile

_WORKSPACES: dict[tuple, torch.Tensor] = {}
WORKSPACE_TOKENS = 4096  # tokens one cached workspace serves; more get a zeroed buffer of their own


def workspace(device: torch.device, tokens: int) -> torch.Tensor:
    """int32 (1 + 2 * tokens,) zeroed counters for ``_words_fused_kernel`` on the current stream of ``device``.

    The kernel leaves its counters zero, so a cached buffer is reused by every call on that stream (calls on
    one stream never overlap). A buffer of its own is allocated for a stream first seen while capturing a CUDA
    graph, and for more than WORKSPACE_TOKENS tokens.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    if tokens > WORKSPACE_TOKENS:
        return torch.zeros(1 + 2 * tokens, dtype=torch.int32, device=device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = torch.zeros(1 + 2 * WORKSPACE_TOKENS, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ws  # allocated (and zeroed) inside the graph's memory pool: not cached beyond it
        _WORKSPACES[key] = ws
    return ws


@triton.jit
def _load_acquire(ptr, ASM: tl.constexpr):
    """The int32 at ``ptr`` with acquire semantics. ASM (GPU): a plain acquire load by every thread, after a
    short sleep, so that waiting programs neither queue read-modify-writes on the counter the gate/up tiles
    are adding to nor flood the memory system; else (interpreter) an atomic add of 0."""
    if ASM:
        v = tl.inline_asm_elementwise("nanosleep.u32 64;\n\tld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                      [ptr + tl.arange(0, 1)], dtype=tl.int32, is_pure=False, pack=1)  # (1,)
        return tl.sum(v, axis=0)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _wait_at_least(ptr, target, ASM: tl.constexpr):
    """Spin until the int32 at ``ptr`` is >= ``target`` (acquire: later loads see what its writers stored)."""
    count = _load_acquire(ptr, ASM)
    while count < target:
        count = _load_acquire(ptr, ASM)


@triton.jit
def _down_tile_preloaded(
    t, tile_n, done_ptr, done_target,
    h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr,
    n_experts, n_rows, row_bytes, stride_ym, down_w, down_s, magic,
    N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr, NB_P2: tl.constexpr, ASM: tl.constexpr,
):
    """``words_down_tile`` with all of the tile's weight words and scales, as one (TOPK_P2, BN, NB_P2, QBLOCK/8)
    tile, loaded before waiting for h (done[t] >= done_target). Same products and sums as the looped tile."""
    WPB: tl.constexpr = QBLOCK // 8
    KW: tl.constexpr = K // 8
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < N
    offs_b = tl.arange(0, NB_P2)  # (NB_P2,) scale block
    offs_kw = offs_b[:, None] * WPB + tl.arange(0, WPB)[None, :]  # (NB_P2, WPB) word index within a row
    k_ok = (offs_b[:, None] < NB) & (offs_kw < KW)
    pairs, s_ok, w_row, s_row, ok, gw = token_slots(t, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, n_experts,
                                                    n_rows, row_bytes, TOPK, TOPK_P2)
    w_base = (w_row + down_w).to(tl.pointer_type(tl.int32))  # (S,) int32 pointers
    s_base = s_row + down_s  # (S,) fp16 pointers
    sn_ok = ok[:, None] & n_mask[None, :]  # (S, BN)
    pw = tl.load(w_base[:, None, None, None] + (offs_n * KW)[None, :, None, None] + offs_kw[None, None, :, :],
                 mask=sn_ok[:, :, None, None] & k_ok[None, None, :, :], other=0)  # (S, BN, NB_P2, WPB) int32
    s = tl.load(s_base[:, None, None] + offs_n[None, :, None] * NB + offs_b[None, None, :],
                mask=sn_ok[:, :, None] & (offs_b < NB)[None, None, :], other=0.0).to(tl.float32)  # (S, BN, NB_P2)
    _wait_at_least(done_ptr, done_target, ASM)
    h32 = (h_ptr + pairs.to(tl.int64) * K).to(tl.pointer_type(tl.int32))  # (S,) int32 pair pointers
    e0, o0, e1, o1, e2, o2, e3, o3 = _load_pairs(h32[:, None, None], offs_kw[None, :, :],
                                                 ok[:, None, None] & k_ok[None, :, :], False, True)  # (S, NB_P2, WPB)
    prod = word_dot(pw, magic, e0[:, None], o0[:, None], e1[:, None], o1[:, None],
                    e2[:, None], o2[:, None], e3[:, None], o3[:, None])  # (S, BN, NB_P2, WPB)
    part = tl.sum(prod, axis=3) * (s * gw[:, None, None])  # (S, BN, NB_P2)
    store_slot_sum(part, s_ok, ok, y_ptr, t, stride_ym, offs_n, n_mask)


@triton.jit
def _words_fused_kernel(
    x_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, y_ptr, sync_ptr,
    # x (T, H) fp16, ids (T*k,), wts (T*k,) fp32, h (T*k, I) fp16 scratch, y (T, H) fp16, sync (1 + 2T,) int32
    T, n_experts, n_rows, row_bytes, stride_xm, stride_ym,
    gate_w, gate_s, up_w, up_s, down_w, down_s, magic,
    I: tl.constexpr, H: tl.constexpr, NB_H: tl.constexpr, NB_I: tl.constexpr, QBLOCK: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr,
    DOWN_BLOCK_N: tl.constexpr, DOWN_SUB: tl.constexpr, DOWN_EVEN: tl.constexpr,
    DOWN_PRELOAD: tl.constexpr, NB_I_P2: tl.constexpr, ASM: tl.constexpr,
):
    """One program = one work item, drawn from the ticket counter (module docstring)."""
    NT_UP: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N  # gate/up tiles per pair
    NT_DOWN: tl.constexpr = (H + DOWN_BLOCK_N - 1) // DOWN_BLOCK_N  # down tiles per token
    n_up = T * TOPK * NT_UP
    n_items = n_up + T * NT_DOWN
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    if item == n_items - 1:  # every other ticket is taken: ready for the next launch
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
    if item < n_up:
        p = item // NT_UP
        words_gate_up_tile(p, item % NT_UP, x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr,
                           n_experts, n_rows, row_bytes, stride_xm, gate_w, gate_s, up_w, up_s, magic,
                           I, H, NB_H, QBLOCK, TOPK, BLOCK_N, SUB, EVEN)
        tl.debug_barrier()  # every thread's h stores happen before the release below
        tl.atomic_add(sync_ptr + 1 + p // TOPK, 1, sem="release", scope="gpu")
    else:
        d = item - n_up
        t = d // NT_DOWN
        done_ptr = sync_ptr + 1 + t
        if DOWN_PRELOAD:
            _down_tile_preloaded(t, d % NT_DOWN, done_ptr, TOPK * NT_UP, h_ptr, ids_ptr, wts_ptr, row_table_ptr,
                                 w_ptr, s_ptr, y_ptr, n_experts, n_rows, row_bytes, stride_ym, down_w, down_s, magic,
                                 H, I, NB_I, QBLOCK, TOPK, TOPK_P2, DOWN_BLOCK_N, NB_I_P2, ASM)
        else:
            _wait_at_least(done_ptr, TOPK * NT_UP, ASM)
            words_down_tile(t, d % NT_DOWN, h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr,
                            n_experts, n_rows, row_bytes, stride_ym, down_w, down_s, magic,
                            H, I, NB_I, QBLOCK, TOPK, TOPK_P2, DOWN_BLOCK_N, DOWN_SUB, DOWN_EVEN, True)
        taken = tl.atomic_add(sync_ptr + 1 + T + t, 1, sem="relaxed", scope="gpu")
        if taken == NT_DOWN - 1:  # the last down tile of token t: nobody reads these counters again
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1 + T + t, 0, sem="relaxed", scope="gpu")


def launch_fused(x, topk_ids, topk_weights, storage, row_table, layout, cfg: dict, g, u, d, h, y, even_up: bool,
                 even_down: bool, launch_opts: dict, magic: int) -> None:
    """Launch ``_words_fused_kernel`` (arguments checked and buffers allocated by ``kernels.topk_fused``)."""
    t, k = topk_ids.shape
    n_items = t * k * triton.cdiv(g.n, cfg["BLOCK_N"]) + t * triton.cdiv(d.n, cfg["DOWN_BLOCK_N"])
    sync = workspace(x.device, t)
    _words_fused_kernel[(n_items,)](
        x, topk_ids, topk_weights, row_table, storage, storage.view(torch.float16), h, y, sync,
        t, row_table.numel(), storage.shape[0], layout.row_bytes, x.stride(0), y.stride(0),
        g.w_off, g.s_off, u.w_off, u.s_off, d.w_off, d.s_off, magic,
        I=g.n, H=d.n, NB_H=g.nb, NB_I=d.nb, QBLOCK=layout.block_size, TOPK=k, TOPK_P2=1 << max(0, (k - 1).bit_length()),
        BLOCK_N=cfg["BLOCK_N"], SUB=cfg["SUB"], EVEN=even_up,
        DOWN_BLOCK_N=cfg["DOWN_BLOCK_N"], DOWN_SUB=cfg["DOWN_SUB"], DOWN_EVEN=even_down,
        DOWN_PRELOAD=bool(cfg.get("DOWN_PRELOAD", False)), NB_I_P2=1 << max(0, (d.nb - 1).bit_length()),
        ASM=not common.interpreting(x.device),
        **launch_opts,
    )
