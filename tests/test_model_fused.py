"""The fused Triton ops (runmap.kernels.fused_ops; interpreter on CPU) equal the torch path of runmap.engine.model:
same logits and the same KV cache contents, for prefill with left padding and for a decode step, with each
op alone and all together."""
import os

import pytest
import torch
import triton
import triton.language as tl

from runmap.arch.config import load_preset
from runmap.engine.model import KVCache, Transformer
from runmap.kernels.fused_ops import _split_keys  # called by _split_keys_probe_kernel (Triton compiles no import)
from test_model import our_model
from test_model_support import random_case


ALL = ("prologue", "norm", "router", "attn", "gemv", "shared")
# tests that build a whole model on the CPU: they run the kernels in the Triton interpreter (CI); a GPU run
# (RUNMAP_TEST_DEVICE=cuda, compiled kernels) checks the same ops through the tests taking ``test_device``
cpu_model = pytest.mark.skipif(os.environ.get("RUNMAP_TEST_DEVICE", "cpu") != "cpu",
                               reason="builds the model on the CPU (Triton interpreter only)")


def _two_row_prompt_case(preset: str, weights_seed: int, tokens_seed: int):
    """A tiny model on random weights and a two-row prompt of 5 positions, row 1 left-padded by 2: (cfg, model,
    experts, generator, tokens (2, 5), pad (2,), slots (5,), positions (2, 5))."""
    cfg, _ = load_preset(preset)
    nonrouted, rows, layout = random_case(cfg, seed=weights_seed)
    model, experts = our_model(cfg, nonrouted, rows, layout)
    g = torch.Generator().manual_seed(tokens_seed)
    tokens = torch.randint(3, cfg.vocab_size, (2, 5), generator=g)
    pad = torch.tensor([0, 2])
    slots = torch.arange(5)
    return cfg, model, experts, g, tokens, pad, slots, (slots[None] - pad[:, None]).clamp(min=0)


@pytest.mark.parametrize("preset,fused", [("tiny-olmoe", (op,)) for op in ALL if op != "shared"] +
                         [("tiny-qwen2-moe", ("shared",)), ("tiny-qwen2-moe", ALL), ("tiny-olmoe", ALL)])
@cpu_model
def test_fused_ops_match_torch(preset, fused):
    cfg, model, experts, _, tokens, pad, slots, pos = _two_row_prompt_case(preset, 2, 0)
    results = []
    for ops in ((), fused):
        model.fused = frozenset(ops)
        kv = KVCache(cfg, 2, 8, "cpu")
        torch.nn.init.normal_(kv.k)  # stale contents must be overwritten where written and ignored elsewhere
        torch.nn.init.normal_(kv.v)
        a = model.forward(tokens, pos, kv, slots, pad, 5, experts)  # (B, V)
        b = model.forward(tokens[:, :1], pos[:, -1:] + 1, kv, torch.tensor([5]), pad, 6, experts)
        # a decode step of row 1 alone (batch 1: the one-token projections take "gemv")
        c = model.forward(tokens[1:, 1:2], pos[1:, -1:] + 2, kv.rows(1, 2), torch.tensor([6]), pad[1:], 7, experts)
        # (L, n) per layer: slots 0-5 of both rows and slot 6 of row 1 (row 0 never wrote slot 6)
        written = lambda t: torch.cat([t[:, :, :, :6].flatten(1), t[:, 1, :, 6].flatten(1)], dim=1)
        results.append((a, b, c, written(kv.k), written(kv.v)))
    (a0, b0, c0, k0, v0), (a1, b1, c1, k1, v1) = results
    for name, x, y in (("prefill logits", a0, a1), ("decode logits", b0, b1), ("batch-1 decode logits", c0, c1),
                       ("k cache", k0, k1), ("v cache", v0, v1)):
        err, bound = (x.float() - y.float()).abs().max().item(), 2e-3 * y.float().abs().max().item() + 1e-3
        assert err <= bound, f"{preset} {name}: max |diff| {err:.3g} > {bound:.3g}"
    if fused == ("prologue",):
        assert torch.equal(v0[0], v1[0])  # layer 0: v is a pure copy of the same projection


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
@cpu_model
def test_fused_ops_under_imposed_routes_match_torch(preset):
    """A routing workload's ids (runmap.workload.routing) through the fused ops: with "imposed" and "norm" the gate
    weights come from the fused norm's logits, with "imposed" and "router" alone from the router kernel's
    (``router_logits``); without "imposed" the torch weights beside the other fused ops. The logits equal the torch
    path's on the same imposed ids, and differ from the router's own routing (the ids did reach the experts)."""
    cfg, model, experts, g, tokens, pad, slots, pos = _two_row_prompt_case(preset, 3, 1)
    E, L, k = cfg.num_experts, cfg.num_layers, cfg.top_k
    draw = lambda n: torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
                                  for _ in range(L)])  # (L, n, k) int64
    imposed_prefill, imposed_step = draw(2 * 5), draw(2)
    results = []
    # "imposed" takes the one-launch weights; ALL alone keeps imposed_weights' torch ops beside the fused rest
    for ops, imposed in (((), True), (ALL + ("imposed",), True), (ALL, True), (("router", "imposed"), True),
                         (ALL + ("imposed",), False)):
        model.fused = frozenset(ops)
        kv = KVCache(cfg, 2, 8, "cpu")
        model.imposed = imposed_prefill if imposed else None
        a = model.forward(tokens, pos, kv, slots, pad, 5, experts)  # (B, V)
        model.imposed = imposed_step if imposed else None
        b = model.forward(tokens[:, :1], pos[:, -1:] + 1, kv, torch.tensor([5]), pad, 6, experts)
        model.imposed = None
        results.append((a, b))
    (a0, b0), (a1, b1), (a3, b3), (a4, b4), (a2, b2) = results
    for name, x, y in (("prefill logits", a0, a1), ("decode logits", b0, b1), ("prefill, torch weights", a0, a3),
                       ("decode, torch weights", b0, b3), ("prefill, router kernel's logits", a0, a4),
                       ("decode, router kernel's logits", b0, b4)):
        err, bound = (x.float() - y.float()).abs().max().item(), 2e-3 * y.float().abs().max().item() + 1e-3
        assert err <= bound, f"{preset} {name}: max |diff| {err:.3g} > {bound:.3g}"
    assert (b1.float() - b2.float()).abs().max().item() > 10 * bound, "the imposed ids changed nothing"


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



