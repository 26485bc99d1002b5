"""Fused attention prologue for the decode step: q/k RMSNorm + RoPE + KV-cache write in one Triton launch.

Why: a batch-1 decode step is launch-bound. In plain torch the prologue of one attention layer (two
RMSNorms over the full q and k projections, RoPE on q and k, two index_copy_ into the KV cache) is ~35
small kernels; 16 layers make it the largest share of the step. This kernel does it in one launch per
layer with the same arithmetic as ``runmap.model`` (FP32 math; the RMSNorm output rounded to FP16 before
RoPE, as the torch path does; RoPE in the rotate-half form).

One program per token row m = b * T + t of the fused qkv projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_rows(base_ptr, w_ptr, offs_h, offs_d, n_heads, HALF: tl.constexpr, cos, sin, eps,
                    HAS_NORM: tl.constexpr):
    """Load (n_heads, D) of one projection as two halves, RMSNorm over all of it (optional), rotate."""
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    idx = offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # first half of each head
    x1 = tl.load(base_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + idx + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(tl.sum(x1 * x1 + x2 * x2, axis=1), axis=0)
        r = 1.0 / tl.sqrt(ss / (n_heads * 2 * HALF) + eps)
        w1 = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + idx + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = (x1 * r * w1).to(tl.float16).to(tl.float32)  # the torch path stores the norm output as fp16
        x2 = (x2 * r * w2).to(tl.float16).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return o1.to(tl.float16), o2.to(tl.float16), mask


@triton.jit
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

    offs_h = tl.arange(0, NH_P2)
    q1, q2, mq = _norm_rope_rows(row, qw_ptr, offs_h, offs_d, NH, HALF, cos, sin, eps, HAS_NORM)
    q_dst = q_out_ptr + ((b * NH + offs_h[:, None]) * T + t) * (2 * HALF) + offs_d[None, :]  # (B, nh, T, D)
    tl.store(q_dst, q1, mask=mq)
    tl.store(q_dst + HALF, q2, mask=mq)

    offs_k = tl.arange(0, NKV_P2)
    k1, k2, mk = _norm_rope_rows(row + NH * 2 * HALF, kw_ptr, offs_k, offs_d, NKV, HALF, cos, sin, eps, HAS_NORM)
    c_off = b * stride_cb + offs_k[:, None] * stride_ch + slot * stride_cs + offs_d[None, :]
    tl.store(k_cache_ptr + c_off, k1, mask=mk)
    tl.store(k_cache_ptr + c_off + HALF, k2, mask=mk)

    v_src = row + (NH + NKV) * 2 * HALF + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(v_cache_ptr + c_off, tl.load(v_src, mask=mk, other=0.0), mask=mk)
    tl.store(v_cache_ptr + c_off + HALF, tl.load(v_src + HALF, mask=mk, other=0.0), mask=mk)


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
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: give both or neither")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache / v_cache: same shape and strides with a contiguous last dim required, got "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} / {tuple(v_cache.shape)} {v_cache.stride()}")
    if k_cache.shape[0] < B or k_cache.shape[1] != num_kv_heads or k_cache.shape[3] != D:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not fit B={B}, nkv={num_kv_heads}, D={D}")
    positions = positions.contiguous()
    q = torch.empty(B, num_heads, T, D, dtype=torch.float16, device=qkv.device)
    has_norm = q_norm is not None
    half = D // 2
    _qk_norm_rope_kv_kernel[(B * T,)](
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
