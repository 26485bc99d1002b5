"""Fused Triton ops for the CUDA forward pass (a batch-1 decode step is launch-bound):

* ``qk_norm_rope_kv``: attention prologue, q/k RMSNorm + RoPE + KV-cache write in one launch;
* ``add_rms_norm``: residual add + RMSNorm in one launch;
* ``route_fused``: router logits (FP32) + softmax + top-k in one launch;
* ``decode_attention``: attention of one new token per row over its KV slots (masks from slot / pad);
  ``decode_attention_with_prologue`` folds the prologue into it for a decode step;
* ``add_norm_router_logits``: the norm before the MoE block and the router's logits in one launch (decode);
* ``gemv``: the dense fp16 projections (q|k|v, o) of one token (and ``shared_expert_one_row``, a shared expert's);
* ``silu_mul_rows`` and ``shared_gate_add``: a shared expert of several rows between its two GEMMs (op "shared").

Each computes what the torch path of ``runmap.engine.model`` computes (tests/test_model_fused.py compares them).

Why the prologue: a batch-1 decode step is launch-bound. In plain torch the prologue of one attention layer (two
RMSNorms over the full q and k projections, RoPE on q and k, two index_copy_ into the KV cache) is ~35
small kernels; 16 layers make it the largest share of the step. This kernel does it in one launch per
layer with the same arithmetic as ``runmap.engine.model`` (FP32 math; the RMSNorm output rounded to FP16 before
RoPE, as the torch path does; RoPE in the rotate-half form).

One program per token row m = b * T + t of the fused qkv projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runmap.kernels import common
from runmap.kernels.core import chain_wait, gated_shared_down, gemv_row_sums, silu_mul


@triton.jit
def _rms_factor(x1, x2, n_heads, HALF: tl.constexpr, eps):
    """1 / rms of a projection loaded as (heads, HALF) halves x1, x2 (fp32, zeros outside)."""
    ss = tl.sum(tl.sum(x1 * x1 + x2 * x2, axis=1), axis=0)
    return 1.0 / tl.sqrt(ss / (n_heads * 2 * HALF) + eps)


@triton.jit
def _norm_rope_head(base_ptr, w_ptr, offs_h, offs_d, n_heads, head, HALF: tl.constexpr, cos, sin, eps,
                    HAS_NORM: tl.constexpr):
    """``_norm_rope_rows`` of one head only (the norm still spans every head): (HALF,) fp16 halves, same values."""
    d_ok = offs_d < HALF
    src = base_ptr + head * (2 * HALF) + offs_d
    x1 = tl.load(src, mask=d_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
        idx = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        r = _rms_factor(tl.load(base_ptr + idx, mask=mask, other=0.0).to(tl.float32),
                        tl.load(base_ptr + idx + HALF, mask=mask, other=0.0).to(tl.float32), n_heads, HALF, eps)
        w1 = tl.load(w_ptr + head * (2 * HALF) + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + head * (2 * HALF) + offs_d + HALF, mask=d_ok, other=0.0).to(tl.float32)
        x1 = (x1 * r * w1).to(tl.float16).to(tl.float32)
        x2 = (x2 * r * w2).to(tl.float16).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return o1.to(tl.float16), o2.to(tl.float16)


@triton.jit
def _norm_rope_rows(base_ptr, w_ptr, offs_h, offs_d, n_heads, HALF: tl.constexpr, cos, sin, eps,
                    HAS_NORM: tl.constexpr):
    """Load (n_heads, D) of one projection as two halves, RMSNorm over all of it (optional), rotate."""
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    idx = offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # first half of each head
    x1 = tl.load(base_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + idx + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = _rms_factor(x1, x2, n_heads, HALF, eps)
        w1 = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + idx + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = (x1 * r * w1).to(tl.float16).to(tl.float32)  # the torch path stores the norm output as fp16
        x2 = (x2 * r * w2).to(tl.float16).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return o1.to(tl.float16), o2.to(tl.float16), mask


# T (positions per row) changes with every prompt length: not specialized, so no length compiles a variant of its own
@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_kv_kernel(
    qkv_ptr, stride_qkv_m,
    qw_ptr, kw_ptr,
    pos_ptr, slots_ptr, inv_freq_ptr,
    q_out_ptr,
    k_cache_ptr, v_cache_ptr, stride_cb, stride_ch, stride_cs,
    T, eps,
    NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
    NH_P2: tl.constexpr, NKV_P2: tl.constexpr, HALF_P2: tl.constexpr, HAS_NORM: tl.constexpr,
):
    m = tl.program_id(0)
    part = tl.program_id(1)  # 0: q; 1: k and v (two programs per token: at decode one program did both, serially)
    b = m // T
    t = m % T
    pos = tl.load(pos_ptr + m).to(tl.float32)
    slot = tl.load(slots_ptr + t)
    offs_d = tl.arange(0, HALF_P2)
    freq = tl.load(inv_freq_ptr + offs_d, mask=offs_d < HALF, other=0.0)
    ang = pos * freq
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    row = qkv_ptr + m * stride_qkv_m

    if part == 0:
        offs_h = tl.arange(0, NH_P2)
        q1, q2, mq = _norm_rope_rows(row, qw_ptr, offs_h, offs_d, NH, HALF, cos, sin, eps, HAS_NORM)
        q_dst = q_out_ptr + ((b * NH + offs_h[:, None]) * T + t) * (2 * HALF) + offs_d[None, :]  # (B, nh, T, D)
        tl.store(q_dst, q1, mask=mq)
        tl.store(q_dst + HALF, q2, mask=mq)
    else:
        offs_k = tl.arange(0, NKV_P2)
        k1, k2, mk = _norm_rope_rows(row + NH * 2 * HALF, kw_ptr, offs_k, offs_d, NKV, HALF, cos, sin, eps,
                                     HAS_NORM)
        c_off = b * stride_cb + offs_k[:, None] * stride_ch + slot * stride_cs + offs_d[None, :]
        tl.store(k_cache_ptr + c_off, k1, mask=mk)
        tl.store(k_cache_ptr + c_off + HALF, k2, mask=mk)
        v_src = row + (NH + NKV) * 2 * HALF + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(v_cache_ptr + c_off, tl.load(v_src, mask=mk, other=0.0), mask=mk)
        tl.store(v_cache_ptr + c_off + HALF, tl.load(v_src + HALF, mask=mk, other=0.0), mask=mk)


def _check_norms_and_cache(q_norm, k_norm, k_cache, v_cache, B: int, nkv: int, D: int) -> None:
    """The prologue's q/k norm weights (both or neither) and one layer's k/v cache views fit B rows of nkv x D."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: give both or neither")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache / v_cache: same shape and strides with a contiguous last dim required, got "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} / {tuple(v_cache.shape)} {v_cache.stride()}")
    if k_cache.shape[0] < B or k_cache.shape[1] != nkv or k_cache.shape[3] != D:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not fit B={B}, nkv={nkv}, D={D}")


