"""What one model family is, stated once: the adapter base class every ``runmap/arch/<family>.py`` subclasses.

An adapter holds the per-family facts (Hugging Face ``model_type`` and class name, attention and MLP
feature flags), turns a Hugging Face ``config.json`` dict into a ``ModelConfig`` and back, and names
every tensor of a checkpoint with its shape. Everything else in runmap (checkpoint reading, packing,
synthetic checkpoints, the engine's weight loading, the transformers baseline) asks the adapter of
``cfg.arch`` instead of branching on the family; docs/adding-an-architecture.md is the recipe.

The base class already states the llama-like layout most families share, so an adapter overrides
only what differs:

* ``model.embed_tokens.weight`` (V, H); ``model.norm.weight`` (H,); ``lm_head.weight`` (V, H) unless tied.
* per layer ``model.layers.{l}.``: ``input_layernorm.weight`` (H,); ``self_attn.{q,k,v,o}_proj.weight``;
  optional q/k/v biases and q/k norms; ``post_attention_layernorm.weight`` (H,).
* a routed MLP under ``mlp.``: the router ``mlp.gate.weight`` (E, H) and the experts (``routed_expert_tensors``).
* a dense MLP (``dense`` layers): ``mlp.{gate,up,down}_proj.weight`` with the config's ``intermediate_size``.

Tensor names come back as ``{role: (hf_name, shape)}`` so that code which needs one particular tensor
(the engine's ``load_weights``) looks it up by role, while code that walks the inventory (checkpoint
check, packer, synth) uses the names in order. The order is the on-disk order of the non-routed file
in a pack, so it must not change for an existing family.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # the config module imports the registry, which imports the adapters
    from runmap.arch.config import ModelConfig

Shape = tuple[int, ...]
Named = dict[str, tuple[str, Shape]]  # role -> (HF tensor name, shape)

# How q and k are normalized before RoPE (none of the q/k norm tensors exist for "none").
QK_NORM_NONE = "none"
QK_NORM_PROJECTION = "projection"  # one RMSNorm over the whole projected q (nh*D) and k (nkv*D), before the head split
QK_NORM_PER_HEAD = "per-head"  # one RMSNorm of width D shared by every head, after the head split
QK_NORM_KINDS = (QK_NORM_NONE, QK_NORM_PROJECTION, QK_NORM_PER_HEAD)

# What the MLP of one decoder layer is.
MLP_ROUTED = "routed"  # router + routed experts
MLP_ROUTED_SHARED = "routed+shared"  # router + routed experts + an always-on shared expert
MLP_DENSE = "dense"  # one plain SiLU-gated MLP, no router (DeepSeek-style first-k-dense layers)
MLP_KINDS = (MLP_ROUTED, MLP_ROUTED_SHARED, MLP_DENSE)

# On-disk layouts of the routed experts of one layer (runmap/format/checkpoint.py describes both).
EXPERT_LAYOUTS = ("per-expert", "fused")
EXPERT_PROJECTIONS = ("gate", "up", "down")


class ConfigError(ValueError):
    """A config.json or preset is missing a field or names an unsupported architecture."""


class UnsupportedLayerError(ConfigError):
    """A layer whose MLP kind a part of runmap (packer, engine) cannot run yet. The message names the layer."""


class ArchAdapter:
    """One model family. Subclasses set the class attributes and override the ``*_from_hf`` / ``*_to_hf``
    hooks and any tensor-name method whose llama-like default does not fit; instances hold no state."""

    # ---- facts every adapter states -------------------------------------------------------------
    model_type: ClassVar[str]  # Hugging Face config.json "model_type", also ModelConfig.arch
    hf_architecture: ClassVar[str]  # transformers class name in config.json "architectures"
    qkv_bias: ClassVar[bool] = False  # q/k/v projections carry a bias (o_proj never does)
    qk_norm: ClassVar[str] = QK_NORM_NONE  # one of QK_NORM_KINDS
    shared_expert: ClassVar[bool] = False  # the family's MoE layers may carry a shared expert
    dense_layers_possible: ClassVar[bool] = False  # config.json can make some layers dense (non-MoE)
    hf_defaults: ClassVar[dict] = {}  # family-specific defaults for optional config.json fields

    # ---- routed-expert naming (llama-like defaults) ---------------------------------------------
    moe_module: ClassVar[str] = "mlp"  # model.layers.{l}.<moe_module>. holds router and experts on the hub
    router_module: ClassVar[str] = "gate"  # <moe_module>.<router_module>.weight (E, H)
    # per-expert layout: <moe_module>.experts.{e}.<name>.weight; gate/up (I, H), down (H, I)
    expert_projection_names: ClassVar[dict[str, str]] = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    # fused layout (transformers 5.x in-memory names): model.layers.{l}.<fused_moe_module>.experts.{gate_up_proj,down_proj}
    fused_moe_module: ClassVar[str] = "mlp"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.model_type}>"

    # ---- Hugging Face config.json ---------------------------------------------------------------
    def config_from_hf(self, d: dict, source: str = "config.json") -> "ModelConfig":
        """A ``ModelConfig`` from a config.json dict; ConfigError naming ``source`` and the field otherwise."""
        from runmap.arch.config import ModelConfig  # deferred: config.py imports this module's registry

        fields = self.common_fields_from_hf(d, source)
        fields.update(self.mlp_fields_from_hf(d, source))
        return ModelConfig(arch=self.model_type, **fields)

    def config_to_hf(self, cfg: "ModelConfig") -> dict:
        """A config.json dict that the family's transformers config class accepts (key order is part of
        the synthetic checkpoints' bytes: common keys first, then the family's)."""
        out = self.common_fields_to_hf(cfg)
        out.update(self.family_fields_to_hf(cfg))
        return out

    @staticmethod
    def need(d: dict, key: str, source: str):
        if key not in d:
            raise ConfigError(f"{source}: missing field {key!r}")
        return d[key]

    def common_fields_from_hf(self, d: dict, source: str) -> dict:
        """The ModelConfig fields every family spells the same way in config.json."""
        need = lambda key: self.need(d, key, source)  # noqa: E731
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids: the engine stops on the first
            eos = eos[0] if eos else None
        rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
        return dict(
            head_dim=int(d.get("head_dim") or need("hidden_size") // heads),  # Mixtral writes null: implied
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=need("num_attention_heads"),
            num_kv_heads=d.get("num_key_value_heads") or need("num_attention_heads"),
            top_k=need("num_experts_per_tok"),
            norm_topk_prob=bool(d.get("norm_topk_prob", self.hf_defaults.get("norm_topk_prob", False))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    def sparse_step_dense_layers(self, d: dict, source: str) -> tuple:
        """The dense (non-MoE) layers of the Qwen families' config.json: those in ``mlp_only_layers`` and those off
        the ``decoder_sparse_step`` grid (layer l is MoE iff (l + 1) % step == 0)."""
        n_layers = self.need(d, "num_hidden_layers", source)
        step = int(d.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(d.get("mlp_only_layers") or [])
        return tuple(l for l in range(n_layers) if l in only_mlp or (l + 1) % step != 0)

    def mlp_fields_from_hf(self, d: dict, source: str) -> dict:
        """moe_intermediate_size, num_experts, shared_expert_intermediate_size, intermediate_size and
        dense_layers from config.json. Every adapter states this: the families name these differently."""
        raise NotImplementedError(f"{type(self).__name__}.mlp_fields_from_hf")

    def common_fields_to_hf(self, cfg: "ModelConfig") -> dict:
        return dict(
            architectures=[self.hf_architecture],
            model_type=self.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k,
            norm_topk_prob=cfg.norm_topk_prob,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            pad_token_id=cfg.pad_token_id,
            hidden_act="silu",
            torch_dtype="bfloat16",
        )

    def family_fields_to_hf(self, cfg: "ModelConfig") -> dict:
        """The config.json keys only this family has (appended after the common ones)."""
        raise NotImplementedError(f"{type(self).__name__}.family_fields_to_hf")

    def validate(self, cfg: "ModelConfig") -> None:
        """ConfigError unless ``cfg`` is a config this family can have (called by ModelConfig itself)."""
        if cfg.shared_expert_intermediate_size and not self.shared_expert:
            raise ConfigError(f"{self.model_type}: shared_expert_intermediate_size="
                              f"{cfg.shared_expert_intermediate_size}, but this family has no shared expert")
        if cfg.dense_layers and not self.dense_layers_possible:
            raise ConfigError(f"{self.model_type}: dense_layers {list(cfg.dense_layers)}, but this family has none")
        bad = [l for l in cfg.dense_layers if not 0 <= l < cfg.num_layers]
        if bad:
            raise ConfigError(f"{self.model_type}: dense_layers {bad} outside layers 0..{cfg.num_layers - 1}")

    # ---- per-layer MLP kind ---------------------------------------------------------------------
    def mlp_kind(self, cfg: "ModelConfig", layer: int) -> str:
        """One of MLP_KINDS for decoder layer ``layer``."""
        if layer in cfg.dense_layers:
            return MLP_DENSE
        return MLP_ROUTED_SHARED if cfg.shared_expert_intermediate_size else MLP_ROUTED

    def routed_layers(self, cfg: "ModelConfig") -> list[int]:
        """The layers that have routed experts, ascending."""
        return [l for l in range(cfg.num_layers) if self.mlp_kind(cfg, l) != MLP_DENSE]

    def require_routed_layers(self, cfg: "ModelConfig", what: str) -> None:
        """UnsupportedLayerError naming the first dense layer: ``what`` (e.g. "runmap pack") runs MoE layers only."""
        dense = [l for l in range(cfg.num_layers) if self.mlp_kind(cfg, l) == MLP_DENSE]
        if dense:
            raise UnsupportedLayerError(
                f"{what}: layer {dense[0]} of this {self.model_type} model is a dense (non-MoE) MLP layer "
                f"(dense layers {list(dense)}); only routed MoE layers are supported")

    # ---- tensor names: non-routed ---------------------------------------------------------------
    @staticmethod
    def layer_prefix(layer: int) -> str:
        return f"model.layers.{layer}."

    def head_tensors(self, cfg: "ModelConfig") -> Named:
        """Tensors before the first layer: the token embedding (V, H)."""
        return {"embed": ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))}

    def tail_tensors(self, cfg: "ModelConfig") -> Named:
        """Tensors after the last layer: final norm (H,), lm_head (V, H) unless tied to the embedding."""
        out = {"final_norm": ("model.norm.weight", (cfg.hidden_size,))}
        if not cfg.tie_word_embeddings:
            out["lm_head"] = ("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        return out

    def attention_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        """Input norm, q/k/v/o projections (q/k/v biases, q/k norms as the flags say) of one layer."""
        p, h, hd = self.layer_prefix(layer), cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        a = p + "self_attn."
        out = {
            "attn_norm": (p + "input_layernorm.weight", (h,)),
            "q_proj": (a + "q_proj.weight", (q_out, h)),
            "k_proj": (a + "k_proj.weight", (kv_out, h)),
            "v_proj": (a + "v_proj.weight", (kv_out, h)),
        }
        if self.qkv_bias:
            out.update(q_bias=(a + "q_proj.bias", (q_out,)), k_bias=(a + "k_proj.bias", (kv_out,)),
                       v_bias=(a + "v_proj.bias", (kv_out,)))
        out["o_proj"] = (a + "o_proj.weight", (h, q_out))
        if self.qk_norm == QK_NORM_PROJECTION:
            out.update(q_norm=(a + "q_norm.weight", (q_out,)), k_norm=(a + "k_norm.weight", (kv_out,)))
        elif self.qk_norm == QK_NORM_PER_HEAD:
            out.update(q_norm=(a + "q_norm.weight", (hd,)), k_norm=(a + "k_norm.weight", (hd,)))
        return out

    def router_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        name = f"{self.layer_prefix(layer)}{self.moe_module}.{self.router_module}.weight"
        return {"router": (name, (cfg.num_experts, cfg.hidden_size))}

    def shared_expert_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        """Shared expert of a ``routed+shared`` layer: roles shared_gate, shared_up (Is, H), shared_down
        (H, Is), shared_expert_gate (1, H). Families with a shared expert state their names."""
        raise ConfigError(f"{self.model_type}: layer {layer} has a shared expert, but the adapter names none")

    def dense_mlp_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        """A dense layer's MLP: dense_gate, dense_up (intermediate_size, H), dense_down (H, intermediate_size)."""
        p, h, i = self.layer_prefix(layer) + "mlp.", cfg.hidden_size, cfg.intermediate_size
        if i <= 0:
            raise ConfigError(f"{self.model_type}: layer {layer} is dense but intermediate_size is {i}")
        return {"dense_gate": (p + "gate_proj.weight", (i, h)), "dense_up": (p + "up_proj.weight", (i, h)),
                "dense_down": (p + "down_proj.weight", (h, i))}

    def mlp_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        """Post-attention norm and the non-routed MLP tensors of one layer, by its MLP kind."""
        out = {"mlp_norm": (self.layer_prefix(layer) + "post_attention_layernorm.weight", (cfg.hidden_size,))}
        kind = self.mlp_kind(cfg, layer)
        if kind == MLP_DENSE:
            out.update(self.dense_mlp_tensors(cfg, layer))
            return out
        out.update(self.router_tensors(cfg, layer))
        if kind == MLP_ROUTED_SHARED:
            out.update(self.shared_expert_tensors(cfg, layer))
        return out

    def layer_tensors(self, cfg: "ModelConfig", layer: int) -> Named:
        """Every non-routed tensor of one layer by role, in on-disk order."""
        return {**self.attention_tensors(cfg, layer), **self.mlp_tensors(cfg, layer)}

    def nonrouted_tensors(self, cfg: "ModelConfig") -> dict[str, Shape]:
        """HF name -> shape of every non-routed tensor: embedding, layers in order, final norm, lm_head."""
        out = {n: s for n, s in self.head_tensors(cfg).values()}
        for l in range(cfg.num_layers):
            out.update(self.layer_tensors(cfg, l).values())
        out.update(self.tail_tensors(cfg).values())
        return out

    # ---- tensor names: routed experts -----------------------------------------------------------
    def expert_tensor_name(self, layer: int, expert: int, proj: str) -> str:
        """Per-expert layout name of expert ``expert``'s ``proj`` ("gate" | "up" | "down") weight."""
        return (f"{self.layer_prefix(layer)}{self.moe_module}.experts.{expert}."
                f"{self.expert_projection_names[proj]}.weight")

    def fused_expert_names(self, layer: int) -> dict[str, str]:
        """Fused layout names: {"gate_up": (E, 2I, H) gate rows then up rows, "down": (E, H, I)}."""
        p = f"{self.layer_prefix(layer)}{self.fused_moe_module}.experts."
        return {"gate_up": p + "gate_up_proj", "down": p + "down_proj"}

    def routed_expert_tensors(self, cfg: "ModelConfig", layer: int, layout: str) -> dict[str, Shape]:
        """HF name -> shape of the routed expert tensors of one MoE layer in ``layout`` (EXPERT_LAYOUTS)."""
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
        if self.mlp_kind(cfg, layer) == MLP_DENSE:
            return {}
        h, i, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        if layout == "fused":
            f = self.fused_expert_names(layer)
            return {f["gate_up"]: (n_exp, 2 * i, h), f["down"]: (n_exp, h, i)}
        shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        return {self.expert_tensor_name(layer, e, proj): shapes[proj]
                for e in range(n_exp) for proj in EXPERT_PROJECTIONS}

    def fused_layout_name(self, name: str) -> str:
        """The name non-routed tensor ``name`` has in a layer whose experts are in the fused layout (the
        transformers 5.x in-memory names). The same for every family whose router already sits in
        ``fused_moe_module``; Mixtral renames its router there (block_sparse_moe.gate -> mlp.gate)."""
        return name

    def is_routed_expert_tensor(self, name: str) -> bool:
        """Whether ``name`` belongs to the routed experts (either layout); used to word error messages."""
        return f".{self.moe_module}.experts." in name or f".{self.fused_moe_module}.experts." in name

    # ---- transformers ---------------------------------------------------------------------------
    def hf_config_class(self):
        """transformers' config class of this family (imported on first use: transformers is heavy)."""
        import transformers

        return type(transformers.AutoConfig.for_model(self.model_type))

    def hf_model_class(self):
        """transformers' causal-LM class of this family (``hf_architecture``)."""
        import transformers

        return getattr(transformers, self.hf_architecture)
