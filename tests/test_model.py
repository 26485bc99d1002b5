"""runmap.engine.model against transformers' own OLMoE / Qwen2-MoE / Qwen3-MoE / Mixtral on random tiny models held in memory.

transformers runs in FP32 with the FP16-rounded non-routed weights and the dequantized experts; our model
runs its FP16 path with a torch routed-experts function over the same dequantized weights. Checked: prefill
logits at every position, 32 decode steps through the KV cache (teacher-forced with our greedy tokens),
and the top-k expert ids of every layer at every step.
"""
import pytest
import torch

from runmap.arch.config import load_preset
from runmap.engine.model import KVCache, Transformer, attention_mask, experts_dense_torch, load_weights, nonrouted_names
from test_model_support import RouteRecorder, hf_reference, random_case

PRESETS = ["tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral"]


def close(ours, ref, what):
    """FP16-path tolerance: |diff| <= 5e-3 * max|ref| + 1e-3 elementwise (measured ~1e-3 * max)."""
    err = (ours - ref).abs().max().item()
    bound = 5e-3 * ref.abs().max().item() + 1e-3
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def our_model(cfg, nonrouted, rows, layout):
    def get(name):
        if name not in nonrouted:
            raise KeyError(name)
        return nonrouted[name]

    model = Transformer(cfg, load_weights(get, cfg, "cpu"))
    deq = [[layout.dequantize_expert(r[e]) for e in range(cfg.num_experts)] for r in rows]

    def experts(layer, x, ids, gw):
        return experts_dense_torch(x, ids, gw, lambda e: (deq[layer][e]["gate"], deq[layer][e]["up"],
                                                            deq[layer][e]["down"]))
    return model, experts


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_and_32_decode_steps_match_transformers(preset):
    cfg, _ = load_preset(preset)
    nonrouted, rows, layout = random_case(cfg, seed=1)
    assert set(nonrouted_names(cfg)) <= set(nonrouted)
    ref = hf_reference(cfg, nonrouted.__getitem__, rows.__getitem__, layout)
    rec = RouteRecorder(ref)
    model, experts = our_model(cfg, nonrouted, rows, layout)
    model.route_log = []

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, cfg.vocab_size, (1, 11), generator=g)
    T = prompt.shape[1]
    kv = KVCache(cfg, 1, 64, "cpu")
    pad = torch.zeros(1, dtype=torch.long)
    ours = model.forward(prompt, torch.arange(T)[None], kv, torch.arange(T), pad, T, experts, all_logits=True)
    with torch.no_grad():
        out = ref(input_ids=prompt, use_cache=True)
    close(ours[0], out.logits[0], f"{preset} prefill logits")
    assert_same_routes(model.route_log, rec.take(), f"{preset} prefill")
    model.route_log = []
    past = out.past_key_values

    tok = ours[0, -1].argmax().view(1, 1)
    for step in range(32):
        slot = T + step
        ours = model.forward(tok, torch.tensor([[slot]]), kv, torch.tensor([slot]), pad, slot + 1, experts)
        with torch.no_grad():
            out = ref(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        close(ours[0], out.logits[0, -1], f"{preset} decode step {step}")
        assert_same_routes(model.route_log, rec.take(), f"{preset} decode step {step}")
        model.route_log = []
        tok = ours[0].argmax().view(1, 1)


def assert_same_routes(ours, ref, what):
    assert [layer for layer, _ in ours] == [layer for layer, _ in ref], what
    for (layer, a), (_, b) in zip(ours, ref):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values), f"{what}: layer {layer} top-k ids differ"


def test_attention_mask_left_padding():
    m = attention_mask(torch.tensor([2, 3]), torch.tensor([0, 3]), 5)[:, 0]  # (B=2, T=2, S=5)
    assert m[0, 0].tolist() == [True, True, True, False, False]
    assert m[0, 1].tolist() == [True, True, True, True, False]
    assert m[1, 0].tolist() == [False, False, True, False, False]  # padding query sees only itself
    assert m[1, 1].tolist() == [False, False, False, True, False]


def test_load_weights_names_the_bad_tensor():
    cfg, _ = load_preset("tiny-olmoe")
    nonrouted, _, _ = random_case(cfg, seed=0)
    bad = dict(nonrouted)
    bad["model.layers.1.self_attn.k_norm.weight"] = torch.ones(7, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight: shape \(7,\)"):
        load_weights(bad.__getitem__, cfg, "cpu")
    bad = dict(nonrouted)
    bad["model.norm.weight"] = bad["model.norm.weight"].float()
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected float16"):
        load_weights(bad.__getitem__, cfg, "cpu")