def qk_norm_rope_kv(qkv, q_norm, k_norm, positions, slots, inv_freq, k_cache, v_cache, *, num_heads, num_kv_heads,
                    eps):
    """Fused attention prologue.

    qkv       float16 (B, T, (nh + 2 nkv) * D), last dim contiguous: the fused q|k|v projection (bias added)
    q_norm    float16 (nh * D,) or None; k_norm float16 (nkv * D,) or None (both or neither: OLMoE q/k norm)
    positions int64 (B, T) RoPE positions; slots int64 (T,) KV slots of the T tokens
    inv_freq  float32 (D / 2,)
    k_cache, v_cache  float16 (B, nkv, S, D) views of one layer of the KV cache (last dim contiguous)
    Returns q float16 (B, nh, T, D) (normed, rotated); k (normed, rotated) and v are written into the caches.
    """
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    if (num_heads + 2 * num_kv_heads) * D != width or D % 2:
        raise ValueError(f"qkv: width {width} is not (nh + 2 nkv) * D for nh={num_heads}, nkv={num_kv_heads}")
    if qkv.dtype != torch.float16 or qkv.stride(-1) != 1 or qkv.stride(0) != T * qkv.stride(1):
        raise ValueError(f"qkv: expected float16 with contiguous rows, got {qkv.dtype} strides {qkv.stride()}")
    _check_norms_and_cache(q_norm, k_norm, k_cache, v_cache, B, num_kv_heads, D)
    positions = positions.contiguous()
    q = torch.empty(B, num_heads, T, D, dtype=torch.float16, device=qkv.device)
    has_norm = q_norm is not None
    half = D // 2
    common.launch(_qk_norm_rope_kv_kernel[(B * T, 2)],
        qkv, qkv.stride(1),
        q_norm if has_norm else qkv, k_norm if has_norm else qkv,
        positions, slots, inv_freq,
        q,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        T, eps,
        NH=num_heads, NKV=num_kv_heads, HALF=half,
        NH_P2=triton.next_power_of_2(num_heads), NKV_P2=triton.next_power_of_2(num_kv_heads),
        HALF_P2=triton.next_power_of_2(half), HAS_NORM=has_norm,
    )
    return q


# ---- residual add + RMSNorm -------------------------------------------------------------------------

