"""Checkpoint reading and synthetic checkpoints: layouts, sharding, determinism, transformers
compatibility, tokenizer, and every bad-input case (clear error naming file + tensor, no output)."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runmap.format.checkpoint import CheckpointError, CheckpointReader
from runmap.arch.config import load_preset
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import DEFAULT_INIT, EMBED_RATIO, WEIGHT_STD, embedding_std, write_synthetic

PRESETS = ["tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral"]


def _digest_dir(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{(preset, layout): checkpoint dir}; the fused ones sharded so the index path is exercised."""
    base = tmp_path_factory.mktemp("ckpt")
    out = {}
    for preset in PRESETS:
        cfg, _ = load_preset(preset)
        out[preset, "per-expert"] = write_synthetic(cfg, base / f"{preset}-pe", seed=7)
        out[preset, "fused"] = write_synthetic(cfg, base / f"{preset}-fu", seed=7, expert_layout="fused",
                                               shard_bytes=1_500_000)
    return out


# ---- synthetic checkpoints ------------------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    cfg, _ = load_preset("tiny-olmoe")
    a = write_synthetic(cfg, tmp_path / "a", seed=3)
    b = write_synthetic(cfg, tmp_path / "b", seed=3)
    c = write_synthetic(cfg, tmp_path / "c", seed=4)
    assert _digest_dir(a) == _digest_dir(b)
    assert _digest_dir(a)["model.safetensors"] != _digest_dir(c)["model.safetensors"]
    assert _digest_dir(a)["tokenizer.json"] == _digest_dir(c)["tokenizer.json"]


def test_synthetic_tensors_are_bf16_with_realistic_scales(ckpts):
    r = CheckpointReader(ckpts["tiny-olmoe", "per-expert"])
    emb = r.tensor("model.embed_tokens.weight")
    norm = r.tensor("model.layers.0.input_layernorm.weight")
    assert emb.dtype == torch.bfloat16 and norm.dtype == torch.bfloat16
    # the default init is transformers' initializer, embeddings included (the tests' checkpoints keep their bytes)
    assert DEFAULT_INIT == "hf" and embedding_std(load_preset("tiny-olmoe")[0]) == WEIGHT_STD
    assert 0.015 < emb.float().std() < 0.025
    w = r.tensor("model.layers.0.self_attn.q_proj.weight")
    assert 0.015 < w.float().std() < 0.025
    assert abs(norm.float().mean() - 1) < 0.02 and norm.float().std() < 0.1


