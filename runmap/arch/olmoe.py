"""OLMoE (allenai, ``OlmoeForCausalLM``): the adapter.

What differs from the llama-like defaults of ``runmap.arch.base``: q_norm / k_norm are RMSNorms over the
whole projected q (nh*D) and k (nkv*D), applied before the head split; no q/k/v bias; no shared expert;
every layer is a routed MoE layer. config.json calls the expert size ``intermediate_size`` (there is no
dense MLP to share the name with).
"""
from __future__ import annotations

from runmap.arch.base import QK_NORM_PROJECTION, ArchAdapter


class OlmoeAdapter(ArchAdapter):
    model_type = "olmoe"
    hf_architecture = "OlmoeForCausalLM"
    qkv_bias = False
    qk_norm = QK_NORM_PROJECTION
    shared_expert = False
    dense_layers_possible = False

    def mlp_fields_from_hf(self, d: dict, source: str) -> dict:
        return dict(moe_intermediate_size=self.need(d, "intermediate_size", source),
                    num_experts=self.need(d, "num_experts", source),
                    shared_expert_intermediate_size=0, intermediate_size=0, dense_layers=())

    def family_fields_to_hf(self, cfg) -> dict:
        # transformers' OlmoeConfig reads the expert size from intermediate_size
        return dict(intermediate_size=cfg.moe_intermediate_size, clip_qkv=None, output_router_logits=False)
