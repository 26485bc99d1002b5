"""Model configuration: one dataclass for both supported architectures, plus named presets.

Presets live in ``specs/models/<name>.yaml`` (schema ``schemas/model-preset.schema.json``); this module
turns a preset or a Hugging Face ``config.json`` into a ``ModelConfig`` and back.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from runmap.resources import PRESET_DIR

ARCHITECTURES = {
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


class ConfigError(ValueError):
    """A config.json or preset is missing a field or names an unsupported architecture."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "olmoe" | "qwen2_moe" (HF model_type)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    moe_intermediate_size: int  # routed expert intermediate size I
    num_experts: int
    top_k: int
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE only; 0 = no shared expert
    intermediate_size: int = 0  # dense MLP size (unused by the all-MoE presets; kept for HF round trip)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2_moe"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "olmoe"

    @property
    def hf_architecture(self) -> str:
        return ARCHITECTURES[self.arch]

    # ---- Hugging Face config.json round trip ----------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{source}: unsupported model_type {arch!r} (architectures {d.get('architectures')}); "
                f"supported: {sorted(ARCHITECTURES)}"
            )

        def need(key):
            if key not in d:
                raise ConfigError(f"{source}: missing field {key!r}")
            return d[key]

        if arch == "olmoe":
            inter, n_exp, shared = need("intermediate_size"), need("num_experts"), 0
            dense = 0  # OLMoE has no dense MLP; its intermediate_size is the expert size
        else:
            inter, n_exp = need("moe_intermediate_size"), need("num_experts")
            shared = d.get("shared_expert_intermediate_size", 0)
            dense = d.get("intermediate_size", 0)
            if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
                raise ConfigError(f"{source}: dense (non-MoE) layers are not supported (mlp_only_layers / decoder_sparse_step)")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=need("num_attention_heads"),
            num_kv_heads=d.get("num_key_value_heads") or need("num_attention_heads"),
            moe_intermediate_size=inter,
            num_experts=n_exp,
            top_k=need("num_experts_per_tok"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            intermediate_size=dense,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_checkpoint_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"{p}: not found (a checkpoint directory needs config.json)")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d, source=str(p))

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers' OlmoeConfig / Qwen2MoeConfig accepts."""
        common = dict(
            architectures=[self.hf_architecture],
            model_type=self.arch,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            hidden_act="silu",
            torch_dtype="bfloat16",
        )
        if self.arch == "olmoe":
            common.update(intermediate_size=self.moe_intermediate_size, clip_qkv=None, output_router_logits=False)
        else:
            common.update(
                intermediate_size=self.intermediate_size or self.moe_intermediate_size,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                use_sliding_window=False,
                qkv_bias=True,
                output_router_logits=False,
            )
        return common

    # ---- presets ---------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        return load_preset(name)[0]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> tuple[ModelConfig, dict]:
    """Returns (config, the whole preset dict). Preset YAML: {name, description, synthetic, config: {...}}."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model preset {name!r}; known: {preset_names()}")
    doc = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = set(doc["config"]) - fields
    if extra:
        raise ConfigError(f"{path}: unknown config fields {sorted(extra)}")
    return ModelConfig(**doc["config"]), doc