@pytest.mark.parametrize("n,e,hid,k,norm", [(1, 64, 2048, 8, False), (8, 64, 2048, 8, False), (3, 60, 96, 4, True),
                                            (5, 7, 40, 2, False), (1030, 60, 40, 4, True)])
def test_imposed_weights_from_logits_match_the_torch_weights(n, e, hid, k, norm, test_device):
    """The one-launch gate weights of imposed ids (routing workloads) equal model.imposed_weights on fresh random
    rows and ids (distinct per row, drawn anywhere in [0, E), not the router's top-k), odd expert / hidden counts, a
    pass long enough for the GEMM logits; the output buffer is poisoned first and no NaN survives."""
    import runmap.kernels.fused_ops as fo
    from runmap.engine.model import imposed_weights

    g = torch.Generator().manual_seed(n * 7 + e)
    dev = torch.device(test_device)
    h = torch.randn(n, hid, generator=g).half()
    router32 = (torch.randn(e, hid, generator=g) * 0.2).half().float()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # (n, k) int64
    ref = imposed_weights(h.float().half(), router32, ids, k, norm).double()  # torch on the CPU, fp32
    logits = fo.router_logits(h.to(dev), router32.to(dev))
    assert torch.allclose(logits.cpu(), h.float() @ router32.t(), rtol=1e-4, atol=1e-4)
    w = fo.imposed_weights_from_logits(logits, ids.to(dev), k, norm).cpu().double()
    assert w.shape == (n, k) and torch.isfinite(w).all()
    assert torch.allclose(w, ref, rtol=1e-4, atol=1e-6), (w - ref).abs().max()
    if norm:
        assert torch.allclose(w.sum(-1), torch.ones(n, dtype=torch.double), atol=1e-5)
    else:  # rescaled to the router's own top-k sum, which is < 1 and > the imposed ids' sum only when they differ
        own = torch.softmax(h.float() @ router32.t(), -1).topk(k, -1).values.sum(-1).double()
        assert torch.allclose(w.sum(-1), own, rtol=1e-4)


def test_imposed_weights_from_logits_refuse_what_they_cannot_run():
    from runmap.kernels.fused_ops import imposed_weights_from_logits, router_logits

    for ids, top_k in ((torch.zeros(2, 3, dtype=torch.int64), 3), (torch.zeros(2, 0, dtype=torch.int64), 0),
                       (torch.zeros(2, 4, dtype=torch.int64), 2), (torch.zeros(2, 4, dtype=torch.int32), 4),
                       (torch.zeros(2, 4, dtype=torch.int64, device="meta"), 4)):
        with pytest.raises(ValueError, match="top_k a power of two"):  # odd / zero / mismatched k, dtype, device
            imposed_weights_from_logits(torch.zeros(2, 8), ids, top_k, True)
    with pytest.raises(ValueError, match="fp32 logits"):
        imposed_weights_from_logits(torch.zeros(2, 8).half(), torch.zeros(2, 4, dtype=torch.int64), 4, True)
    with pytest.raises(ValueError, match="fp32 router"):
        router_logits(torch.zeros(2, 8).half(), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="contiguous fp32 router"):
        router_logits(torch.zeros(2, 8).half(), torch.zeros(8, 4).t())


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


