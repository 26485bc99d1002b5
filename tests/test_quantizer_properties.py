"""Hypothesis properties of the INT4 quantizer (runmap.format.qpack.quantize, QUANT_RULE).

Bound: with s the block's FP16 scale, exact arithmetic gives |w - q*s| <= s/2. The quantizer divides
in FP32, so w/s carries a relative rounding error of at most 2^-24 and |w/s| <= 7; the checked bound
is therefore s * (1/2 + 7 * 2^-24), evaluated in float64 so the check itself does not round.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runmap.format import pack as pack_mod
from runmap.format.pack import quantize_layer
from runmap.format.qpack import FP16_MAX, QPackError, RowLayout, dequantize, num_blocks, quantize, unpack_nibbles

SLACK = 7 * 2.0**-24


@st.composite
def matrices(draw, max_n=4, max_k=96):
    """(w float32 (N, K), block_size): K even, often not a multiple of the block; per-row magnitudes
    from subnormal-FP16-scale (1e-9) up to the largest storable scale (amax/7 <= 65504); some zeros."""
    n = draw(st.integers(1, max_n))
    k = 2 * draw(st.integers(1, max_k // 2))
    block = 2 * draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    w = g.standard_normal((n, k))
    exps = [draw(st.floats(-9.0, math.log10(7 * FP16_MAX) - 0.01)) for _ in range(n)]
    w = w / np.abs(w).max(axis=1, keepdims=True).clip(1e-30) * (10.0 ** np.array(exps))[:, None]
    zero_frac = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    w[g.random((n, k)) < zero_frac] = 0.0
    return torch.from_numpy(w.astype(np.float32)), block


def _scale_per_value(scales: torch.Tensor, k: int, block: int) -> torch.Tensor:
    return scales.double().repeat_interleave(block, dim=1)[:, :k]  # (N, K)


@settings(max_examples=150)
@given(matrices())
def test_error_within_half_step_and_scale_rule(case):
    w, block = case
    n, k = w.shape
    packed, scales = quantize(w, block)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == (n, num_blocks(k, block)) and scales.dtype == torch.float16
    assert torch.isfinite(scales).all() and (scales >= 0).all()
    w_hat = dequantize(packed, scales, k, block).double()
    s = _scale_per_value(scales, k, block)
    assert ((w.double() - w_hat).abs() <= s * (0.5 + SLACK)).all()
    # scale = the smallest FP16 >= amax/7 of its block (partial last block: only present values)
    pad = num_blocks(k, block) * block - k
    amax = torch.nn.functional.pad(w.double().abs(), (0, pad)).view(n, -1, block).amax(2)  # (N, nb)
    target = amax / 7
    sd = scales.double()
    assert (sd >= target).all()
    below = torch.nextafter(scales, torch.zeros_like(scales)).double()
    assert ((below < target) | (scales == 0)).all()
    assert ((scales == 0) == (amax == 0)).all()


@settings(max_examples=100)
@given(matrices())
def test_zeros_stay_zero_and_nibbles_valid(case):
    w, block = case
    packed, scales = quantize(w, block)
    q = unpack_nibbles(packed)
    assert ((q >= -7) & (q <= 7)).all()  # nibble 0 (q = -8) never written
    assert (q[w == 0] == 0).all()
    w_hat = dequantize(packed, scales, w.shape[1], block)
    assert (w_hat[w == 0] == 0).all()
    assert (torch.sign(w_hat) * torch.sign(w) >= 0).all()  # no sign flips


@settings(max_examples=60)
@given(matrices())
def test_deterministic_same_bytes_twice(case):
    w, block = case
    p1, s1 = quantize(w, block)
    p2, s2 = quantize(w.clone(), block)
    assert p1.numpy().tobytes() == p2.numpy().tobytes()
    assert s1.numpy().tobytes() == s2.numpy().tobytes()
    # BF16 input (what checkpoints hold) gives the same bytes as its exact FP32 upcast
    wb = w.to(torch.bfloat16)
    pb, sb = quantize(wb, block)
    pf, sf = quantize(wb.float(), block)
    assert torch.equal(pb, pf) and torch.equal(sb, sf)


@settings(max_examples=40)
@given(st.integers(1, 3), st.integers(1, 12), st.integers(1, 12), st.sampled_from([8, 16, 32]),
       st.integers(0, 2**31 - 1), st.sampled_from([1, 100, 1 << 24]))
def test_layer_packer_equals_per_expert_packer(n_exp, h_half, i_half, block, seed, chunk_values):
    """quantize_layer (the packer's batched path) == RowLayout.pack_expert per expert, byte for byte."""
    h, i = 2 * h_half, 2 * i_half
    layout = RowLayout.build(h, i, block)
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(n_exp, i, h, generator=g), torch.randn(n_exp, i, h, generator=g)
    down = torch.randn(n_exp, h, i, generator=g)
    old, pack_mod.CHUNK_VALUES = pack_mod.CHUNK_VALUES, chunk_values  # experts per quantize step varies
    try:
        rows, _ = quantize_layer(gate.bfloat16(), up.bfloat16(), down.bfloat16(), layout)
    finally:
        pack_mod.CHUNK_VALUES = old
    for e in range(n_exp):
        ref = layout.pack_expert({"gate": gate[e].bfloat16(), "up": up[e].bfloat16(), "down": down[e].bfloat16()})
        assert torch.equal(rows[e], ref)


@given(st.floats(7 * FP16_MAX * 1.001, 1e30), st.sampled_from([2, 8, 256]))
def test_unstorable_scale_is_an_error(big, block):
    w = torch.zeros(2, 8)
    w[1, 3] = big
    with pytest.raises(QPackError, match="FP16 range"):
        quantize(w, block, name="layer 3 experts.up")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_is_an_error(bad):
    w = torch.ones(3, 10)
    w[2, 9] = bad
    with pytest.raises(QPackError, match="layer 0 experts.gate: contains NaN or Inf"):
        quantize(w, 4, name="layer 0 experts.gate")


def test_largest_storable_and_subnormal_magnitudes():
    w = torch.tensor([[7 * FP16_MAX, -3.0, 0.0, 1.0], [1e-9, -2e-9, 0.0, 5e-10]], dtype=torch.float32)
    packed, scales = quantize(w, 4)
    assert scales[0, 0].item() == FP16_MAX
    assert 0 < scales[1, 0].item() < 6.2e-5  # an FP16 subnormal scale, not flushed to zero
    w_hat = dequantize(packed, scales, 4, 4)
    assert w_hat[0, 0].item() == 7 * FP16_MAX
    s = _scale_per_value(scales, 4, 4)
    assert ((w.double() - w_hat.double()).abs() <= s * (0.5 + SLACK)).all()