def test_inits_differ_only_in_the_embedding_scale(tmp_path):
    cfg, _ = load_preset("tiny-qwen2-moe")
    hf = write_synthetic(cfg, tmp_path / "hf", seed=5, init="hf")
    ro = write_synthetic(cfg, tmp_path / "ro", seed=5, init="routing")
    a, b = load_file(hf / "model.safetensors"), load_file(ro / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        if name != "model.embed_tokens.weight":
            assert torch.equal(a[name], b[name]), name
    # the same draw, scaled: embeddings at EMBED_RATIO x one attention layer's output RMS, from dimensions alone
    attn = WEIGHT_STD**2 * (cfg.hidden_size * cfg.num_heads * cfg.head_dim) ** 0.5
    assert embedding_std(cfg, "routing") == pytest.approx(EMBED_RATIO * attn)
    scaled = a["model.embed_tokens.weight"].float() * (embedding_std(cfg, "routing") / WEIGHT_STD)
    torch.testing.assert_close(b["model.embed_tokens.weight"].float(), scaled, rtol=1e-2, atol=0)
    # config.json says which init wrote it; an "hf" checkpoint keeps the config written before inits existed
    assert json.loads((ro / "config.json").read_text())["runmap_synthetic"]["init"] == "routing"
    assert "init" not in json.loads((hf / "config.json").read_text())["runmap_synthetic"]


def test_synth_cli_init(tmp_path, capsys):
    from runmap.cli.main import main

    assert main(["synth", str(tmp_path / "r"), "--preset", "tiny-olmoe", "--init", "routing", "--no-progress"]) == 0
    assert "init routing" in capsys.readouterr().out
    cfg, _ = load_preset("tiny-olmoe")
    emb = CheckpointReader(tmp_path / "r").tensor("model.embed_tokens.weight").float()
    assert abs(emb.std().item() / embedding_std(cfg, "routing") - 1) < 0.05 and embedding_std(cfg, "routing") > 0.04
    # a direct pack draws its own weights: the init of a checkpoint is refused there, in one line
    assert main(["synth", str(tmp_path / "d"), "--preset", "tiny-olmoe", "--direct-pack", "--init", "routing"]) == 1
    assert "--init" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_unknown_init_is_refused_before_writing(tmp_path):
    cfg, _ = load_preset("tiny-olmoe")
    with pytest.raises(ValueError, match="init must be one of"):
        write_synthetic(cfg, tmp_path / "x", init="xavier")
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("preset", PRESETS)
def test_both_layouts_hold_identical_values(ckpts, preset):
    pe, fu = CheckpointReader(ckpts[preset, "per-expert"]), CheckpointReader(ckpts[preset, "fused"])
    assert set(pe.expert_layout.values()) == {"per-expert"} and set(fu.expert_layout.values()) == {"fused"}
    assert len(fu.files) > 1 and (fu.path / "model.safetensors.index.json").is_file()
    for layer in range(pe.config.num_layers):
        for proj in ("gate", "up", "down"):
            assert torch.equal(pe.expert_projection(layer, proj), fu.expert_projection(layer, proj))
        for e in (0, pe.config.num_experts - 1):
            a, b = pe.expert_weights(layer, e), fu.expert_weights(layer, e)
            assert all(torch.equal(a[k], b[k]) for k in ("gate", "up", "down"))
    for n in pe.nonrouted_names():
        assert torch.equal(pe.tensor(n), fu.tensor(n))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_transformers_loads_synthetic_checkpoint(ckpts, preset, layout):
    from transformers import AutoModelForCausalLM

    d = ckpts[preset, layout]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    sd = model.state_dict()
    r = CheckpointReader(d)
    i = r.config.moe_intermediate_size
    gu = sd["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, H) in transformers' memory layout
    assert torch.equal(gu[:, :i], r.expert_projection(1, "gate"))
    assert torch.equal(gu[:, i:], r.expert_projection(1, "up"))
    assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"], r.expert_projection(1, "down"))
    for n in r.nonrouted_names():  # transformers' names are the fused layout's (Mixtral: router at mlp.gate)
        assert torch.equal(sd[r.config.adapter.fused_layout_name(n)], r.tensor(n)), n


@pytest.mark.parametrize("preset", PRESETS)
def test_save_pretrained_checkpoint_loads_and_packs(tmp_path, preset):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, _ = load_preset(preset)
    hf_cfg = AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    r = CheckpointReader(tmp_path / "hf")
    assert r.config == cfg
    sd = model.state_dict()
    i = cfg.moe_intermediate_size
    assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj"][:, i:], r.expert_projection(0, "up"))
    pack = pack_checkpoint(tmp_path / "hf", tmp_path / "pack", device="cpu")
    assert (pack / "manifest.json").is_file()


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe", "olmoe-1b-7b-0924", "qwen1.5-moe-a2.7b-chat",
                                    "qwen3-30b-a3b", "mixtral-8x7b-v0.1"])