@pytest.mark.parametrize("m,e,hid,with_y,block_h", [(1, 64, 2048, True, 1024), (8, 60, 2048, True, 1024),
                                                    (3, 7, 40, False, 1024), (2, 5, 1500, True, 1024),
                                                    (1, 64, 2048, True, 2048), (2, 5, 1500, True, 2048)])
def test_add_norm_router_logits_equals_the_two_launches(m, e, hid, with_y, block_h, test_device, monkeypatch):
    """One launch gives what add_rms_norm then the router's logits kernel give: the same x + y and norm (bit for bit)
    and the same FP32 logits, on odd expert counts and hidden sizes (one, two and a partial last chunk of the row);
    the ids and weights of the top-k on those logits equal route_fused's. block_h: fused_ops.ROUTER_BLOCK_H_MAX, the
    default 2048 (a whole row of 2,048 in one chunk) and the 1024 before it (two chunks)."""
    import runmap.kernels.fused_ops as fo

    monkeypatch.setattr(fo, "ROUTER_BLOCK_H_MAX", block_h)

    g = torch.Generator().manual_seed(m * 1000 + e)
    dev = torch.device(test_device)
    x = torch.randn(m, hid, generator=g).half().to(dev)
    y = torch.randn(m, hid, generator=g).half().to(dev) if with_y else None
    nw = (1 + 0.1 * torch.randn(hid, generator=g)).half().to(dev)
    router32 = (torch.randn(e, hid, generator=g) * 0.05).half().float().to(dev)
    x_ref, h_ref = fo.add_rms_norm(x, y, nw, 1e-6)
    x_out, h, logits = fo.add_norm_router_logits(x, y, nw, router32, 1e-6)
    assert torch.equal(x_out.cpu(), x_ref.cpu()) and torch.equal(h.cpu(), h_ref.cpu())
    ref = torch.empty(m, e, dtype=torch.float32, device=dev)
    fo.common.launch(fo._router_logits_kernel[(m, -(-e // 2))], h_ref, router32, ref, e, H=hid, BLOCK_E=2,
                     BLOCK_H=fo._router_block_h(hid))
    if dev.type == "cpu":  # the interpreter runs both in numpy: identical operations, identical bits
        assert torch.equal(logits, ref)
    else:  # compiled separately, a multiply-add may be contracted differently
        assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5)
    k = 4
    ids, w = fo.route_topk(logits, k, True)
    ids_ref, w_ref = fo.route_fused(h_ref, router32, k, True)
    assert torch.equal(ids.cpu(), ids_ref.cpu()) and torch.allclose(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6)


def _prologue_case(nh, nkv, D, norm, slot, pads, g, dev):
    """A new token per row for the attention launch with its prologue: (qkv (2, 1, (nh + 2 nkv) D) fp16, q / k norm
    weights or None, pad (2,), positions (2, 1), slots (1,), inv_freq (D / 2,))."""
    qkv = (torch.randn(2, 1, (nh + 2 * nkv) * D, generator=g) * 2).half().to(dev)
    qn = (1 + 0.1 * torch.randn(nh * D, generator=g)).half().to(dev) if norm else None
    kn = (1 + 0.1 * torch.randn(nkv * D, generator=g)).half().to(dev) if norm else None
    pad = torch.tensor(pads, device=dev)
    positions = (slot - pad).clamp(min=0).reshape(2, 1)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)).to(dev)
    return qkv, qn, kn, pad, positions, torch.tensor([slot], device=dev), inv_freq


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the keyless row's 0 / 0
@pytest.mark.parametrize("nh,nkv,D,norm", [(4, 2, 16, True), (4, 4, 32, False), (2, 1, 128, True)])
# the last two: no split's share holds the slot (a pad past the slot's block; a slot past the bucket), where split 0
# writes k / v all the same (the engine never asks for these: n_keys covers the slot and pads are at most the slot)
@pytest.mark.parametrize("slot,n_keys,pads", [(0, 32, (0, 0)), (70, 256, (0, 5)), (130, 256, (3, 130)),
                                              (255, 256, (255, 1)), (300, 512, (31, 299)), (10, 256, (0, 100)),
                                              (260, 256, (0, 3))])
