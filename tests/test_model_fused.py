"""The fused Triton ops (runmap.kernels.fused_ops; interpreter on CPU) equal the torch path of runmap.engine.model:
same logits and the same KV cache contents, for prefill with left padding and for a decode step, with each
op alone and all together."""
import pytest
import torch

from runmap.arch.config import load_preset
from runmap.engine.model import KVCache, Transformer
from test_model import our_model
from test_model_support import random_case


ALL = ("prologue", "norm", "router", "attn")


@pytest.mark.parametrize("preset,fused", [("tiny-olmoe", (op,)) for op in ALL] +
                         [("tiny-qwen2-moe", ALL), ("tiny-olmoe", ALL)])
def test_fused_ops_match_torch(preset, fused):
    cfg, _ = load_preset(preset)
    nonrouted, rows, layout = random_case(cfg, seed=2)
    model, experts = our_model(cfg, nonrouted, rows, layout)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (2, 5), generator=g)
    pad = torch.tensor([0, 2])
    slots = torch.arange(5)
    pos = (slots[None] - pad[:, None]).clamp(min=0)
    results = []
    for ops in ((), fused):
        model.fused = frozenset(ops)
        kv = KVCache(cfg, 2, 8, "cpu")
        torch.nn.init.normal_(kv.k)  # stale contents must be overwritten where written and ignored elsewhere
        torch.nn.init.normal_(kv.v)
        a = model.forward(tokens, pos, kv, slots, pad, 5, experts)  # (B, V)
        b = model.forward(tokens[:, :1], pos[:, -1:] + 1, kv, torch.tensor([5]), pad, 6, experts)
        results.append((a, b, kv.k[:, :, :, :6].clone(), kv.v[:, :, :, :6].clone()))
    (a0, b0, k0, v0), (a1, b1, k1, v1) = results
    for name, x, y in (("prefill logits", a0, a1), ("decode logits", b0, b1), ("k cache", k0, k1),
                       ("v cache", v0, v1)):
        err, bound = (x.float() - y.float()).abs().max().item(), 2e-3 * y.float().abs().max().item() + 1e-3
        assert err <= bound, f"{preset} {name}: max |diff| {err:.3g} > {bound:.3g}"
    if fused == ("prologue",):
        assert torch.equal(v0[0], v1[0])  # layer 0: v is a pure copy of the same projection


@pytest.mark.parametrize("n,e,hid,k,norm", [(1, 64, 2048, 8, False), (3, 60, 96, 4, True), (5, 7, 40, 2, False)])
def test_route_fused_matches_torch_router(n, e, hid, k, norm, test_device):
    """Same expert ids (descending probability) and weights as model.route, odd expert / hidden counts."""
    from runmap.kernels.fused_ops import route_fused
    from runmap.engine.model import route

    g = torch.Generator().manual_seed(n * 100 + e)
    h = torch.randn(n, hid, generator=g).half().to(test_device)
    router32 = (torch.randn(e, hid, generator=g) * 0.05).half().float().to(test_device)
    ids, w = route_fused(h, router32, k, norm)
    ids_ref, w_ref = route(h, router32, k, norm)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    if norm:
        assert torch.allclose(w.sum(-1).cpu(), torch.ones(n), atol=1e-5)


@pytest.mark.parametrize("n,e,hid", [(1030, 64, 2048), (1100, 60, 200), (1025, 7, 40)])
def test_route_fused_of_long_passes_matches_torch_router(n, e, hid, monkeypatch, test_device):
    """From ROUTER_ROWS_MIN rows the logits are one FP32 GEMM (no per-row program): the same ids and weights as
    model.route on odd expert / hidden counts."""
    import runmap.kernels.fused_ops as fo
    from runmap.engine.model import route

    g = torch.Generator().manual_seed(n + e)
    h = torch.randn(n, hid, generator=g).half().to(test_device)
    router32 = (torch.randn(e, hid, generator=g) * 0.05).half().float().to(test_device)
    ids_ref, w_ref = route(h, router32, 4, True)
    grids = []

    class Spy:  # records launches of the per-row logits kernel
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    real = fo._router_logits_kernel
    monkeypatch.setattr(fo, "_router_logits_kernel", Spy())
    ids, w = fo.route_fused(h, router32, 4, True)
    assert grids == [] and n >= fo.ROUTER_ROWS_MIN
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert torch.allclose(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6)


def test_route_fused_refuses_a_top_k_it_cannot_tile():
    from runmap.kernels.fused_ops import route_fused

    with pytest.raises(ValueError, match="power-of-two top_k"):
        route_fused(torch.zeros(1, 8).half(), torch.zeros(4, 8), 3, False)


# pads at, just before and just after the kernel's 64-key block boundaries, a pad equal to the slot (one key), and a
# row whose keys start several blocks after the other's (a served row that joined late): the loop starts at each
# row's own first block
@pytest.mark.parametrize("slot,n_keys,pads", [(70, 256, (0, 5)), (0, 64, (0, 0)), (130, 256, (3, 129)),
                                              (200, 256, (64, 199)), (255, 256, (255, 1)), (191, 512, (63, 128)),
                                              (300, 512, (0, 300))])
@pytest.mark.parametrize("D", [16, 24])
def test_decode_attention_attends_exactly_pad_to_slot(slot, n_keys, pads, D, test_device):
    """Keys past the slot (the rest of the KV bucket, filled with garbage here) and left padding are ignored;
    blocks wholly past the slot are skipped; a head dim that is not a power of two (24; Qwen3-style configs) reads
    and writes its D lanes only. RUNMAP_TEST_DEVICE=cuda runs the compiled kernel."""
    from runmap.kernels.fused_ops import decode_attention

    g = torch.Generator().manual_seed(slot)
    B, nh, nkv = 2, 4, 2
    q = torch.randn(B, nh, 1, D, generator=g).half()
    kc = (torch.randn(B, nkv, n_keys + 8, D, generator=g) * 3).half()
    vc = torch.randn(B, nkv, n_keys + 8, D, generator=g).half()
    pad = torch.tensor(pads)
    dev = torch.device(test_device)
    out = decode_attention(q.to(dev), kc.to(dev), vc.to(dev), torch.tensor([slot], device=dev), pad.to(dev),
                           n_keys).cpu()  # (B, 1, nh*D)
    for b in range(B):
        k = kc[b, :, pad[b]:slot + 1].float().repeat_interleave(nh // nkv, 0)  # (nh, n, D)
        v = vc[b, :, pad[b]:slot + 1].float().repeat_interleave(nh // nkv, 0)
        w = torch.softmax(q[b].float() @ k.transpose(1, 2) / D ** 0.5, dim=-1)  # (nh, 1, n)
        ref = (w @ v).reshape(1, nh * D)
        assert torch.allclose(out[b].float(), ref, atol=2e-3, rtol=2e-3)
