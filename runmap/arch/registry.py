"""The model families runmap supports: ``ARCHITECTURES`` maps a Hugging Face ``model_type`` to its adapter.

Adding a family = one ``runmap/arch/<family>.py`` adapter registered here, a preset in specs/models/,
and the model_type in the ``architecture`` enum of schemas/common.schema.json and in
specs/architecture.yaml ``models.architectures`` (docs/adding-an-architecture.md).
"""
from __future__ import annotations

from runmap.arch.base import ArchAdapter, ConfigError
from runmap.arch.mixtral import MixtralAdapter
from runmap.arch.olmoe import OlmoeAdapter
from runmap.arch.qwen2_moe import Qwen2MoeAdapter
from runmap.arch.qwen3_moe import Qwen3MoeAdapter

ARCHITECTURES: dict[str, ArchAdapter] = {
    a.model_type: a for a in (OlmoeAdapter(), Qwen2MoeAdapter(), Qwen3MoeAdapter(), MixtralAdapter())}


def adapter_for(model_type: str, source: str = "config") -> ArchAdapter:
    """The adapter of ``model_type``; ConfigError naming ``source`` and the supported types otherwise."""
    try:
        return ARCHITECTURES[model_type]
    except (KeyError, TypeError):
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}") from None


def hf_architecture_names() -> dict[str, str]:
    """transformers class name (config.json "architectures") -> model_type, for every supported family."""
    return {a.hf_architecture: t for t, a in ARCHITECTURES.items()}