def test_decode_attention_with_prologue_equals_the_three_launches(nh, nkv, D, norm, slot, n_keys, pads, test_device):
    """The prologue folded into the attention launch: the same attention output and the same KV cache (the new
    token's k and v written at the slot of every row's kv heads, nothing else touched) as qk_norm_rope_kv followed by
    decode_attention; slots at the first key, at block and split boundaries, a row whose only key is the new one."""
    import runmap.kernels.fused_ops as fo

    g = torch.Generator().manual_seed(slot * 7 + D)
    dev = torch.device(test_device)
    B = 2
    qkv, qn, kn, pad, positions, slots, inv_freq = _prologue_case(nh, nkv, D, norm, slot, pads, g, dev)
    kc = (torch.randn(B + 1, nkv, n_keys + 8, D, generator=g) * 3).half().to(dev)  # one row more than the batch
    vc = torch.randn(B + 1, nkv, n_keys + 8, D, generator=g).half().to(dev)
    kc2, vc2 = kc.clone(), vc.clone()
    q = fo.qk_norm_rope_kv(qkv, qn, kn, positions, slots, inv_freq, kc[:B], vc[:B], num_heads=nh, num_kv_heads=nkv,
                           eps=1e-6)
    ref = fo.decode_attention(q, kc[:B], vc[:B], slots, pad, n_keys)
    out = fo.decode_attention_with_prologue(qkv, qn, kn, positions, slots, inv_freq, kc2[:B], vc2[:B], pad, n_keys,
                                            num_heads=nh, num_kv_heads=nkv, eps=1e-6)
    assert torch.equal(kc2.cpu(), kc.cpu()) and torch.equal(vc2.cpu(), vc.cpu())
    # a row without keys (pad past the slot) is NaN on both paths
    tol = 0.0 if dev.type == "cpu" else 2e-3
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("nh,nkv,D,norm", [(4, 2, 16, False), (2, 1, 128, True)])
# splits of two and four blocks: the slot in a split's later block (row 0) or its first (row 1), a pad inside the
# first block, a pad at the slot
@pytest.mark.parametrize("slot,n_keys,pads", [(1000, 1024, (0, 40)), (1023, 1024, (5, 1023)), (1990, 2048, (0, 33))])
def test_decode_attention_with_prologue_reads_ahead_only_earlier_keys(nh, nkv, D, norm, slot, n_keys, pads,
                                                                      test_device):
    """The attention launch reads its split's first key block before its chained wait (docs/kernels.md) and the new
    slot's row after writing it: with the slot's old k / v poisoned (NaN) and splits of several blocks, the output
    and the cache equal qk_norm_rope_kv followed by decode_attention (a stale slot row would bring the NaN in)."""
    import runmap.kernels.fused_ops as fo

    g = torch.Generator().manual_seed(slot + D)
    dev = torch.device(test_device)
    B = 2
    qkv, qn, kn, pad, positions, slots, inv_freq = _prologue_case(nh, nkv, D, norm, slot, pads, g, dev)
    kc = (torch.randn(B, nkv, n_keys, D, generator=g) * 3).half()
    vc = torch.randn(B, nkv, n_keys, D, generator=g).half()
    kc[:, :, slot] = float("nan")
    vc[:, :, slot] = float("nan")
    kc, vc = kc.to(dev), vc.to(dev)
    kc2, vc2 = kc.clone(), vc.clone()
    q = fo.qk_norm_rope_kv(qkv, qn, kn, positions, slots, inv_freq, kc, vc, num_heads=nh, num_kv_heads=nkv, eps=1e-6)
    ref = fo.decode_attention(q, kc, vc, slots, pad, n_keys)
    out = fo.decode_attention_with_prologue(qkv, qn, kn, positions, slots, inv_freq, kc2, vc2, pad, n_keys,
                                            num_heads=nh, num_kv_heads=nkv, eps=1e-6)
    assert torch.equal(kc2.cpu(), kc.cpu()) and torch.equal(vc2.cpu(), vc.cpu())
    assert not torch.isnan(out.float()).any()
    tol = 0.0 if dev.type == "cpu" else 2e-3
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)


@triton.jit
def _split_keys_probe_kernel(slot_ptr, pad_ptr, out_ptr, N_KEYS: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr):
    case = tl.program_id(0)
    sp = tl.program_id(1)
    n0, end, covered = _split_keys(tl.load(slot_ptr + case), tl.load(pad_ptr + case), sp, N_KEYS, BLOCK_N, SPLITS)
    tl.store(out_ptr + (case * SPLITS + sp) * 3, n0)
    tl.store(out_ptr + (case * SPLITS + sp) * 3 + 1, end)
    tl.store(out_ptr + (case * SPLITS + sp) * 3 + 2, covered.to(tl.int32))


