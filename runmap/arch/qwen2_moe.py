"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): the adapter.

What differs from the llama-like defaults of ``runmap.arch.base``: q/k/v projections carry biases (o_proj
does not); no q/k norm; every MoE layer adds a shared expert, a SiLU-gated MLP of width
``shared_expert_intermediate_size`` scaled by sigmoid(``shared_expert_gate``(x)). config.json may make some
layers dense (``mlp_only_layers``, or ``decoder_sparse_step`` > 1: layer l is MoE iff (l + 1) % step == 0);
those become ``ModelConfig.dense_layers`` with the dense MLP of width ``intermediate_size``.
"""
from __future__ import annotations

from runmap.arch.base import QK_NORM_NONE, ArchAdapter


class Qwen2MoeAdapter(ArchAdapter):
    model_type = "qwen2_moe"
    hf_architecture = "Qwen2MoeForCausalLM"
    qkv_bias = True
    qk_norm = QK_NORM_NONE
    shared_expert = True
    dense_layers_possible = True

    def mlp_fields_from_hf(self, d: dict, source: str) -> dict:
        dense = self.sparse_step_dense_layers(d, source)
        return dict(moe_intermediate_size=self.need(d, "moe_intermediate_size", source),
                    num_experts=self.need(d, "num_experts", source),
                    shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
                    intermediate_size=d.get("intermediate_size", 0), dense_layers=dense)

    def family_fields_to_hf(self, cfg) -> dict:
        return dict(
            intermediate_size=cfg.intermediate_size or cfg.moe_intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            decoder_sparse_step=1,  # dense layers are listed one by one instead
            mlp_only_layers=list(cfg.dense_layers),
            use_sliding_window=False,
            qkv_bias=True,
            output_router_logits=False,
        )

    def shared_expert_tensors(self, cfg, layer: int):
        p, h, s = self.layer_prefix(layer) + "mlp.", cfg.hidden_size, cfg.shared_expert_intermediate_size
        return {
            "shared_gate": (p + "shared_expert.gate_proj.weight", (s, h)),
            "shared_up": (p + "shared_expert.up_proj.weight", (s, h)),
            "shared_down": (p + "shared_expert.down_proj.weight", (h, s)),
            "shared_expert_gate": (p + "shared_expert_gate.weight", (1, h)),
        }
