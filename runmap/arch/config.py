"""Model configuration: one dataclass for every supported model family, plus named presets.

Presets live in ``specs/models/<name>.yaml`` (schema ``schemas/model-preset.schema.json``); this module
turns a preset or a Hugging Face ``config.json`` into a ``ModelConfig`` and back. What differs between
families (config.json spelling, tensor names, attention and MLP features) is the family's adapter
(``runmap/arch/<family>.py``, found through ``ARCHITECTURES`` in runmap/arch/registry.py);
``ModelConfig.adapter`` is the one for ``arch``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from runmap.arch.base import QK_NORM_NONE, ArchAdapter, ConfigError, UnsupportedLayerError  # noqa: F401  (re-exported)
from runmap.arch.registry import ARCHITECTURES, adapter_for  # noqa: F401  (re-exported)
from runmap.resources import PRESET_DIR


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # HF model_type, a key of ARCHITECTURES ("olmoe" | "qwen2_moe" | "qwen3_moe" | "mixtral")
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    moe_intermediate_size: int  # routed expert intermediate size I
    num_experts: int
    top_k: int
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert (families with adapter.shared_expert only)
    intermediate_size: int = 0  # dense MLP size (used by dense_layers only; kept for the HF round trip)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # layers whose MLP is one dense SiLU-gated MLP instead of routed experts (ascending, no repeats); the
    # packer and engine refuse them (UnsupportedLayerError naming the layer) until they can run one
    dense_layers: tuple[int, ...] = ()
    # attention head width D; 0 = hidden_size // num_heads. Qwen3-MoE states its own (2048 / 32 heads, D = 128),
    # so q/o projections are nh*D wide rather than H
    head_dim: int = 0

    def __post_init__(self):
        # presets and manifests give a JSON list; a frozen dataclass keeps a hashable sorted tuple
        object.__setattr__(self, "dense_layers", tuple(sorted({int(l) for l in self.dense_layers})))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        adapter_for(self.arch, "ModelConfig.arch").validate(self)

    @property
    def adapter(self) -> ArchAdapter:
        """This family's adapter (runmap/arch/<family>.py)."""
        return adapter_for(self.arch, "ModelConfig.arch")

    @property
    def qkv_bias(self) -> bool:
        return self.adapter.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Whether q and k are RMS-normalized at all (``qk_norm_kind`` says how)."""
        return self.adapter.qk_norm != QK_NORM_NONE

    @property
    def qk_norm_kind(self) -> str:
        """One of runmap.arch.base.QK_NORM_KINDS: "none", "projection" (OLMoE) or "per-head"."""
        return self.adapter.qk_norm

    @property
    def hf_architecture(self) -> str:
        return self.adapter.hf_architecture

    def to_manifest_dict(self) -> dict:
        """The fields as a JSON-ready dict for a pack manifest. ``dense_layers`` is left out while empty,
        so manifests of all-MoE models stay byte-identical (``head_dim`` likewise while it is the implied
        hidden_size // num_heads) to those written before the field existed
        (and readable by a PackReader that does not know it)."""
        d = dataclasses.asdict(self)
        if d["head_dim"] == self.hidden_size // self.num_heads:  # the implied width: left out, as for dense_layers
            del d["head_dim"]
        if not d["dense_layers"]:
            del d["dense_layers"]
        else:
            d["dense_layers"] = list(d["dense_layers"])
        return d

    # ---- Hugging Face config.json round trip ----------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{source}: unsupported model_type {arch!r} (architectures {d.get('architectures')}); "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        return ARCHITECTURES[arch].config_from_hf(d, source)

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
        """A config.json dict that the family's transformers config class (OlmoeConfig, Qwen2MoeConfig) accepts."""
        return self.adapter.config_to_hf(self)

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