@pytest.mark.parametrize("n_keys", [32, 96, 256, 512])
def test_split_keys_deal_every_key_once_and_one_split_holds_the_slot(n_keys, test_device):
    """The splits' shares of a row's keys are contiguous, disjoint, whole blocks from the row's first block, cover
    its first block .. min(slot + 1, n_keys) exactly, and exactly one holds the slot when ``covered`` (the writer
    of the new k / v in decode_attention_with_prologue; none otherwise)."""
    from runmap.kernels.fused_ops import attention_splits

    block_n, splits = attention_splits(n_keys)  # as the wrappers
    # every 7th slot up to 96 keys; past that a sparser stride (the interpreter runs each program in Python) plus the
    # slots around the first two block edges and the last
    block_edges = {e + d for e in (block_n, 2 * block_n, n_keys) for d in (-1, 0, 1)}
    slots = sorted(set(range(0, n_keys + 40, 7 if n_keys <= 96 else 29)) | block_edges | {n_keys + 39})
    cases = [(slot, pad) for slot in slots for pad in (0, 1, 31, 32, 33, slot, slot + 1, slot + 40)]
    slot_t = torch.tensor([c[0] for c in cases], dtype=torch.int64, device=test_device)
    pad_t = torch.tensor([c[1] for c in cases], dtype=torch.int64, device=test_device)
    out = torch.full((len(cases), splits, 3), -7, dtype=torch.int32, device=test_device)
    _split_keys_probe_kernel[(len(cases), splits)](slot_t, pad_t, out, N_KEYS=n_keys, BLOCK_N=block_n, SPLITS=splits)
    out = out.cpu().tolist()
    for (slot, pad), shares in zip(cases, out):
        lo, hi = pad // block_n * block_n, min(slot + 1, n_keys)
        covered = lo <= slot < n_keys
        assert all(c == int(covered) for _n0, _end, c in shares), (slot, pad)
        keys = [k for n0, end, _c in shares for k in range(n0, end)]
        assert keys == list(range(lo, hi)), (slot, pad)  # in order, each once, nothing past the bucket
        assert all(n0 % block_n == 0 or n0 >= end for n0, end, _c in shares), (slot, pad)
        holders = [sp for sp, (n0, end, _c) in enumerate(shares) if n0 <= slot < end]
        assert len(holders) == (1 if covered else 0), (slot, pad, holders)


def test_decode_attention_with_prologue_refuses_what_it_cannot_run():
    from runmap.kernels.fused_ops import decode_attention_with_prologue

    qkv = torch.zeros(1, 1, 5 * 24).half()  # D = 24: not a power of two
    with pytest.raises(ValueError, match="power of two"):
        decode_attention_with_prologue(qkv, None, None, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                       torch.ones(12), torch.zeros(1, 1, 8, 24).half(), torch.zeros(1, 1, 8, 24).half(),
                                       torch.zeros(1, dtype=torch.long), 8, num_heads=3, num_kv_heads=1, eps=1e-6)


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
@cpu_model
def test_decode_step_runs_the_folded_launches(preset, monkeypatch):
    """With every fused op on, a decode step takes the norm-with-router and prologue-in-attention launches (the
    separate norm, logits and prologue kernels are not called), and a prefill pass keeps the separate prologue."""
    import runmap.kernels.fused_ops as fo

    cfg, _ = load_preset(preset)
    nonrouted, rows, layout = random_case(cfg, seed=3)
    model, experts = our_model(cfg, nonrouted, rows, layout)
    model.fused = frozenset(ALL)
    calls = []
    for name in ("qk_norm_rope_kv", "decode_attention", "decode_attention_with_prologue", "add_norm_router_logits",
                 "route_fused", "route_topk", "gemv", "shared_expert_one_row", "silu_mul_rows", "shared_gate_add"):
        real = getattr(fo, name)
        monkeypatch.setattr(fo, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw))[1])
    kv = KVCache(cfg, 1, 8, "cpu")
    tokens = torch.tensor([[5, 6, 7]])
    model.forward(tokens, torch.arange(3)[None], kv, torch.arange(3), torch.zeros(1, dtype=torch.long), 3, experts)
    prefill, calls[:] = list(calls), []
    model.forward(tokens[:, :1], torch.tensor([[3]]), kv, torch.tensor([3]), torch.zeros(1, dtype=torch.long), 4,
                  experts)
    L = cfg.num_layers
    assert prefill.count("qk_norm_rope_kv") == L and "decode_attention_with_prologue" not in prefill
    assert "gemv" not in prefill and calls.count("gemv") == 2 * L  # q|k|v and o of the one token, each layer
    assert calls.count("decode_attention_with_prologue") == L and calls.count("add_norm_router_logits") == L
    assert calls.count("route_topk") == L
    # a family with a shared expert (Qwen2-MoE) runs it as one GEMV and one down launch per layer
    assert calls.count("shared_expert_one_row") == (L if cfg.shared_expert_intermediate_size else 0)
    assert "shared_expert_one_row" not in prefill
    # ... and a prompt's rows in two GEMMs with two launches between them (op "shared")
    shared_layers = L if cfg.shared_expert_intermediate_size else 0
    assert prefill.count("silu_mul_rows") == prefill.count("shared_gate_add") == shared_layers
    assert "silu_mul_rows" not in calls and "shared_gate_add" not in calls
    assert not {"qk_norm_rope_kv", "decode_attention", "route_fused"} & set(calls)