def test_tokenizer_matches_model_vocab_and_specials(tmp_path, preset):
    from transformers import AutoTokenizer

    from runmap.synth.tokenizer import write_tokenizer

    cfg, _ = load_preset(preset)
    write_tokenizer(cfg, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == cfg.vocab_size
    assert tok.eos_token_id == cfg.eos_token_id
    assert tok.pad_token_id == cfg.pad_token_id
    if cfg.bos_token_id is not None:
        assert tok.bos_token_id == cfg.bos_token_id
    text = "Write a haiku about rivers, in lowercase: 3 lines!"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = list(range(cfg.vocab_size - 40, cfg.vocab_size)) + list(range(40))
    assert all(isinstance(tok.decode([i]), str) and tok.convert_ids_to_tokens(i) is not None for i in ids)


# ---- bad input ------------------------------------------------------------------------------------
def _copy(ckpts, key, tmp_path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(ckpts[key], d)
    return d


def _edit(path: Path, fn) -> None:
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _assert_pack_fails(ckpt: Path, tmp_path: Path, *needles: str) -> str:
    out = tmp_path / "out" / "pack"
    with pytest.raises(CheckpointError) as ei:
        pack_checkpoint(ckpt, out, device="cpu")
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert not out.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []  # no temp dir left
    return msg


def test_missing_shard(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-olmoe", "fused"), tmp_path)
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    _assert_pack_fails(d, tmp_path, shards[1].name, "missing shard", "model.layers.")


def test_truncated_safetensors(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-qwen2-moe", "per-expert"), tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _assert_pack_fails(d, tmp_path, str(f), "truncated", "lm_head.weight")


def test_missing_expert_tensor(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    _edit(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.experts.5.down_proj.weight"))
    _assert_pack_fails(d, tmp_path, "missing expert tensor", "model.layers.1.mlp.experts.5.down_proj.weight")


def test_wrong_shape(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    _edit(d / "model.safetensors", lambda t: t.__setitem__(name, t[name][:-2].clone()))
    _assert_pack_fails(d, tmp_path, str(d / "model.safetensors"), name, "shape (318, 256)", "expected (320, 256)")


def test_unsupported_architecture(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_pack_fails(d, tmp_path, str(d / "config.json"), "deepseek_v2")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_inf_in_expert(ckpts, tmp_path, value):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit(d / "model.safetensors", lambda t: t[name].__setitem__((4, 7), value))
    _assert_pack_fails(d, tmp_path, str(d / "model.safetensors"), name, "NaN/Inf")


def test_nan_in_fused_expert_names_expert(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-qwen2-moe", "fused"), tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    _edit(d / shard, lambda t: t[name].__setitem__((4, 200, 3), float("nan")))  # row 200 >= I: the up half
    _assert_pack_fails(d, tmp_path, shard, name + "[4][up half]", "NaN/Inf")


def test_nan_in_nonrouted(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-qwen2-moe", "per-expert"), tmp_path)
    name = "model.layers.1.mlp.shared_expert_gate.weight"
    _edit(d / "model.safetensors", lambda t: t[name].__setitem__((0, 1), float("nan")))
    _assert_pack_fails(d, tmp_path, str(d / "model.safetensors"), name, "NaN/Inf")


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.mlp.experts.1.gate_proj.weight"])
def test_bf16_to_fp16_overflow(ckpts, tmp_path, name):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    _edit(d / "model.safetensors", lambda t: t[name].__setitem__((1, 1), 70000.0))  # BF16 holds it, FP16 does not
    msg = _assert_pack_fails(d, tmp_path, str(d / "model.safetensors"), name, "overflows FP16")
    assert "65504" in msg


def test_unexpected_tensor_is_an_error(ckpts, tmp_path):
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    _edit(d / "model.safetensors", lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    _assert_pack_fails(d, tmp_path, "model.layers.0.mlp.extra.weight", "unexpected tensor")


def test_interrupted_synth_leaves_nothing(tmp_path, monkeypatch):
    from runmap.synth import checkpoint as synthetic

    calls = []
    real = synthetic._generate

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(synthetic, "_generate", boom)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic(load_preset("tiny-olmoe")[0], tmp_path / "ck", shard_bytes=500_000)
    assert len(calls) == 20 and list(tmp_path.iterdir()) == []


def test_error_messages_name_file_and_tensor(ckpts, tmp_path):
    """One full message, checked verbatim in shape: '<file>: tensor '<name>' ...'."""
    d = _copy(ckpts, ("tiny-olmoe", "per-expert"), tmp_path)
    name = "model.layers.0.self_attn.q_norm.weight"
    _edit(d / "model.safetensors", lambda t: t[name].__setitem__(3, float("inf")))
    msg = _assert_pack_fails(d, tmp_path, name)
    assert msg == f"{d / 'model.safetensors'}: tensor '{name}' has 1 NaN/Inf value(s)"