@triton.jit
def _added(x_ptr, y_ptr, offs, mask, HAS_Y: tl.constexpr):
    """x[offs] (+ y[offs] when HAS_Y), fp16: the residual add, as the torch path adds (in fp16)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_Y:
        x = x + tl.load(y_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _inv_rms(x32, N, eps):
    """1 / rms of a whole row held as fp32 (zeros past N)."""
    return 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, x_out_ptr, h_out_ptr, N, eps,
                         HAS_Y: tl.constexpr, BLOCK_N: tl.constexpr, CHAINED: tl.constexpr = False):
    m = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    w = tl.load(w_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)  # the norm's weight: no kernel writes it
    chain_wait(CHAINED)
    x = _added(x_ptr, y_ptr, m * N + offs_n, mask, HAS_Y)
    if HAS_Y:
        tl.store(x_out_ptr + m * N + offs_n, x, mask=mask)
    x32 = x.to(tl.float32)
    r = _inv_rms(x32, N, eps)
    tl.store(h_out_ptr + m * N + offs_n, (x32 * r * w).to(tl.float16), mask=mask)


def add_rms_norm(x, y, w, eps):
    """x fp16 (..., N) contiguous, y fp16 like x or None, w fp16 (N,).
    Returns (x + y fp16, rms_norm(x + y) * w fp16); with y None returns (x, rms_norm(x) * w)."""
    n = x.shape[-1]
    if x.dtype != torch.float16 or not x.is_contiguous() or (y is not None and (y.shape != x.shape or
                                                                               not y.is_contiguous())):
        raise ValueError(f"add_rms_norm: x / y must be contiguous float16 of one shape, got {x.dtype} {tuple(x.shape)}")
    m = x.numel() // n
    h = torch.empty_like(x)
    x_out = torch.empty_like(x) if y is not None else x
    common.launch(_add_rms_norm_kernel[(m,)], x, y if y is not None else x, w, x_out, h, n, eps,
                  HAS_Y=y is not None, BLOCK_N=triton.next_power_of_2(n), **common.chained(x.device))
    return x_out, h


# ---- router: logits (FP32) + softmax + top-k ----------------------------------------------------------
# Two launches: many programs stream the FP32 router weight (a single program reading all of it measured
# 83 us per call on the H200), then one tiny program per token row does softmax + top-k.

@triton.jit
def _router_logits_kernel(h_ptr, w_ptr, logits_ptr, E, H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          CHAINED: tl.constexpr = False):
    chain_wait(CHAINED)
    m = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # (BE,) experts of this program
    e_mask = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hm = (h0 + offs_h) < H
        x = tl.load(h_ptr + m * H + h0 + offs_h, mask=hm, other=0.0).to(tl.float32)  # (BH,)
        w = tl.load(w_ptr + offs_e[:, None] * H + h0 + offs_h[None, :], mask=e_mask[:, None] & hm[None, :],
                    other=0.0)  # (BE, BH) fp32
        acc += w * x[None, :]
    tl.store(logits_ptr + m * E + offs_e, tl.sum(acc, axis=1), mask=e_mask)


# rows from which the router's logits are one FP32 GEMM (long prefill passes) instead of a program per row
ROUTER_ROWS_MIN = 1024


@triton.jit
def _row_softmax(logits_ptr, m, E, E_P2: tl.constexpr):
    """Row m of fp32 logits (E per row): (its softmax fp32 (E_P2,), 0 past E; offs_e (E_P2,))."""
    offs_e = tl.arange(0, E_P2)
    logits = tl.load(logits_ptr + m * E + offs_e, mask=offs_e < E, other=float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    return p / tl.sum(p, axis=0), offs_e


@triton.jit
def _router_topk_kernel(logits_ptr, ids_ptr, wts_ptr, E, TOPK: tl.constexpr, NORM: tl.constexpr, E_P2: tl.constexpr,
                        CHAINED: tl.constexpr = False):
    chain_wait(CHAINED)
    m = tl.program_id(0)
    p, offs_e = _row_softmax(logits_ptr, m, E, E_P2)  # (E_P2,) softmax over experts
    offs_k = tl.arange(0, TOPK)
    ids = tl.zeros((TOPK,), tl.int64)
    wts = tl.zeros((TOPK,), tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs_e, E_P2), axis=0)  # lowest id among equal probabilities
        ids = tl.where(offs_k == j, idx.to(tl.int64), ids)
        wts = tl.where(offs_k == j, best, wts)
        p = tl.where(offs_e == idx, -1.0, p)
    if NORM:
        wts = wts / tl.sum(wts, axis=0)
    tl.store(ids_ptr + m * TOPK + offs_k, ids)
    tl.store(wts_ptr + m * TOPK + offs_k, wts)


# ---- gate weights of imposed expert ids (routing workloads) -------------------------------------------
# Under a routing workload (runmap.workload.routing) the ids come from the workload and the router only weighs them:
# softmax over the row's logits, the probabilities of the imposed ids, rescaled to the sum of the router's own
# top-k probabilities (1 under norm_topk_prob). In torch that is ~7 launches per MoE layer inside a captured step;
# here it is one, fed by the same logits as the router's own top-k (an A/B on an H100 took 0.39 ms off a 1.25 ms
# OLMoE full-residency step: results/campaigns/h100-imposed-fused).

@triton.jit
def _imposed_weights_kernel(logits_ptr, ids_ptr, wts_ptr, E, TOPK: tl.constexpr, NORM: tl.constexpr,
                            E_P2: tl.constexpr, CHAINED: tl.constexpr = False):
    chain_wait(CHAINED)
    m = tl.program_id(0)
    p, offs_e = _row_softmax(logits_ptr, m, E, E_P2)  # (E_P2,) softmax over experts, 0 past E
    offs_k = tl.arange(0, TOPK)
    ids = tl.load(ids_ptr + m * TOPK + offs_k)  # (TOPK,) int64 in [0, E): the caller checked them
    # the probability of each imposed id: a (TOPK, E_P2) selection summed over experts
    w = tl.sum(tl.where(ids[:, None] == offs_e[None, :], p[None, :], 0.0), axis=1)  # (TOPK,)
    if NORM:
        own = 1.0
    else:  # the router's own top-k probabilities' sum: TOPK rounds of the row's maximum, as _router_topk_kernel
        own = 0.0
        q = p
        for j in tl.static_range(TOPK):
            best = tl.max(q, axis=0)
            own += best
            idx = tl.min(tl.where(q == best, offs_e, E_P2), axis=0)
            q = tl.where(offs_e == idx, -1.0, q)
    tl.store(wts_ptr + m * TOPK + offs_k, w * (own / tl.sum(w, axis=0)))


# ---- residual add + RMSNorm + router logits in one launch (decode) --------------------------------------
# A decode step ran add_rms_norm and then the logits kernel for the same row: two launches of ~2 us of latency
# each for a few KB of activations. Here each (row, block of experts) program recomputes the row's add + norm
# (8 KB from L2; no program waits for another) and program 0 of the row stores x + y and the norm; the logits are
# then summed in the same chunks and order as _router_logits_kernel, so both paths give the same FP32 logits.

@triton.jit
def _add_norm_router_kernel(x_ptr, y_ptr, nw_ptr, rw_ptr, x_out_ptr, h_out_ptr, logits_ptr, E, eps,
                            H: tl.constexpr, H_P2: tl.constexpr, HAS_Y: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHAINED: tl.constexpr = False):
    m = tl.program_id(0)
    eb = tl.program_id(1)
    offs_n = tl.arange(0, H_P2)
    mask = offs_n < H
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)  # (BE,)
    e_mask = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    # weights no kernel writes, read before the wait: the norm's (the whole row; only program 0 of the row uses it)
    # and the router's first H chunk
    nw = tl.load(nw_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    w_first = tl.load(rw_ptr + offs_e[:, None] * H + offs_h[None, :], mask=e_mask[:, None] & (offs_h < H)[None, :],
                      other=0.0)  # (BE, BH) fp32
    chain_wait(CHAINED)
    x = _added(x_ptr, y_ptr, m * H + offs_n, mask, HAS_Y)  # (H_P2,) fp16
    x32 = x.to(tl.float32)
    r = _inv_rms(x32, H, eps)  # the same reduction as _add_rms_norm_kernel
    if eb == 0:
        if HAS_Y:
            tl.store(x_out_ptr + m * H + offs_n, x, mask=mask)
        tl.store(h_out_ptr + m * H + offs_n, (x32 * r * nw).to(tl.float16), mask=mask)
    # chunks of the normed row, recomputed elementwise as above; the first with the router weights read ahead
    hm = offs_h < H
    xc = _added(x_ptr, y_ptr, m * H + offs_h, hm, HAS_Y)
    nwc = tl.load(nw_ptr + offs_h, mask=hm, other=0.0).to(tl.float32)
    hc = (xc.to(tl.float32) * r * nwc).to(tl.float16).to(tl.float32)  # (BH,) the stored fp16 norm output
    acc = w_first * hc[None, :]  # (BE, BH)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        hm = (h0 + offs_h) < H
        xc = _added(x_ptr, y_ptr, m * H + h0 + offs_h, hm, HAS_Y)
        nwc = tl.load(nw_ptr + h0 + offs_h, mask=hm, other=0.0).to(tl.float32)
        hc = (xc.to(tl.float32) * r * nwc).to(tl.float16).to(tl.float32)  # (BH,) the stored fp16 norm output
        w = tl.load(rw_ptr + offs_e[:, None] * H + h0 + offs_h[None, :], mask=e_mask[:, None] & hm[None, :],
                    other=0.0)  # (BE, BH) fp32
        acc += w * hc[None, :]
    tl.store(logits_ptr + m * E + offs_e, tl.sum(acc, axis=1), mask=e_mask)


# rows up to which the model runs add + norm + router logits as one launch (each program re-reads its row: right for
# decode steps and small batches, not for prefill passes)
NORM_ROUTER_MAX_ROWS = 64


def add_norm_router_logits(x, y, norm_w, router32, eps):
    """Residual add + RMSNorm + FP32 router logits of the normed rows, one launch.

    Args:
        x: fp16 (..., H) contiguous. y: fp16 like x, or None (then the norm of x alone). norm_w: fp16 (H,).
        router32: fp32 (E, H) contiguous.
    Returns:
        (x + y fp16 like x (x itself when y is None), rms_norm(x + y) * norm_w fp16 like x, logits fp32 (M, E)),
        M = x.numel() / H; the same values as ``add_rms_norm`` followed by the logits of ``route_fused``.
    """
    hid = x.shape[-1]
    e = router32.shape[0]
    if x.dtype != torch.float16 or not x.is_contiguous() or (y is not None and (y.shape != x.shape or
                                                                               not y.is_contiguous())):
        raise ValueError(f"add_norm_router_logits: x / y must be contiguous float16 of one shape, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if router32.dtype != torch.float32 or tuple(router32.shape) != (e, hid) or not router32.is_contiguous():
        raise ValueError(f"add_norm_router_logits: router must be contiguous float32 (E, {hid}), got "
                         f"{router32.dtype} {tuple(router32.shape)}")
    m = x.numel() // hid
    h = torch.empty_like(x)
    x_out = torch.empty_like(x) if y is not None else x
    logits = torch.empty(m, e, dtype=torch.float32, device=x.device)
    block_e = 2
    common.launch(_add_norm_router_kernel[(m, triton.cdiv(e, block_e))], x, y if y is not None else x, norm_w,
                  router32, x_out, h, logits, e, eps, H=hid, H_P2=triton.next_power_of_2(hid), HAS_Y=y is not None,
                  BLOCK_E=block_e, BLOCK_H=_router_block_h(hid), **common.chained(x.device))
    return x_out, h, logits


# Row chunks wide enough that a program loads all of its weights before its wait (chain_wait), so after it only the
# activations are read: the router launches sum a row of up to 2,048 in one chunk (OLMoE's and Qwen1.5-MoE's whole
# hidden size; the second of two 1,024 chunks was read after the wait), and the one-row GEMV of a projection narrower
# than 4,096 (the o projection) takes K chunks of 2,048 (512 before: three of its four chunks after the wait). In one
# H100 call, default first and last: OLMoE batch 1 1,172.1 / 1,174.4 -> 1,199.9 tok/s, Qwen1.5-MoE 547.5 / 547.5 ->
# 555.0, the GEMV chunk alone 1,186.8 and 550.0 (results/campaigns/h100-gemv-router-preload). The sums run in another
# order than with the narrow chunks (FP32; within rounding). Module constants so tests can sweep the narrow ones.
ROUTER_BLOCK_H_MAX = 2048
GEMV_NARROW_BLOCK_K = 2048


def _router_block_h(hid: int) -> int:
    return min(ROUTER_BLOCK_H_MAX, triton.next_power_of_2(hid))


def _one_warp(device) -> dict:
    """Launch options of a tiny program (a few hundred values): one warp, so its reductions (top-k: 2 per expert
    chosen) stay within the warp instead of crossing warps through shared memory and barriers."""
    return {} if common.interpreting(device) else {"num_warps": 1}


def route_topk(logits, top_k: int, norm_topk_prob: bool):
    """logits fp32 (N, E) contiguous -> ids int64 (N, k), weights fp32 (N, k): softmax + top-k as ``route_fused``."""
    n, e = logits.shape
    if top_k & (top_k - 1) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"route_topk: needs a power-of-two top_k ({top_k}) and contiguous fp32 logits "
                         f"({logits.dtype})")
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    wts = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    common.launch(_router_topk_kernel[(n,)], logits, ids, wts, e, TOPK=top_k, NORM=norm_topk_prob,
                  E_P2=triton.next_power_of_2(e), **_one_warp(logits.device), **common.chained(logits.device))
    return ids, wts


def imposed_weights_from_logits(logits, ids, top_k: int, norm_topk_prob: bool):
    """Gate weights of imposed expert ids, one launch (``runmap.engine.model.imposed_weights`` on logits already
    computed, e.g. by ``add_norm_router_logits``).

    Args:
        logits: fp32 (N, E) contiguous, the router's logits of the N rows.
        ids: int64 (N, k) contiguous on the logits' device, k = top_k, each in [0, E) (not checked here: a captured
            step cannot read them back; the workload draws them in range and the experts' call checks them).
        top_k: the family's top-k, a power of two (the router's own top-k sum is taken over top_k experts).
        norm_topk_prob: the family's flag (the rescaling target is 1 when set, else the router's own top-k sum).
    Returns:
        fp32 (N, k): softmax(logits)[ids] * own / sum over k of softmax(logits)[ids].
    """
    n, e = logits.shape
    k = top_k
    if k < 1 or k & (k - 1) or logits.dtype != torch.float32 or not logits.is_contiguous() \
            or ids.dtype != torch.int64 or tuple(ids.shape) != (n, k) or not ids.is_contiguous() \
            or ids.device != logits.device:
        raise ValueError(f"imposed_weights_from_logits: needs contiguous fp32 logits (N, E) ({logits.dtype} "
                         f"{tuple(logits.shape)}, {logits.device}) and contiguous int64 ids (N, top_k) on the same "
                         f"device, top_k a power of two ({ids.dtype} {tuple(ids.shape)}, {ids.device}, top_k {top_k})")
    wts = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    common.launch(_imposed_weights_kernel[(n,)], logits, ids, wts, e, TOPK=k, NORM=norm_topk_prob,
                  E_P2=triton.next_power_of_2(e), **_one_warp(logits.device), **common.chained(logits.device))
    return wts


def router_logits(h, router32):
    """h fp16 (N, H) contiguous, router32 fp32 (E, H) contiguous -> fp32 logits (N, E): the logits ``route_fused``
    takes its top-k of (a program per row and pair of experts, or one FP32 GEMM from ROUTER_ROWS_MIN rows)."""
    n, hid = h.shape
    e = router32.shape[0]
    if h.dtype != torch.float16 or not h.is_contiguous() or router32.dtype != torch.float32 \
            or tuple(router32.shape) != (e, hid) or not router32.is_contiguous():
        raise ValueError(f"router_logits: needs contiguous fp16 h (N, H) ({h.dtype} {tuple(h.shape)}) and a contiguous "
                         f"fp32 router (E, H) ({router32.dtype} {tuple(router32.shape)})")
    logits = torch.empty(n, e, dtype=torch.float32, device=h.device)
    if n >= ROUTER_ROWS_MIN:
        # one FP32 GEMM (cuBLAS; TF32 stays off unless the process turned it on): the rows kernel measured ~7 TFLOP/s
        # here, 5.0 ms of an 8,192-token prefill on the H200 (results/campaigns/h200-floor)
        torch.mm(h.float(), router32.t(), out=logits)  # (n, E) fp32
    else:
        block_e = 2
        common.launch(_router_logits_kernel[(n, triton.cdiv(e, block_e))], h, router32, logits, e, H=hid,
                      BLOCK_E=block_e, BLOCK_H=_router_block_h(hid), **common.chained(h.device))
    return logits


def route_fused(h, router32, top_k: int, norm_topk_prob: bool):
    """h fp16 (N, H) contiguous, router32 fp32 (E, H) -> ids int64 (N, k), weights fp32 (N, k) (descending).
    top_k must be a power of two (OLMoE 8, Qwen1.5-MoE 4); the model uses the torch router otherwise."""
    if top_k & (top_k - 1):  # h and the router are checked by router_logits
        raise ValueError(f"route_fused: needs a power-of-two top_k ({top_k})")
    return route_topk(router_logits(h, router32), top_k, norm_topk_prob)


# ---- decode attention (one new token per row) -----------------------------------------------------------

@triton.jit
def _split_keys(slot, pad, sp, N_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Split ``sp``'s share of a row's keys pad .. slot (capped by the bucket N_KEYS): (first key n0, end), the row's
    blocks dealt to the splits in contiguous, block-aligned runs from its first block; and ``covered``: whether some
    split's share holds the slot itself (not when the slot is past the bucket or before the pad's block)."""
    hi = tl.minimum(slot + 1, N_KEYS)
    lo = (pad // BLOCK_N) * BLOCK_N
    per_split = ((hi - lo + BLOCK_N - 1) // BLOCK_N + SPLITS - 1) // SPLITS * BLOCK_N  # keys per split, whole blocks
    n0 = lo + sp * per_split
    return n0, tl.minimum(hi, n0 + per_split), (lo <= slot) & (slot < N_KEYS)


@triton.jit
def _preload_first_block(k_ptr, v_ptr, slot, pad, sp, base, stride_cs, offs_d, d_ok, N_KEYS: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Split ``sp``'s first key block of k and v (BLOCK_N, D_P2) fp16 as ``_attend_split`` reads it, except the new
    slot's row (zeros): the keys before the slot were written by earlier steps, so a chained launch reads them before
    its wait, while the launch before it (the q|k|v projection) still runs; this launch writes the new slot itself."""
    n0, end, _covered = _split_keys(slot, pad, sp, N_KEYS, BLOCK_N, SPLITS)
    j = n0 + tl.arange(0, BLOCK_N)
    ok = ((j >= pad) & (j < end) & (j != slot))[:, None] & d_ok[None, :]
    off = base + j[:, None] * stride_cs + offs_d[None, :]
    return tl.load(k_ptr + off, mask=ok, other=0.0), tl.load(v_ptr + off, mask=ok, other=0.0)


@triton.jit
def _attend_split(q, k_ptr, v_ptr, part_ptr, ml_ptr, b, hq, sp, slot, pad, base, stride_cs, offs_d, d_ok,
                  N_KEYS: tl.constexpr, NH: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLITS: tl.constexpr, k_pre, v_pre, PRELOADED: tl.constexpr):
    """Online softmax of q (D_P2,) fp32 (scaled) over split ``sp``'s share of the keys pad .. slot of row b's cache
    (base: offset of the row's kv head); writes the unnormalized output to part[b, hq, sp] and (running max, sum of
    exponentials) to ml[b, hq, sp]. PRELOADED: k_pre / v_pre (BLOCK_N, D_P2) fp16 are the split's first key block as
    ``_preload_first_block`` read it (the new slot's row left out); only that row is read again here."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full((), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((D_P2,), dtype=tl.float32)
    # Only the blocks that hold this row's keys (pad .. slot) are visited: a served batch's rows share slots, so a
    # row that joined late has a large pad and its slots before it are another request's past (or nothing). The
    # bounds are read from device memory, so a captured CUDA graph stays valid for every slot and pad; N_KEYS (the
    # bucket) only caps the end. The row's blocks are dealt to the splits in contiguous, block-aligned runs.
    # (While loops: the interpreter cannot take loaded scalars as range() bounds.)
    n0, end, _covered = _split_keys(slot, pad, sp, N_KEYS, BLOCK_N, SPLITS)
    n_first = n0
    while n0 < end:
        j = n0 + offs_n
        valid = (j >= pad) & (j < end)  # end <= slot + 1 and <= N_KEYS: never a key past the bucket
        kv_off = base + j[:, None] * stride_cs + offs_d[None, :]
        kv_ok = valid[:, None] & d_ok[None, :]
        if PRELOADED:  # the first block from the preload but for the new slot's row; later blocks from memory
            fresh = (n0 != n_first) | (j == slot)  # (BLOCK_N,)
            k = tl.load(k_ptr + kv_off, mask=kv_ok & fresh[:, None], other=0.0)
            k = tl.where(fresh[:, None], k, k_pre).to(tl.float32)  # (BLOCK_N, D_P2)
        else:
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # (BLOCK_N, D_P2)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))  # (BLOCK_N,)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key in the block yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        if PRELOADED:
            v = tl.load(v_ptr + kv_off, mask=kv_ok & fresh[:, None], other=0.0)
            v = tl.where(fresh[:, None], v, v_pre).to(tl.float32)
        else:
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        n0 += BLOCK_N
    row = (b * NH + hq) * SPLITS + sp
    tl.store(part_ptr + row * D_P2 + offs_d, acc)  # an empty split stores zeros, max -inf, sum 0
    tl.store(ml_ptr + row * 2, m_i)
    tl.store(ml_ptr + row * 2 + 1, l_i)


@triton.jit
def _decode_attn_split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, slot_ptr, pad_ptr,
                              stride_cb, stride_ch, stride_cs, scale,
                              N_KEYS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                              D_P2: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                              CHAINED: tl.constexpr = False):
    """One (row, query head, split): ``_attend_split`` of the row's q.

    Why splits: one program per (row, head) kept 16 of the H200's 132 SMs busy at batch 1 and walked the keys
    serially (a while loop is not software-pipelined): 12.9 us per layer for <= 256 keys (the decode profile in
    results/campaigns/h200-prefill). D_P2: the head dim rounded up to a power of two (tl.arange needs one;
    Qwen3-style configs may use e.g. 96), lanes from D masked off."""
    chain_wait(CHAINED)
    b = tl.program_id(0)
    hq = tl.program_id(1)
    sp = tl.program_id(2)
    hk = hq // (NH // NKV)
    offs_d = tl.arange(0, D_P2)
    d_ok = offs_d < D
    q = tl.load(q_ptr + (b * NH + hq) * D + offs_d, mask=d_ok, other=0.0).to(tl.float32) * scale  # (D_P2,)
    _attend_split(q, k_ptr, v_ptr, part_ptr, ml_ptr, b, hq, sp, tl.load(slot_ptr), tl.load(pad_ptr + b),
                  b.to(tl.int64) * stride_cb + hk * stride_ch, stride_cs, offs_d, d_ok, N_KEYS, NH, D_P2, BLOCK_N,
                  SPLITS, q, q, False)  # nothing preloaded (q stands in for the unused tiles)


@triton.jit
def _decode_attn_prologue_split_kernel(
    qkv_ptr, stride_qkv_b, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr,
    k_ptr, v_ptr, part_ptr, ml_ptr, slot_ptr, pad_ptr, stride_cb, stride_ch, stride_cs, scale, eps,
    N_KEYS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
    NH_P2: tl.constexpr, NKV_P2: tl.constexpr, HALF_P2: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, CHAINED: tl.constexpr = False):
    """``_decode_attn_split_kernel`` with the attention prologue (``_qk_norm_rope_kv_kernel``) folded in, for one new
    token per row. Each program normalizes (the norm spans every head: the whole q row is summed, as the prologue
    sums it) and rotates its own head of q; the program whose split holds the new slot also normalizes and rotates
    k, writes its kv head's k and v into the cache (programs of query heads sharing that kv head write the same
    values) and, after a barrier, attends it from the cache like every other key. Other programs never read the new
    slot, so no program waits for another. Same values as the two launches: the prologue's arithmetic, then the
    unchanged key loop. (A first version rotated every head in every program: at batch 8 the launch took 297 us per
    step against 220 for the two it replaced; results/campaigns/h200-decode.)
    Before ``chain_wait`` (while the q|k|v projection still runs, in a chained step) it reads the slot, the row's pad
    and its split's first block of earlier keys: written by the host's copies and by earlier steps, never by the
    launch before this one."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    sp = tl.program_id(2)
    hk = hq // (NH // NKV)
    slot = tl.load(slot_ptr)
    pad = tl.load(pad_ptr + b)
    base = b.to(tl.int64) * stride_cb + hk * stride_ch  # int64: a large cache passes 2^31 elements
    D: tl.constexpr = 2 * HALF
    offs_dd = tl.arange(0, D)
    k_pre, v_pre = _preload_first_block(k_ptr, v_ptr, slot, pad, sp, base, stride_cs, offs_dd, offs_dd < D, N_KEYS,
                                        BLOCK_N, SPLITS)
    chain_wait(CHAINED)
    pos = tl.load(pos_ptr + b).to(tl.float32)
    offs_d = tl.arange(0, HALF_P2)
    d_ok = offs_d < HALF
    freq = tl.load(inv_freq_ptr + offs_d, mask=d_ok, other=0.0)
    ang = pos * freq
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    row = qkv_ptr + b * stride_qkv_b
    q1, q2 = _norm_rope_head(row, qw_ptr, tl.arange(0, NH_P2), offs_d, NH, hq, HALF, cos, sin, eps,
                             HAS_NORM)  # (HALF_P2,) fp16 each
    # the writer of the new k / v: the split whose share holds the slot (the only one that reads it), or split 0
    # where no share holds it (nothing attends it then; the separate prologue writes it all the same)
    n0, end, covered = _split_keys(slot, pad, sp, N_KEYS, BLOCK_N, SPLITS)
    if ((n0 <= slot) & (slot < end)) | ((sp == 0) & ~covered):
        k1, k2 = _norm_rope_head(row + NH * 2 * HALF, kw_ptr, tl.arange(0, NKV_P2), offs_d, NKV, hk, HALF, cos, sin,
                                 eps, HAS_NORM)
        c_off = base + slot * stride_cs + offs_d
        tl.store(k_ptr + c_off, k1, mask=d_ok)
        tl.store(k_ptr + c_off + HALF, k2, mask=d_ok)
        v_src = row + (NH + NKV + hk) * 2 * HALF + offs_d
        tl.store(v_ptr + c_off, tl.load(v_src, mask=d_ok, other=0.0), mask=d_ok)
        tl.store(v_ptr + c_off + HALF, tl.load(v_src + HALF, mask=d_ok, other=0.0), mask=d_ok)
    tl.debug_barrier()  # this program's cache writes are visible to all its threads before the key loop
    # q of this head as one (D,) vector, first half then second half as the cache lays out D (HALF is a power of
    # two here: the wrapper checks), scaled as _decode_attn_split_kernel scales the q it loads
    q = tl.reshape(tl.permute(tl.join(q1.to(tl.float32), q2.to(tl.float32)), (1, 0)), (D,)) * scale  # q1 then q2
    _attend_split(q, k_ptr, v_ptr, part_ptr, ml_ptr, b, hq, sp, slot, pad, base, stride_cs, offs_dd, offs_dd < D,
                  N_KEYS, NH, D, BLOCK_N, SPLITS, k_pre, v_pre, True)


@triton.jit
def _decode_attn_combine_kernel(part_ptr, ml_ptr, out_ptr, NH: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                                SPLITS: tl.constexpr, CHAINED: tl.constexpr = False):
    """One (row, query head): the splits' partial softmaxes rescaled to their common max and summed; fp16 out."""
    chain_wait(CHAINED)
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D_P2)
    rows = (b * NH + hq) * SPLITS + offs_s  # (SPLITS,)
    m = tl.load(ml_ptr + rows * 2)  # (SPLITS,) -inf for an empty split
    l = tl.load(ml_ptr + rows * 2 + 1)
    m_max = tl.max(m, axis=0)  # finite: the row's own slot is a key of some split
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # (SPLITS,)
    part = tl.load(part_ptr + rows[:, None] * D_P2 + offs_d[None, :])  # (SPLITS, D_P2)
    o = tl.sum(part * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # (D_P2,)
    tl.store(out_ptr + (b * NH + hq) * D + offs_d, o.to(tl.float16), mask=offs_d < D)


def attention_splits(n_keys: int) -> tuple[int, int]:
    """(BLOCK_N, SPLITS) of the split decode attention over a KV bucket of n_keys: up to 512 keys a block per split."""
    block_n = 32
    return block_n, min(16, triton.next_power_of_2(triton.cdiv(n_keys, block_n)))


def _split_buffers(B: int, nh: int, splits: int, d_p2: int, device):
    """The splits' partial outputs fp32 (B, nh, SPLITS, D_P2) and (max, sum) fp32 (B, nh, SPLITS, 2)."""
    return (torch.empty(B, nh, splits, d_p2, dtype=torch.float32, device=device),
            torch.empty(B, nh, splits, 2, dtype=torch.float32, device=device))


def _combine_splits(part, ml, D: int):
    """The combining launch: fp16 (B, 1, nh * D) from the splits' buffers (``_split_buffers``)."""
    B, nh, splits, d_p2 = part.shape
    out = torch.empty(B, 1, nh * D, dtype=torch.float16, device=part.device)
    common.launch(_decode_attn_combine_kernel[(B, nh)], part, ml, out, NH=nh, D=D, D_P2=d_p2, SPLITS=splits,
                  **_one_warp(out.device), **common.chained(out.device))
    return out


def decode_attention(q, k_cache, v_cache, slot, pad, n_keys: int):
    """Split-key decode attention: two launches, the splits and then their combination.

    Args:
        q: fp16 (B, nh, 1, D) contiguous. k_cache, v_cache: fp16 (B, nkv, S, D), last dim contiguous, same strides.
        slot: int64 (1,) the new token's KV slot. pad: int64 (B,) each row's first slot.
        n_keys: the KV bucket (a compile-time size); keys pad[b] .. slot within [0, n_keys) are attended.
    Returns:
        fp16 (B, 1, nh * D), heads concatenated, ready for o_proj.
    """
    B, nh, T, D = q.shape
    nkv = k_cache.shape[1]
    if T != 1 or not q.is_contiguous() or nh % nkv or k_cache.stride() != v_cache.stride():
        raise ValueError(f"decode_attention: q {tuple(q.shape)} (T must be 1, contiguous), nh % nkv, "
                         f"k/v strides {k_cache.stride()} / {v_cache.stride()}")
    block_n, splits = attention_splits(n_keys)
    d_p2 = triton.next_power_of_2(D)
    part, ml = _split_buffers(B, nh, splits, d_p2, q.device)
    common.launch(_decode_attn_split_kernel[(B, nh, splits)], q, k_cache, v_cache, part, ml, slot, pad,
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D ** -0.5,
                  N_KEYS=n_keys, NH=nh, NKV=nkv, D=D, D_P2=d_p2, BLOCK_N=block_n, SPLITS=splits,
                  **common.chained(q.device))
    return _combine_splits(part, ml, D)


def decode_attention_with_prologue(qkv, q_norm, k_norm, positions, slot, inv_freq, k_cache, v_cache, pad, n_keys: int,
                                   *, num_heads: int, num_kv_heads: int, eps: float):
    """``qk_norm_rope_kv`` and ``decode_attention`` of one new token per row, the prologue folded into the split
    launch (two launches instead of three; the same values).

    Args:
        qkv: fp16 (B, 1, (nh + 2 nkv) * D), rows contiguous: the fused q|k|v projection (bias added); D a power of two.
        q_norm, k_norm: fp16 (nh * D,) and (nkv * D,), or both None. positions: int64 (B, 1) RoPE positions.
        slot: int64 (1,) the new token's KV slot. inv_freq: fp32 (D / 2,).
        k_cache, v_cache: fp16 (B', nkv, S, D) views of one layer's cache (B' >= B), last dim contiguous, same strides.
        pad: int64 (B,) each row's first slot. n_keys: the KV bucket (a compile-time size).
    Returns:
        fp16 (B, 1, nh * D), heads concatenated; k and v of the new token are written at ``slot``.
    """
    B, T, width = qkv.shape
    nh, nkv = num_heads, num_kv_heads
    D = width // (nh + 2 * nkv)
    if T != 1 or (nh + 2 * nkv) * D != width or D < 2 or D & (D - 1) or nh % nkv:
        raise ValueError(f"decode_attention_with_prologue: qkv {tuple(qkv.shape)} needs T = 1 and width (nh + 2 nkv)"
                         f" * D with D a power of two (nh={nh}, nkv={nkv})")
    if qkv.dtype != torch.float16 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv: expected float16 with a contiguous last dim, got {qkv.dtype} strides {qkv.stride()}")
    _check_norms_and_cache(q_norm, k_norm, k_cache, v_cache, B, nkv, D)
    positions = positions.contiguous()
    block_n, splits = attention_splits(n_keys)
    part, ml = _split_buffers(B, nh, splits, D, qkv.device)
    has_norm = q_norm is not None
    half = D // 2
    common.launch(_decode_attn_prologue_split_kernel[(B, nh, splits)],
                  qkv, qkv.stride(0), q_norm if has_norm else qkv, k_norm if has_norm else qkv, positions, inv_freq,
                  k_cache, v_cache, part, ml, slot, pad, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  D ** -0.5, eps,
                  N_KEYS=n_keys, NH=nh, NKV=nkv, HALF=half, NH_P2=triton.next_power_of_2(nh),
                  NKV_P2=triton.next_power_of_2(nkv), HALF_P2=half, HAS_NORM=has_norm, BLOCK_N=block_n,
                  SPLITS=splits, **common.chained(qkv.device))
    return _combine_splits(part, ml, D)


# ---- fp16 GEMV of one row (the q|k|v and o projections of a batch-1 decode step) ----------------------------
# cuBLAS picks a generic tile for M = 1: on the H200 the OLMoE projections took 9.9 us (q|k|v, N 6,144) and 6.3 us
# (o, N 2,048) per layer, these tiles 9.0 and 5.1 us (tools/explore/probe_dense_gemv.py,
# results/campaigns/h200-decode/dense-gemv.json; 16 layers of distinct weights in one CUDA graph). At M = 8 cuBLAS
# stays (9.6 / 6.3 us; this kernel's best was 22.7 / 9.7).

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHAINED: tl.constexpr = False):
    """y[n] = sum_k x[k] w[n, k] (+ b[n]) for BLOCK_N rows n: products summed per lane in fp32, reduced once.

    The first BLOCK_K columns of the weights are loaded before ``chain_wait``: a projection's weights are written by
    no kernel, so in a chained step that load overlaps the launch before this one (x, its output, is read after)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None] * K  # (BN, 1)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :],
                other=0.0)  # (BN, BK) fp16: the first K chunk
    chain_wait(CHAINED)
    y = gemv_row_sums(w, x_ptr, w_rows, n_mask, K, BLOCK_K)  # (BN,) fp32
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(tl.float16), mask=n_mask)


def gemv(x, w, b=None):
    """x fp16 (..., K) holding one row, w fp16 (N, K) contiguous, b fp16 (N,) or None -> fp16 (..., N) = x w^T + b.

    FP32 sums, one rounding to fp16 (F.linear's result within fp16 rounding; not bit-identical)."""
    n, k = w.shape
    if x.dtype != torch.float16 or w.dtype != torch.float16 or x.shape[-1] != k or x.numel() != k \
            or not w.is_contiguous() or (b is not None and (b.shape != (n,) or b.dtype != torch.float16)):
        raise ValueError(f"gemv: one fp16 row of width {k} and a contiguous fp16 ({n}, {k}) weight required, got x "
                         f"{x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float16, device=x.device)
    _launch_gemv(x.contiguous(), w, b, y)
    return y


def _gemv_block_n(n: int) -> int:
    return 16 if n >= 4096 else 4  # the probe's best tiles (above), by the projection's width


def _gemv_block_k(n: int, k: int) -> int:
    """512 for a wide projection (the probe's best, results/campaigns/h200-decode/dense-gemv.json); a narrow one's
    GEMV_NARROW_BLOCK_K, or the row's width rounded up to a power of two where that is less (at least 512)."""
    return 512 if n >= 4096 else max(512, min(GEMV_NARROW_BLOCK_K, triton.next_power_of_2(k)))


def _launch_gemv(x, w, b, y) -> None:
    n, k = w.shape
    block_n = _gemv_block_n(n)
    # Triton's default 4 warps (the probe's)
    common.launch(_gemv_kernel[(triton.cdiv(n, block_n),)], x, w, b if b is not None else w, y, n, K=k,
                  HAS_BIAS=b is not None, BLOCK_N=block_n, BLOCK_K=_gemv_block_k(n, k), **common.chained(x.device))


# ---- the shared expert of one token (Qwen2-MoE), added to the routed output --------------------------------
# In torch a batch-1 shared expert is ~14 launches per layer (two cuBLAS GEMVs, the gate's GEMV, and the casts, SiLU,
# products and sums between them). Here: one GEMV over gate | up | the gate's row, then one launch that forms
# fp16(silu(g) * u) for its K chunk, multiplies by the down projection and adds sigmoid(gate) times the result to the
# routed output, rounding to fp16 where the torch path does.

@triton.jit
def _shared_down_kernel(gu_ptr, w_ptr, y_ptr, out_ptr, N, I: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, CHAINED: tl.constexpr = False):
    """out[n] = fp16(y[n] + sigmoid(gu[2I]) * fp16(sum_k a[k] w[n, k])), a = fp16(silu(gu[k]) * gu[I + k])."""
    chain_wait(CHAINED)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    n_mask = offs_n < N
    gs = gated_shared_down(gu_ptr, w_ptr, offs_n, n_mask, I, BLOCK_K)  # (BN,) fp32
    y = tl.load(y_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, (y + gs).to(tl.float16), mask=n_mask)


def shared_expert_one_row(h, gate_up_gate, down, y):
    """The shared expert of one token added to its routed output, in two launches.

    h             fp16 (1, H): the MoE input of the token
    gate_up_gate  fp16 (2 * Is + 1, H) contiguous: the shared expert's gate rows, its up rows, then the
                  shared_expert_gate row (runmap.engine.model.LayerWeights.shared_gate_up_gate)
    down          fp16 (H, Is) contiguous
    y             fp16 (1, H): the routed experts' output
    returns       fp16 (1, H) = fp16(y + sigmoid(gate . h) * fp16(down @ fp16(silu(g) * u))), g | u | gate =
                  fp16(gate_up_gate @ h): the torch path's roundings, its sums in another order (not bit-identical)."""
    n3, hid = gate_up_gate.shape
    H, I = down.shape
    if h.dtype != torch.float16 or h.numel() != hid or n3 != 2 * I + 1 or H != hid or y.shape != h.shape \
            or y.dtype != torch.float16 or down.dtype != torch.float16 or gate_up_gate.dtype != torch.float16 \
            or not gate_up_gate.is_contiguous() or not down.is_contiguous():
        raise ValueError(f"shared_expert_one_row: one fp16 row h (1, {hid}), gate_up_gate (2 Is + 1, H) and down (H, "
                         f"Is) contiguous fp16, y like h; got h {h.dtype} {tuple(h.shape)}, gate_up_gate "
                         f"{gate_up_gate.dtype} {tuple(gate_up_gate.shape)}, down {down.dtype} {tuple(down.shape)}, y "
                         f"{y.dtype} {tuple(y.shape)}")
    gu = torch.empty(n3, dtype=torch.float16, device=h.device)  # g (Is) | u (Is) | gate logit (1)
    _launch_gemv(h.contiguous(), gate_up_gate, None, gu)
    out = torch.empty_like(y)
    block_n = _gemv_block_n(H)
    common.launch(_shared_down_kernel[(triton.cdiv(H, block_n),)], gu, down, y.contiguous(), out, H, I=I,
                  BLOCK_N=block_n, BLOCK_K=512, **common.chained(h.device))
    return out


# ---- the shared expert of several rows (a batch's decode step, a prefill pass) ----------------------------------
# torch's sequence between the two projections is ~13 launches per layer (casts, SiLU, product, the gate's own GEMV,
# sigmoid, the gated sum and its cast): 12 of Qwen1.5-MoE's 26 launches per layer at batch 8. The projections stay
# cuBLAS GEMMs (at 8 rows cuBLAS beat the one-row GEMV's tiles, above) and the rest is two launches with the same
# fp16 roundings: a = fp16(silu(g) * u), then out = fp16(y + sigmoid(fp16(h . gate_row)) * s).

@triton.jit
def _silu_mul_rows_kernel(gu_ptr, a_ptr, stride_gm, I, BLOCK: tl.constexpr):
    """a[m, i] = fp16(silu(gu[m, i]) * gu[m, I + i]) for one row m and BLOCK columns i, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) over I
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gm + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gm + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(a_ptr + row * I + offs, silu_mul(g, u).to(tl.float16), mask=mask)


@triton.jit
def _shared_gate_add_kernel(h_ptr, wg_ptr, s_ptr, y_ptr, out_ptr, stride_hm, H: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """out[m, n] = fp16(y[m, n] + sigmoid(fp16(h[m] . wg)) * s[m, n]) for one row m and BLOCK_N columns n. Every
    program of a row computes the row's gate logit itself (H values, from L2 after the first): no launch for it."""
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + offs_k) < H
        x = tl.load(h_ptr + row * stride_hm + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(wg_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += x * w
    gate = tl.sigmoid(tl.sum(acc, axis=0).to(tl.float16).to(tl.float32))  # the gate's GEMV rounds its logit to fp16
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) over H
    n_mask = offs_n < H
    s = tl.load(s_ptr + row * H + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * H + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs_n, (y + gate * s).to(tl.float16), mask=n_mask)


def silu_mul_rows(gu: torch.Tensor) -> torch.Tensor:
    """gu fp16 (N, 2 * Is): each row's gate projection then its up projection -> fp16 (N, Is) = fp16(silu(g) * u),
    in fp32 from the fp16 values (the torch path's one rounding). Rows may be strided; columns contiguous."""
    if gu.dtype != torch.float16 or gu.dim() != 2 or gu.shape[1] % 2 or gu.shape[1] == 0 or gu.stride(1) != 1:
        raise ValueError(f"silu_mul_rows: fp16 (N, 2 Is) with contiguous columns required, got {gu.dtype} "
                         f"{tuple(gu.shape)} strides {gu.stride()}")
    n, inter = gu.shape[0], gu.shape[1] // 2
    a = common.empty((n, inter), torch.float16, gu.device)
    if n:
        block = 1024 if not common.interpreting(gu.device) else triton.next_power_of_2(inter)
        common.launch(_silu_mul_rows_kernel[(n, triton.cdiv(inter, block))], gu, a, gu.stride(0), inter, BLOCK=block)
    return a


def shared_gate_add(h: torch.Tensor, gate_row: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The shared expert's gated output added to the routed output, one launch.

    h         fp16 (N, H): the MoE input rows (columns contiguous)
    gate_row  fp16 (1, H) or (H,) contiguous: shared_expert_gate
    s         fp16 (N, H) contiguous: the shared expert's down projection
    y         fp16 (N, H) contiguous: the routed experts' output
    returns   fp16 (N, H) = fp16(y + sigmoid(fp16(h . gate_row)) * s), a new tensor."""
    n, hid = h.shape if h.dim() == 2 else (-1, -1)
    if h.dim() != 2 or h.dtype != torch.float16 or h.stride(1) != 1 or gate_row.numel() != hid \
            or gate_row.dtype != torch.float16 or not gate_row.is_contiguous() \
            or any(t.shape != h.shape or t.dtype != torch.float16 or not t.is_contiguous() for t in (s, y)):
        raise ValueError(f"shared_gate_add: fp16 h (N, H) with contiguous columns, a contiguous fp16 gate row of H "
                         f"values and contiguous fp16 s, y like h; got h {h.dtype} {tuple(h.shape)}, gate_row "
                         f"{gate_row.dtype} {tuple(gate_row.shape)}, s {s.dtype} {tuple(s.shape)}, y {y.dtype} "
                         f"{tuple(y.shape)}")
    out = common.empty(tuple(y.shape), torch.float16, y.device)
    if n:
        block_n = 1024 if not common.interpreting(h.device) else triton.next_power_of_2(hid)
        block_k = min(1024, triton.next_power_of_2(hid))
        common.launch(_shared_gate_add_kernel[(n, triton.cdiv(hid, block_n))], h, gate_row, s, y, out, h.stride(0),
                      H=hid, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