@pytest.mark.parametrize("n,k,bias,narrow_block_k,block_k", [
    (6144, 2048, False, 512, 512), (2048, 2048, True, 512, 512), (37, 600, True, 512, 512), (5, 8, False, 512, 512),
    (2048, 2048, True, 2048, 2048), (37, 600, True, 2048, 1024), (7, 1500, False, 1024, 1024),
    (6144, 2048, False, 2048, 512)])
def test_gemv_matches_an_fp32_product(n, k, bias, narrow_block_k, block_k, test_device, monkeypatch):
    """One row times a (N, K) fp16 weight (+ bias): odd N (a partial last block of rows), K not a multiple of the
    512-wide K tile; within fp16 rounding of the FP32 product. narrow_block_k: fused_ops.GEMV_NARROW_BLOCK_K, the K
    chunk of projections narrower than 4,096 (the default 2048 holds a 2,048 row whole and a 600 row in one chunk of
    1,024; 1024 takes a 1,500 row in two chunks, the last partial; 512 as before)."""
    import runmap.kernels.fused_ops as fo
    from runmap.kernels.fused_ops import gemv

    monkeypatch.setattr(fo, "GEMV_NARROW_BLOCK_K", narrow_block_k)
    assert fo._gemv_block_k(n, k) == block_k  # a wide projection (N >= 4,096) keeps 512

    g = torch.Generator().manual_seed(n + k)
    dev = torch.device(test_device)
    x = torch.randn(1, 1, k, generator=g).half().to(dev)
    w = (torch.randn(n, k, generator=g) * 0.05).half().to(dev)
    b = torch.randn(n, generator=g).half().to(dev) if bias else None
    y = gemv(x, w, b)
    ref = x.float().reshape(1, k) @ w.float().t() + (b.float() if bias else 0)  # (1, N)
    assert y.shape == (1, 1, n) and y.dtype == torch.float16 and torch.isfinite(y).all()
    err = (y.float().reshape(1, n) - ref).abs().max().item()
    assert err <= 2e-3 * ref.abs().max().item() + 1e-3, err


def test_gemv_refuses_more_than_one_row():
    from runmap.kernels.fused_ops import gemv

    with pytest.raises(ValueError, match="one fp16 row"):
        gemv(torch.zeros(2, 8).half(), torch.zeros(4, 8).half())


@pytest.mark.parametrize("hid,inter", [(2048, 1408), (96, 40), (37, 600), (8, 5)])
@pytest.mark.sweep(lambda p: p["hid"] == 2048)  # the CPU run: the odd shapes; Qwen1.5-MoE's on a GPU (conftest.py)
def test_shared_expert_one_row_matches_the_torch_path(hid, inter, test_device):
    """The two-launch shared expert of one token against Transformer.moe_block's torch sequence (the same fp16
    roundings) and against an FP32 product: odd H (a partial last block of rows), Is not a multiple of the K tile."""
    import torch.nn.functional as F

    from runmap.kernels.fused_ops import shared_expert_one_row

    g = torch.Generator().manual_seed(hid + inter)
    dev = torch.device(test_device)
    h = torch.randn(1, hid, generator=g).half().to(dev)
    gug = (torch.randn(2 * inter + 1, hid, generator=g) / hid ** 0.5).half().to(dev)
    down = (torch.randn(hid, inter, generator=g) / inter ** 0.5).half().to(dev)
    y = torch.randn(1, hid, generator=g).half().to(dev)
    out = shared_expert_one_row(h, gug, down, y)
    assert out.shape == (1, hid) and out.dtype == torch.float16 and torch.isfinite(out).all()
    assert out.data_ptr() != y.data_ptr()  # a new tensor: the routed output is left as it was
    # the torch path's steps (fp32 math from fp16 values, fp16 between ops)
    hf = h.float().cpu()
    gu = (hf @ gug.float().cpu()[:-1].t()).half()  # (1, 2 Is)
    gl = (hf @ gug.float().cpu()[-1:].t()).half()  # (1, 1)
    a = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).half()
    s = (a.float() @ down.float().cpu().t()).half()
    ref = (y.float().cpu() + torch.sigmoid(gl.float()) * s.float()).half().float()
    err = (out.float().cpu() - ref).abs().max().item()
    assert err <= 4e-3 * ref.abs().max().item() + 2e-3, err
    # and the whole thing in fp32: the roundings stay within fp16 steps
    a32 = F.silu(hf @ gug.float().cpu()[:inter].t()) * (hf @ gug.float().cpu()[inter:-1].t())
    ref32 = y.float().cpu() + torch.sigmoid(hf @ gug.float().cpu()[-1:].t()) * (a32 @ down.float().cpu().t())
    assert (out.float().cpu() - ref32).abs().max().item() <= 2e-2 * ref32.abs().max().item() + 1e-2


