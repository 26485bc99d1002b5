"""The model-family adapters (runmap/arch/): the registry agrees with the specs and schemas, every preset
round-trips through its adapter's config.json and transformers' own config class, the adapter's tensor
inventory is exactly transformers' own model (meta device, fused names; save_pretrained, per-expert names),
dense layers fail with one clear error naming the layer, and a family added in a test (one adapter in a
monkeypatched registry, nothing else) is parsed, synthesized, read and run through it."""
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runmap.arch import registry
from runmap.arch.base import (MLP_DENSE, MLP_ROUTED, MLP_ROUTED_SHARED, QK_NORM_KINDS, QK_NORM_PER_HEAD, ArchAdapter,
                              ConfigError, UnsupportedLayerError)
from runmap.arch.config import ARCHITECTURES, ModelConfig, load_preset, preset_names
from runmap.engine.model import Transformer, load_weights
from runmap.format.checkpoint import CheckpointReader, expected_nonrouted, expert_names
from runmap.format.pack import pack_checkpoint
from runmap.format.safetensors_io import read_header
from runmap.synth.checkpoint import write_synthetic

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ["tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral"]


def hf_config(cfg: ModelConfig):
    """transformers' own config object of the family, built from the adapter's config.json dict."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(**cfg.to_hf_dict())


def meta_state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of transformers' own model of ``cfg`` built on the meta device (no memory)."""
    with torch.device("meta"):
        model = cfg.adapter.hf_model_class()(hf_config(cfg))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def inventory(cfg: ModelConfig, layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint whose layers all have ``layout`` (fused: transformers' in-memory names)."""
    rename = cfg.adapter.fused_layout_name if layout == "fused" else (lambda n: n)
    out = {rename(n): s for n, s in expected_nonrouted(cfg).items()}
    for l in range(cfg.num_layers):
        out.update(expert_names(cfg, l, layout))
    return out


# ---- the registry against specs/architecture.yaml and the schemas ------------------------------

def test_registry_agrees_with_specs_and_schemas():
    spec = yaml.safe_load((REPO_ROOT / "specs/architecture.yaml").read_text())
    common = json.loads((REPO_ROOT / "schemas/common.schema.json").read_text())["$defs"]
    preset = json.loads((REPO_ROOT / "schemas/model-preset.schema.json").read_text())["properties"]["config"]
    assert sorted(spec["models"]["architectures"]) == sorted(ARCHITECTURES)
    assert sorted(common["architecture"]["enum"]) == sorted(ARCHITECTURES)
    assert preset["properties"]["arch"] == {"$ref": "common.schema.json#/$defs/architecture"}
    # the preset schema requires a shared expert size exactly for the families that have a shared expert
    assert sorted(t for t, a in ARCHITECTURES.items() if a.shared_expert) == sorted(preset["if"]["properties"]["arch"]["enum"])


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_adapter_states_its_facts(model_type):
    a = ARCHITECTURES[model_type]
    assert a.model_type == model_type and a.qk_norm in QK_NORM_KINDS
    assert a.hf_model_class().__name__ == a.hf_architecture
    assert a.hf_config_class().model_type == model_type
    assert {p.stem for p in (REPO_ROOT / "specs/models").glob("*.yaml")
            if yaml.safe_load(p.read_text())["config"]["arch"] == model_type}, f"no preset for {model_type}"


def test_unknown_arch_is_one_clear_error():
    cfg, _ = load_preset("tiny-olmoe")
    d = cfg.to_hf_dict() | {"model_type": "deepseek_v2"}
    with pytest.raises(ConfigError, match=r"x/config\.json: unsupported model_type 'deepseek_v2'.*"
                                          r"supported: \['mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'\]"):
        ModelConfig.from_hf_dict(d, source="x/config.json")
    with pytest.raises(ConfigError, match=r"ModelConfig\.arch: unsupported model_type 'deepseek_v2'"):
        ModelConfig(**{**_fields(cfg), "arch": "deepseek_v2"})


def _fields(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


# ---- config.json round trip -----------------------------------------------------------------------

@pytest.mark.parametrize("preset", preset_names())
def test_preset_round_trips_through_adapter_and_transformers(preset):
    cfg, _ = load_preset(preset)
    d = cfg.to_hf_dict()
    assert d["model_type"] == cfg.arch and d["architectures"] == [cfg.hf_architecture]
    assert ModelConfig.from_hf_dict(d) == cfg
    hf = hf_config(cfg)
    assert type(hf) is cfg.adapter.hf_config_class()
    # transformers keeps rope_theta inside rope_parameters and renames torch_dtype to dtype
    for key, value in d.items():
        if key not in ("rope_theta", "torch_dtype"):
            assert getattr(hf, key) == value, key
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert ModelConfig.from_hf_dict(hf.to_dict(), source=f"{preset} via transformers") == cfg


# ---- tensor inventory against transformers' own model ----------------------------------------------

@pytest.mark.parametrize("preset", preset_names())
def test_fused_inventory_is_transformers_meta_model(preset):
    cfg, _ = load_preset(preset)
    assert inventory(cfg, "fused") == meta_state_shapes(cfg)


small_configs = st.builds(
    lambda arch, layers, kv, group, hd, experts, k, inter, shared, tie: ModelConfig(
        arch=arch, vocab_size=64, hidden_size=kv * group * hd, num_layers=layers, num_heads=kv * group,
        num_kv_heads=kv, moe_intermediate_size=inter, num_experts=experts, top_k=min(k, experts),
        shared_expert_intermediate_size=shared if ARCHITECTURES[arch].shared_expert else 0,
        intermediate_size=2 * inter, tie_word_embeddings=tie,
        norm_topk_prob=ARCHITECTURES[arch].hf_defaults.get("norm_topk_prob", False)),
    st.sampled_from(sorted(ARCHITECTURES)), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
    st.sampled_from([2, 4, 8]), st.integers(1, 6), st.integers(1, 3), st.sampled_from([2, 4, 6]),
    st.sampled_from([2, 8]), st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=small_configs)
def test_fused_inventory_matches_transformers_for_any_small_config(cfg):
    want = meta_state_shapes(cfg)
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    assert inventory(cfg, "fused") == want


@pytest.mark.parametrize("preset", TINY)
def test_per_expert_inventory_is_what_transformers_saves(preset, tmp_path):
    cfg, _ = load_preset(preset)
    torch.manual_seed(0)
    cfg.adapter.hf_model_class()(hf_config(cfg)).save_pretrained(tmp_path)
    header, _ = read_header(tmp_path / "model.safetensors")
    saved = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    assert inventory(cfg, "per-expert") == saved


# ---- dense layers ---------------------------------------------------------------------------------

def _dense_qwen(**hf_overrides) -> ModelConfig:
    cfg, _ = load_preset("tiny-qwen2-moe")
    return ModelConfig.from_hf_dict(cfg.to_hf_dict() | hf_overrides, source="dense test")


def test_dense_layers_parse_and_match_transformers():
    assert _dense_qwen(mlp_only_layers=[1]).dense_layers == (1,)
    assert _dense_qwen(decoder_sparse_step=2).dense_layers == (0,)  # layer l is MoE iff (l + 1) % step == 0
    cfg = _dense_qwen(mlp_only_layers=[0])
    assert [cfg.adapter.mlp_kind(cfg, l) for l in range(cfg.num_layers)] == [MLP_DENSE, MLP_ROUTED_SHARED]
    assert cfg.adapter.routed_layers(cfg) == [1]
    assert inventory(cfg, "fused") == meta_state_shapes(cfg)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    olmoe, _ = load_preset("tiny-olmoe")
    assert [olmoe.adapter.mlp_kind(olmoe, l) for l in range(olmoe.num_layers)] == [MLP_ROUTED] * olmoe.num_layers
    with pytest.raises(ConfigError, match=r"olmoe: dense_layers \[0\], but this family has none"):
        ModelConfig(**{**_fields(olmoe), "dense_layers": [0]})


def test_dense_layer_is_one_clear_error_in_pack_and_engine(tmp_path):
    cfg = _dense_qwen(mlp_only_layers=[0])
    ck = write_synthetic(cfg, tmp_path / "ck", seed=1, tokenizer=False)
    r = CheckpointReader(ck)  # the inventory, dense MLP included, is checked as usual
    assert r.config == cfg and sorted(r.expert_layout) == [1]
    with pytest.raises(UnsupportedLayerError, match=r"runmap pack: layer 0 of this qwen2_moe model is a dense"):
        pack_checkpoint(ck, tmp_path / "pack", device="cpu")
    assert not (tmp_path / "pack").exists()
    with pytest.raises(UnsupportedLayerError, match=r"runmap engine: layer 0 .* dense \(non-MoE\) MLP layer"):
        load_weights(lambda name: r.tensor_fp16(name), cfg, "cpu")
    with pytest.raises(UnsupportedLayerError, match=r"Transformer: layer 0"):
        Transformer(cfg, None)


# ---- the recipe: a family added by one adapter alone ----------------------------------------------

class ToyMoeAdapter(ArchAdapter):
    """A throwaway family with everything non-default: per-head q/k norms, Mixtral-like expert names
    (block_sparse_moe.experts.{e}.w1/w3/w2, router block_sparse_moe.gate), config.json spelling of its own."""

    model_type = "toy_moe"
    hf_architecture = "ToyMoeForCausalLM"
    qk_norm = QK_NORM_PER_HEAD
    moe_module = "block_sparse_moe"
    expert_projection_names = {"gate": "w1", "up": "w3", "down": "w2"}

    def mlp_fields_from_hf(self, d, source):
        return dict(moe_intermediate_size=self.need(d, "expert_ffn_size", source),
                    num_experts=self.need(d, "num_local_experts", source))

    def family_fields_to_hf(self, cfg):
        return dict(expert_ffn_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.ARCHITECTURES, "toy_moe", ToyMoeAdapter())
    base, _ = load_preset("tiny-olmoe")
    return ModelConfig(**{**_fields(base), "arch": "toy_moe", "num_kv_heads": 2})


def test_a_registered_adapter_is_used_everywhere(toy, tmp_path):
    cfg = toy
    assert cfg.qk_norm_kind == QK_NORM_PER_HEAD and cfg.hf_architecture == "ToyMoeForCausalLM"
    d = cfg.to_hf_dict()
    assert d["num_local_experts"] == 8 and "intermediate_size" not in d
    assert ModelConfig.from_hf_dict(d) == cfg
    names = expected_nonrouted(cfg)
    assert names["model.layers.1.block_sparse_moe.gate.weight"] == (8, 256)
    assert names["model.layers.1.self_attn.q_norm.weight"] == (cfg.head_dim,)  # per head
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in expert_names(cfg, 0, "per-expert")
    pe = CheckpointReader(write_synthetic(cfg, tmp_path / "pe", seed=2, tokenizer=False))
    fu = CheckpointReader(write_synthetic(cfg, tmp_path / "fu", seed=2, expert_layout="fused", tokenizer=False))
    assert pe.config == fu.config == cfg
    for proj in ("gate", "up", "down"):
        assert torch.equal(pe.expert_projection(1, proj), fu.expert_projection(1, proj))
    w = load_weights(lambda name: pe.tensor_fp16(name), cfg, "cpu")
    assert tuple(w.layers[0].q_norm.shape) == (cfg.head_dim,)


# ---- the families added by adapters: Qwen3-MoE and Mixtral -----------------------------------------

def test_qwen3_moe_reads_both_expert_count_spellings_and_its_head_dim():
    cfg, _ = load_preset("qwen3-30b-a3b")
    assert cfg.head_dim == 128 != cfg.hidden_size // cfg.num_heads
    names = expected_nonrouted(cfg)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert names["model.layers.0.self_attn.o_proj.weight"] == (2048, 32 * 128)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (128,)  # per head
    d = cfg.to_hf_dict()
    # transformers 5.x saves the count as num_local_experts (num_experts is its alias)
    renamed = {k: v for k, v in d.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_hf_dict(renamed) == cfg
    with pytest.raises(ConfigError, match=r"q\.json: missing field 'num_local_experts'"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "num_experts"}, source="q.json")
    dense = ModelConfig.from_hf_dict(load_preset("tiny-qwen3-moe")[0].to_hf_dict() | {"mlp_only_layers": [0]})
    assert dense.dense_layers == (0,) and inventory(dense, "fused") == meta_state_shapes(dense)


def test_mixtral_refuses_what_the_engine_would_compute_differently():
    cfg, _ = load_preset("tiny-mixtral")
    d = cfg.to_hf_dict()
    # MixtralConfig has no norm_topk_prob: a config.json without it (or with false) is still renormalized
    assert ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "norm_topk_prob"}).norm_topk_prob
    with pytest.raises(ConfigError, match=r"m\.json: sliding_window=256 is shorter than max_position_embeddings=1024"):
        ModelConfig.from_hf_dict(d | {"sliding_window": 256}, source="m.json")
    assert ModelConfig.from_hf_dict(d | {"sliding_window": 4096}) == cfg  # longer than any context: no effect
    with pytest.raises(ConfigError, match=r"mixtral: norm_topk_prob must be true"):
        ModelConfig(**{**_fields(cfg), "norm_topk_prob": False})
