"""Triton device helpers shared by the W4A16 kernels: nibble decoding, row resolution, and the two inner
loops (tensor-core tile and GEMV) that multiply FP16 activations by one qpacked weight section.

Packed weight section of a projection: uint8 (N, K/2), byte j of a row holds k = 2j in the low nibble and
k = 2j + 1 in the high nibble, value q + 8. So a K tile splits into its even and odd columns: the
activation tile is loaded contiguously, split into even / odd columns in registers, and each nibble plane
multiplies its half (the weights are never re-interleaved).
Scales: fp16 (N, NB), NB = ceil(K / QBLOCK). Loop bounds are constexpr (the CPU interpreter cannot iterate
over runtime values, and fixed trip counts let the compiler pipeline the loads).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def chain_wait(CHAINED: tl.constexpr):
    """The wait of a kernel in the decode chain (``runmap.kernels.common.chained``). CHAINED: wait until the launch
    before this one has completed and its writes are visible (``griddepcontrol.wait``), then let the launch after
    this one start its programs (they block at their own wait). Since every chained kernel signals only after its
    wait, a kernel that starts early has every launch before its predecessor completed: before this call it may
    read what its predecessor does not write (weights, earlier steps' keys), and must write nothing.
    Not CHAINED: nothing (plain stream order)."""
    if CHAINED:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """One ``prefetch.global.L2`` per element of the pointer tensor ``ptrs`` (GPU only: inline PTX). A hint: it
    changes no value, and an address inside an allocation is all it needs to be harmless."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def nibbles_f16(packed):
    """uint8 tile -> (low, high) fp16 tiles of q in [-8, 7].

    Exponent trick instead of int->float conversion: 0x6400 | n is the fp16 bit pattern of 1024 + n,
    exact for n < 1024, so one OR and one subtract replace a conversion instruction per value.
    """
    p = packed.to(tl.int16)
    lo = ((p & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    hi = (((p >> 4) & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    return lo, hi


# Two fp16 per 32-bit register: a byte pair is spread to the low bytes of the two halves (PRMT), one LOP3
# per plane puts the nibble into the mantissa of fp16 1024 (low nibble as n, high nibble as 16 n), and one
# f16x2 op maps both values to q = n - 8 exactly: (1024 + n) - 1032, (1024 + 16 n) / 16 - 72. Output element
# i of each plane comes from input byte i, as Triton's pack = 4 contract requires (tests/test_nibble_ptx.py
# runs this text in an emulator). Triton's own lowering of ``nibbles_f16`` spends ~3 PRMT per byte packing
# 16-bit values; this is 2.5 instructions per byte in all (tools/explore/sass_stats.py counts the loop).
_NIBBLES_F16X2_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, bias, scale, shift;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 bias, 0x64086408;
sub.rn.f16x2 $0, $0, bias;
sub.rn.f16x2 $1, $1, bias;
mov.b32 scale, 0x2C002C00;
mov.b32 shift, 0xD480D480;
fma.rn.f16x2 $2, $2, scale, shift;
fma.rn.f16x2 $3, $3, scale, shift;
}
""")


@triton.jit
def nibbles_f16_asm(packed):
    """``nibbles_f16`` in inline PTX, four bytes per call (GPU only: the interpreter has no inline asm)."""
    return tl.inline_asm_elementwise(_NIBBLES_F16X2_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def nibbles_f32(packed):
    """uint8 tile -> (low, high) fp32 tiles of q in [-8, 7] (0x4B000000 | n is the fp32 of 2^23 + n)."""
    p = packed.to(tl.int32)
    lo = ((p & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = (((p >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def resolve_row(expert, row_table_ptr, n_experts, n_rows):
    """expert id -> (physical row (int64, 0 when invalid), ok). ok is False for an id outside [0, E) or a
    row outside [0, R) (a non-resident -1): callers then write NaN, never another expert's result."""
    ok_e = (expert >= 0) & (expert < n_experts)
    row = tl.load(row_table_ptr + expert, mask=ok_e, other=-1)
    ok = ok_e & (row >= 0) & (row < n_rows)
    row = tl.where(ok, row, 0).to(tl.int64)
    return row, ok


@triton.jit
def expert_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes):
    """expert id(s) -> (uint8 pointer to its physical row, fp16 pointer to the same row in the fp16 view of
    the storage, ok) as ``resolve_row``; an invalid id points at row 0 with ok False."""
    row, ok = resolve_row(expert, row_table_ptr, n_experts, n_rows)
    return w_ptr + row * row_bytes, s_ptr + row * (row_bytes // 2), ok


@triton.jit
def expert_site_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes, host_off, n_host_rows):
    """``expert_row`` with a host-read site: a row table entry r in [R, R + n_host_rows) names row r - R of the host
    source, a second (n_host_rows, row_bytes) storage whose first byte lies ``host_off`` bytes (int64, a multiple of
    16, either sign) from ``w_ptr``: registered host memory mapped into the device's address space, read over the
    link. Entries in [0, R) are device rows as before; anything else (-1: neither) gives ok False. An offset from
    the device storage's pointer rather than a second pointer keeps one select of integers (no pointer select)."""
    ok_e = (expert >= 0) & (expert < n_experts)
    row = tl.load(row_table_ptr + expert, mask=ok_e, other=-1)
    on_device = (row >= 0) & (row < n_rows)
    on_host = (row >= n_rows) & (row < n_rows + n_host_rows)
    ok = ok_e & (on_device | on_host)
    byte = tl.where(on_host, host_off + (row - n_rows).to(tl.int64) * row_bytes,
                    tl.where(ok, row, 0).to(tl.int64) * row_bytes)  # from w_ptr; row 0 when not ok
    return w_ptr + byte, s_ptr + byte // 2, ok


@triton.jit
def store_pair_h(part_g, part_u, ok, h_ptr, pid_p, N: tl.constexpr, offs_n, n_mask):
    """Epilogue of a decode gate/up GEMV program: h[pid_p, offs_n] = fp16(silu(g) * up), g / up the sums of
    the (BN, X) fp32 partial products over X; NaN when the pair's expert is not resident (``ok`` False)."""
    g = tl.sum(part_g, axis=1)  # (BN,)
    up = tl.sum(part_u, axis=1)
    h = tl.where(ok, silu_mul(g, up), float("nan"))  # NaN marks a non-resident expert, never a substitute
    tl.store(h_ptr + pid_p.to(tl.int64) * N + offs_n, h.to(tl.float16), mask=n_mask)


@triton.jit
def token_slots(t, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes,
                TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """The k slots of token t in a decode down program, padded to S = TOPK_P2: (pairs (S,), s_ok (S,) real
    slot, w_row / s_row (S,) row pointers as ``expert_row``, ok (S,) resident, gate weights (S,) fp32, 0 on
    padding)."""
    offs_s = tl.arange(0, TOPK_P2)  # (S,) slots
    s_ok = offs_s < TOPK
    pairs = t * TOPK + offs_s  # (S,)
    expert = tl.load(ids_ptr + pairs, mask=s_ok, other=-1)
    w_row, s_row, ok = expert_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)  # (S,) each
    gw = tl.load(wts_ptr + pairs, mask=s_ok, other=0.0)  # (S,) fp32 gate weights
    return pairs, s_ok, w_row, s_row, ok, gw


@triton.jit
def slot_block_scales(s_base, offs_n, n_mask, ok, blk, NB: tl.constexpr, EVEN: tl.constexpr):
    """Scales of scale block ``blk`` in a decode down program: (fp32 (S, BN) scales of the rows offs_n of each
    slot's down section (s_base: (S,) fp16 pointers), (S, BN) mask of the loads). EVEN: every slot real and
    resident-or-row-0, every row and block in range, so the load is unmasked (the mask is then unused)."""
    sm = ok[:, None] & (n_mask & (blk < NB))[None, :]  # (S, BN)
    if EVEN:
        s = tl.load(s_base[:, None] + offs_n[None, :] * NB + blk).to(tl.float32)
    else:
        s = tl.load(s_base[:, None] + offs_n[None, :] * NB + blk, mask=sm, other=0.0).to(tl.float32)
    return s, sm


@triton.jit
def store_slot_sum(part, s_ok, ok, y_ptr, t, stride_ym, offs_n, n_mask):
    """Epilogue of a decode down program: y[t, offs_n] = fp16 of the (S, BN, X) fp32 partials summed over X,
    then over the slots in a fixed order (deterministic); NaN when any real slot's expert is not resident
    (an unmasked program read row 0 for it with its real gate weight: the NaN replaces that result)."""
    acc = tl.sum(tl.sum(part, axis=2), axis=0)  # (BN,)
    missing = tl.sum((s_ok & ~ok).to(tl.int32), axis=0)  # slots whose expert is not resident
    acc = tl.where(missing > 0, float("nan"), acc)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + offs_n, acc.to(tl.float16), mask=n_mask)


@triton.jit
def _row_scales(s_base, offs_n, n_mask, NB: tl.constexpr, SCALE_COLS: tl.constexpr):
    """fp32 (BN, SCALE_COLS) scales of the rows offs_n, every block of them (columns past NB are 0)."""
    offs_b = tl.arange(0, SCALE_COLS)
    sm = n_mask[:, None] & (offs_b < NB)[None, :]
    return tl.load(s_base + offs_n[:, None] * NB + offs_b[None, :], mask=sm, other=0.0).to(tl.float32)


@triton.jit
def _k_tile_scales(s_all, s_base, offs_n, n_mask, k0, NB: tl.constexpr, QBLOCK: tl.constexpr,
                   SCALE_COLS: tl.constexpr):
    """fp32 (BN,) scales of the K tile at k0 (inside one scale block): picked from the rows' scales loaded before
    the loop (``s_all`` from ``_row_scales``; the pick adds exact zeros, so the value is the stored one), or loaded
    here when SCALE_COLS is 0."""
    if SCALE_COLS > 0:
        pick = tl.arange(0, SCALE_COLS)[None, :] == k0 // QBLOCK  # (1, SC)
        return tl.sum(tl.where(pick, s_all, 0.0), axis=1)
    else:
        return tl.load(s_base + offs_n * NB + k0 // QBLOCK, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def dot_tiles(acc_a, acc_b, x_rows, m_mask, wa_base, sa_base, wb_base, sb_base, offs_n, n_mask,
              K: tl.constexpr, NB: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr,
              TILE_SCALE: tl.constexpr, DUAL: tl.constexpr, DEQ_ASM: tl.constexpr = False,
              SCALE_COLS: tl.constexpr = 0):
    """Tensor-core inner loop: acc_a (BM, BN) fp32 += x[rows, :K] @ dequant(Wa[offs_n, :K])^T, and the same
    into acc_b for Wb when DUAL (gate and up share the activation tile).

    x_rows: (BM,) pointers to fp16 activation rows; m_mask: (BM,) valid rows.
    wa_base / wb_base: uint8 pointers to a packed (N, K/2) section; sa_base / sb_base: fp16 pointers to its
    (N, NB) scales. offs_n / n_mask: (BN,) output columns. Masked bytes decode to -8 but meet x = 0.
    DEQ_ASM: decode nibbles with ``nibbles_f16_asm`` (GPU only; same values as ``nibbles_f16``).
    SCALE_COLS (with TILE_SCALE; a power of two >= NB, or 0): load every scale of the program's rows once, before
    the loop. The weight and activation tiles stream through the compiler's asynchronous copies, but a scale load
    inside the loop is a plain load that the same iteration consumes. Measured on the H200 it helps sorted passes
    (~10 % at 512 tokens) and not batch-1 decode, where a launch is bound by each program's instruction chain
    (docs/kernels.md, "What bounds a decode expert launch"); ``grouped.default_config`` uses it for sorted passes.
    """
    tl.static_assert(SCALE_COLS == 0 or SCALE_COLS >= NB, "SCALE_COLS must be 0 or cover every scale block")
    HALF: tl.constexpr = BLOCK_K // 2
    KB: tl.constexpr = K // 2
    offs_j = tl.arange(0, HALF)
    w_cols = offs_n[None, :] * KB  # (1, BN) byte offset of each weight row
    sa_all = sa_base
    sb_all = sb_base
    if TILE_SCALE and SCALE_COLS > 0:
        sa_all = _row_scales(sa_base, offs_n, n_mask, NB, SCALE_COLS)  # (BN, SC) fp32
        if DUAL:
            sb_all = _row_scales(sb_base, offs_n, n_mask, NB, SCALE_COLS)
    for k0 in range(0, K, BLOCK_K):
        offs_kb = k0 // 2 + offs_j  # (HALF,) byte index = k // 2
        k_mask = offs_kb < KB
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        # one coalesced load of the activation tile, then even / odd columns split in registers
        xt = tl.load(x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xt, (xt.shape[0], HALF, 2)))  # (BM, HALF) fp16 each
        wm = k_mask[:, None] & n_mask[None, :]
        w_off = w_cols + offs_kb[:, None]  # (HALF, BN)
        pa = tl.load(wa_base + w_off, mask=wm, other=0)  # (HALF, BN) uint8
        lo, hi = nibbles_f16_asm(pa) if DEQ_ASM else nibbles_f16(pa)  # (HALF, BN) fp16 each
        if TILE_SCALE:
            s = _k_tile_scales(sa_all, sa_base, offs_n, n_mask, k0, NB, QBLOCK, SCALE_COLS)  # (BN,) fp32
            acc_a += (tl.dot(x_even, lo) + tl.dot(x_odd, hi)) * s[None, :]
        else:
            s_off = offs_n[None, :] * NB + (2 * offs_kb[:, None]) // QBLOCK  # (HALF, BN); k, k+1 share a block
            s = tl.load(sa_base + s_off, mask=wm, other=0.0)
            acc_a = tl.dot(x_even, lo * s, acc_a)
            acc_a = tl.dot(x_odd, hi * s, acc_a)
        if DUAL:
            pb = tl.load(wb_base + w_off, mask=wm, other=0)
            lo, hi = nibbles_f16_asm(pb) if DEQ_ASM else nibbles_f16(pb)
            if TILE_SCALE:
                s = _k_tile_scales(sb_all, sb_base, offs_n, n_mask, k0, NB, QBLOCK, SCALE_COLS)
                acc_b += (tl.dot(x_even, lo) + tl.dot(x_odd, hi)) * s[None, :]
            else:
                s = tl.load(sb_base + s_off, mask=wm, other=0.0)
                acc_b = tl.dot(x_even, lo * s, acc_b)
                acc_b = tl.dot(x_odd, hi * s, acc_b)
    return acc_a, acc_b


@triton.jit
def _scale_tile(prod, s_base, offs_n, n_mask, k0, NB: tl.constexpr, QBLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """prod (BN, HALF) fp32 of one K tile starting at k0 -> prod times its scales. The tile covers GROUPS
    consecutive scale blocks (GROUPS = 1: one scale per row)."""
    if GROUPS == 1:
        s = tl.load(s_base + offs_n * NB + k0 // QBLOCK, mask=n_mask, other=0.0).to(tl.float32)  # (BN,)
        return prod * s[:, None]
    else:
        BN: tl.constexpr = prod.shape[0]
        HALF: tl.constexpr = prod.shape[1]
        offs_g = k0 // QBLOCK + tl.arange(0, GROUPS)  # (G,) scale block index
        sm = n_mask[:, None] & (offs_g < NB)[None, :]
        s = tl.load(s_base + offs_n[:, None] * NB + offs_g[None, :], mask=sm, other=0.0).to(tl.float32)  # (BN, G)
        p3 = tl.reshape(prod, (BN, GROUPS, HALF // GROUPS))  # (BN, G, QBLOCK/2)
        return tl.reshape(p3 * s[:, :, None], (BN, HALF))


@triton.jit
def gemv_tiles(acc_a, acc_b, x_row, wa_base, sa_base, wb_base, sb_base, offs_n, n_mask,
               K: tl.constexpr, NB: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr,
               TILE_SCALE: tl.constexpr, DUAL: tl.constexpr, GROUPS: tl.constexpr = 1):
    """GEMV inner loop for one activation row: acc_a (BN,) fp32 += dequant(Wa[offs_n, :K]) @ x[:K]
    (and acc_b for Wb when DUAL). x_row: pointer to one fp16 row; other arguments as in ``dot_tiles``.
    GROUPS > 1 (with TILE_SCALE): a K tile spans GROUPS whole scale blocks (BLOCK_K = GROUPS * QBLOCK), so
    large tiles keep many bytes in flight per iteration (these loads are not software-pipelined).
    Products accumulate in (BN, BLOCK_K/2) fp32 registers and are reduced across K once, at the end."""
    HALF: tl.constexpr = BLOCK_K // 2
    KB: tl.constexpr = K // 2
    BN: tl.constexpr = offs_n.shape[0]
    offs_j = tl.arange(0, HALF)
    w_rows = offs_n[:, None] * KB  # (BN, 1)
    part_a = tl.zeros((BN, HALF), tl.float32)
    part_b = tl.zeros((BN, HALF), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_kb = k0 // 2 + offs_j  # (HALF,)
        k_mask = offs_kb < KB
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # (BK,) coalesced
        x_even, x_odd = tl.split(tl.reshape(xk, (HALF, 2)))  # (HALF,) each
        wm = n_mask[:, None] & k_mask[None, :]
        w_off = w_rows + offs_kb[None, :]  # (BN, HALF)
        lo, hi = nibbles_f32(tl.load(wa_base + w_off, mask=wm, other=0))  # (BN, HALF) fp32
        prod = lo * x_even[None, :] + hi * x_odd[None, :]  # (BN, HALF)
        if TILE_SCALE:
            part_a += _scale_tile(prod, sa_base, offs_n, n_mask, k0, NB, QBLOCK, GROUPS)
        else:
            s_off = offs_n[:, None] * NB + (2 * offs_kb[None, :]) // QBLOCK  # (BN, HALF)
            part_a += prod * tl.load(sa_base + s_off, mask=wm, other=0.0).to(tl.float32)
        if DUAL:
            lo, hi = nibbles_f32(tl.load(wb_base + w_off, mask=wm, other=0))
            prod = lo * x_even[None, :] + hi * x_odd[None, :]
            if TILE_SCALE:
                part_b += _scale_tile(prod, sb_base, offs_n, n_mask, k0, NB, QBLOCK, GROUPS)
            else:
                part_b += prod * tl.load(sb_base + s_off, mask=wm, other=0.0).to(tl.float32)
    acc_a += tl.sum(part_a, axis=1)
    if DUAL:
        acc_b += tl.sum(part_b, axis=1)
    return acc_a, acc_b


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in fp32 (caller rounds the result to fp16)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def gemv_row_sums(w, x_ptr, w_rows, n_mask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (BN,) = sum_k x[k] w[n, k] over K for the rows whose K-contiguous weights start at ``w_rows`` (BN, 1)
    pointers; ``w`` is their first BLOCK_K columns (BN, BK) fp16, already loaded (a chained kernel reads it before its
    wait: no kernel writes weights). Products summed per lane in fp32, reduced once."""
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)  # (BK,)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]  # (BN, BK)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)  # (BK,)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def gated_shared_down(gu_ptr, w_ptr, offs_n, n_mask, I: tl.constexpr, BLOCK_K: tl.constexpr):
    """A shared expert's down projection of one token for rows ``offs_n`` (BN,), gated: fp32 (BN,) =
    sigmoid(gu[2 I]) * fp16(sum_k a[k] w[n, k]), a = fp16(silu(gu[k]) * gu[I + k]): the torch path's roundings.
    gu fp16 (2 I + 1,) = gate projection | up projection | the shared expert gate's logit; w fp16 (N, I)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((offs_n.shape[0], BLOCK_K), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = (k0 + offs_k) < I
        g = tl.load(gu_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # (BK,)
        u = tl.load(gu_ptr + I + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g) * u).to(tl.float16).to(tl.float32)  # the torch path's fp16 activation
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * I + k0 + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK) fp16
        acc += w.to(tl.float32) * a[None, :]
    s = tl.sum(acc, axis=1).to(tl.float16).to(tl.float32)  # (BN,) the down projection's fp16 output
    return tl.sigmoid(tl.load(gu_ptr + 2 * I).to(tl.float32)) * s