def test_shared_expert_one_row_refuses_what_it_cannot_run():
    from runmap.kernels.fused_ops import shared_expert_one_row

    h, y = torch.zeros(1, 8).half(), torch.zeros(1, 8).half()
    with pytest.raises(ValueError, match="shared_expert_one_row"):
        shared_expert_one_row(torch.zeros(2, 8).half(), torch.zeros(11, 8).half(), torch.zeros(8, 5).half(), y)
    with pytest.raises(ValueError, match="shared_expert_one_row"):  # gate | up | gate row must be 2 Is + 1 rows
        shared_expert_one_row(h, torch.zeros(10, 8).half(), torch.zeros(8, 5).half(), y)


@pytest.mark.parametrize("n,hid,inter", [(8, 2048, 1408), (3, 96, 40), (5, 37, 600), (1, 8, 5), (0, 16, 8)])
@pytest.mark.sweep(lambda p: p["hid"] == 2048)  # the CPU run: the odd shapes; Qwen1.5-MoE's on a GPU (conftest.py)
def test_shared_expert_rows_match_the_torch_path(n, hid, inter, test_device):
    """The shared expert of several rows (fused op "shared": silu_mul_rows and shared_gate_add around two GEMMs)
    against Transformer.moe_block's torch sequence (the same fp16 roundings) and an FP32 product: odd H and Is (partial
    last blocks), rows of gu strided, zero rows, every buffer the wrappers allocate poisoned (NaN)."""
    import torch.nn.functional as F

    from runmap.kernels import check as kc
    from runmap.kernels.fused_ops import shared_gate_add, silu_mul_rows

    g = torch.Generator().manual_seed(n * 7 + hid + inter)
    dev = torch.device(test_device)
    h = torch.randn(n, hid, generator=g).half().to(dev)
    wgu = (torch.randn(2 * inter, hid, generator=g) / hid ** 0.5).half().to(dev)
    wg = (torch.randn(1, hid, generator=g) / hid ** 0.5).half().to(dev)
    down = (torch.randn(hid, inter, generator=g) / inter ** 0.5).half().to(dev)
    y = torch.randn(n, hid, generator=g).half().to(dev)
    undo = kc.poison_allocations()
    try:
        wide = torch.full((n, 2 * inter + 3), float("nan"), dtype=torch.float16, device=dev)  # strided rows of gu
        gu = wide[:, :2 * inter]
        gu.copy_((h.float() @ wgu.float().t()).half())
        a = silu_mul_rows(gu)
        s = (a.float() @ down.float().t()).half()
        out = shared_gate_add(h, wg, s, y)
    finally:
        undo()
    assert out.shape == (n, hid) and out.dtype == torch.float16 and torch.isfinite(out).all()
    assert a.shape == (n, inter) and torch.isfinite(a).all()
    hf, gu_c = h.float().cpu(), gu.float().cpu()
    gl = (hf @ wg.float().cpu().t()).half()  # (N, 1): the gate's GEMV rounds to fp16
    ref = (y.float().cpu() + torch.sigmoid(gl.float()) * s.float().cpu()).half().float()
    if n:  # (zero rows: the shapes and dtypes above are the whole check)
        a_ref = (F.silu(gu_c[:, :inter]) * gu_c[:, inter:]).half()
        a_err = (a.float().cpu() - a_ref.float()).abs().max().item()
        assert a_err <= 2e-3 * a_ref.float().abs().max().item() + 1e-3, a_err
        err = (out.float().cpu() - ref).abs().max().item()
        assert err <= 2e-3 * ref.abs().max().item() + 1e-3, err
        a32 = F.silu(hf @ wgu.float().cpu()[:inter].t()) * (hf @ wgu.float().cpu()[inter:].t())
        ref32 = y.float().cpu() + torch.sigmoid(hf @ wg.float().cpu().t()) * (a32 @ down.float().cpu().t())
        assert (out.float().cpu() - ref32).abs().max().item() <= 2e-2 * ref32.abs().max().item() + 1e-2


