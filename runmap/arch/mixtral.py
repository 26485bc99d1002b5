"""Mixtral (``MixtralForCausalLM``, e.g. Mixtral-8x7B-v0.1): the adapter.

What differs from the llama-like defaults of ``runmap.arch.base``: on the hub the MoE block is
``block_sparse_moe`` (router ``block_sparse_moe.gate``, experts ``block_sparse_moe.experts.{e}.w1|w3|w2`` for
gate|up|down), which is also what transformers 5.x ``save_pretrained`` writes; transformers' in-memory
(fused) names put both the router and the fused experts under ``mlp``, so a fused-layout layer has its
router at ``mlp.gate`` (``fused_layout_name``). No q/k norm, no q/k/v bias, no shared expert, no dense
layers. The top-k weights are always renormalized (softmax over the k chosen logits), so
``norm_topk_prob`` is true for every Mixtral. config.json calls the expert size ``intermediate_size`` and
the expert count ``num_local_experts``. The engine attends over the whole context, so a config whose
``sliding_window`` is shorter than ``max_position_embeddings`` is refused (Mixtral-8x7B-v0.1 has none).
"""
from __future__ import annotations

from runmap.arch.base import QK_NORM_NONE, ArchAdapter, ConfigError


class MixtralAdapter(ArchAdapter):
    model_type = "mixtral"
    hf_architecture = "MixtralForCausalLM"
    qkv_bias = False
    qk_norm = QK_NORM_NONE
    shared_expert = False
    dense_layers_possible = False
    hf_defaults = {"norm_topk_prob": True}
    moe_module = "block_sparse_moe"
    router_module = "gate"
    expert_projection_names = {"gate": "w1", "up": "w3", "down": "w2"}
    fused_moe_module = "mlp"

    def config_from_hf(self, d: dict, source: str = "config.json"):
        window = d.get("sliding_window")
        limit = int(d.get("max_position_embeddings", 4096))
        if window is not None and int(window) < limit:
            raise ConfigError(f"{source}: sliding_window={window} is shorter than max_position_embeddings={limit}; "
                              "the engine attends over the whole context (no sliding window)")
        # MixtralConfig has no norm_topk_prob: the renormalization is part of the family, whatever the dict says
        return super().config_from_hf({**d, "norm_topk_prob": True}, source)

    def mlp_fields_from_hf(self, d: dict, source: str) -> dict:
        return dict(moe_intermediate_size=self.need(d, "intermediate_size", source),
                    num_experts=self.need(d, "num_local_experts", source),
                    shared_expert_intermediate_size=0, intermediate_size=0, dense_layers=())

    def family_fields_to_hf(self, cfg) -> dict:
        return dict(
            head_dim=cfg.head_dim,
            intermediate_size=cfg.moe_intermediate_size,  # MixtralConfig reads the expert size from it
            num_local_experts=cfg.num_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if not cfg.norm_topk_prob:
            raise ConfigError("mixtral: norm_topk_prob must be true (Mixtral always renormalizes its top-k weights)")

    def fused_layout_name(self, name: str) -> str:
        return name.replace(f".{self.moe_module}.{self.router_module}.", f".{self.fused_moe_module}.{self.router_module}.")
