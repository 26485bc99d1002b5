import torch

from runmap.format.qpack import RowLayout, dequantize, quantize


def test_roundtrip_within_half_step():
    torch.manual_seed(0)
    w = torch.randn(8, 300)
    packed, scales = quantize(w, 64)
    w_hat = dequantize(packed, scales, 300, 64)
    s = scales.float().repeat_interleave(64, dim=1)[:, :300]
    assert ((w - w_hat).abs() <= s / 2).all()


def test_layout_olmoe_row_is_about_3_2_mb():
    assert RowLayout.build(2048, 1024).row_bytes == 3194880