def test_shared_expert_rows_refuse_what_they_cannot_run():
    from runmap.kernels.fused_ops import shared_gate_add, silu_mul_rows

    with pytest.raises(ValueError, match="silu_mul_rows"):  # an odd width is not gate | up
        silu_mul_rows(torch.zeros(2, 7).half())
    with pytest.raises(ValueError, match="silu_mul_rows"):
        silu_mul_rows(torch.zeros(2, 8))
    h = torch.zeros(2, 8).half()
    with pytest.raises(ValueError, match="shared_gate_add"):  # the gate row must have H values
        shared_gate_add(h, torch.zeros(1, 7).half(), h.clone(), h.clone())
    with pytest.raises(ValueError, match="shared_gate_add"):
        shared_gate_add(h, torch.zeros(1, 8).half(), torch.zeros(3, 8).half(), h.clone())


# keys past the slot (extra_keys 7) matter to the ops that attend: every fused set with attention takes both
@pytest.mark.parametrize("preset,fused,extra_keys", [
    ("tiny-olmoe", (), 0), ("tiny-olmoe", ALL, 0), ("tiny-olmoe", ALL, 7), ("tiny-qwen2-moe", ALL, 0),
    ("tiny-qwen2-moe", ALL, 7), ("tiny-olmoe", ("attn",), 0), ("tiny-olmoe", ("attn",), 7),
    ("tiny-olmoe", ("norm", "router"), 0), ("tiny-olmoe", ("prologue",), 7)])
@cpu_model
def test_a_mixed_pass_equals_a_decode_step_and_the_prompt_alone(preset, fused, extra_keys):
    """Transformer.forward_mixed (a server's mixed join) with the fused ops as a GPU runs them: the running rows'
    logits and new keys are those of a plain decode step, the prompt's (left-padded to 8 positions, ending at the
    step's slot in the cache's last row) those of the prompt prefilled alone from slot 0; the extra decode row is a
    dummy. Stale cache contents (random) must be masked; attending keys past the slot (a KV-length bucket) changes
    nothing."""
    cfg, _ = load_preset(preset)
    nonrouted, rows, layout = random_case(cfg, seed=2)
    model, experts = our_model(cfg, nonrouted, rows, layout)
    if model.per_head_qk_norm:  # the fused prologue takes the whole-projection norm only
        fused = tuple(op for op in fused if op != "prologue")
    model.fused = frozenset(fused)
    g = torch.Generator().manual_seed(0)
    MB, P, Pb, T0 = 5, 5, 8, 8
    tokens = torch.randint(3, cfg.vocab_size, (2, T0), generator=g)
    pad = torch.tensor([0, 2])
    slots = torch.arange(T0)
    kv = KVCache(cfg, MB, 32, "cpu")
    torch.nn.init.normal_(kv.k)
    torch.nn.init.normal_(kv.v)
    first = model.forward(tokens, (slots[None] - pad[:, None]).clamp(min=0), kv, slots, pad, T0, experts).argmax(-1)
    slot, n_keys = T0, T0 + 1 + extra_keys
    saved = kv.k.clone(), kv.v.clone()
    want = model.forward(first.view(2, 1), (slot - pad).view(2, 1), kv, torch.tensor([slot]), pad, n_keys, experts)
    want_k = kv.k[:, :2, :, slot].clone()
    prompt = torch.randint(3, cfg.vocab_size, (1, P), generator=g)
    alone = model.forward(prompt, torch.arange(P)[None], kv.rows(MB - 2, MB - 1), torch.arange(P),
                          torch.zeros(1, dtype=torch.long), P, experts)
    alone_k = kv.k[:, MB - 2, :, :P].clone()
    kv.k.copy_(saved[0])
    kv.v.copy_(saved[1])
    step_slot = torch.tensor([slot])
    dec_pad = torch.tensor([0, 2, slot])  # row 2: a dummy that sees only its own key
    dec_tok = torch.cat([first, torch.tensor([0])]).view(3, 1)
    join_tok = torch.cat([torch.zeros(1, Pb - P, dtype=torch.long), prompt], 1)
    join_slots = slot - Pb + 1 + torch.arange(Pb)
    join_pad = torch.tensor([slot + 1 - P])
    got = model.forward_mixed(dec_tok, (step_slot - dec_pad).unsqueeze(1), step_slot, dec_pad, join_tok,
                              (join_slots[None] - join_pad[:, None]).clamp(min=0), join_slots, join_pad, kv, MB - 1,
                              n_keys, experts)
    assert got.shape == (4, cfg.vocab_size)
    torch.testing.assert_close(got[:2], want, atol=3e-3, rtol=0)
    torch.testing.assert_close(got[3:], alone, atol=3e-3, rtol=0)
    torch.testing.assert_close(kv.k[:, :2, :, slot], want_k, atol=3e-3, rtol=0)
    torch.testing.assert_close(kv.k[:, MB - 1, :, slot + 1 - P:slot + 1], alone_k, atol=3e-3, rtol=0)
