"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): the adapter.

What differs from the llama-like defaults of ``runmap.arch.base``: q_norm / k_norm are RMSNorms of width
head_dim shared by every head, applied after the head split and before RoPE; the head width is stated
in config.json (``head_dim``) and is not hidden_size / num_heads (Qwen3-30B-A3B: 2048 / 32 heads, D = 128);
no q/k/v bias; no shared expert. config.json may make layers dense exactly as Qwen2-MoE does
(``mlp_only_layers``, ``decoder_sparse_step``). transformers 5.x writes the expert count as
``num_local_experts`` when it saves the config (``num_experts`` is an alias of it), so both are read.
"""
from __future__ import annotations

from runmap.arch.base import QK_NORM_PER_HEAD, ArchAdapter


class Qwen3MoeAdapter(ArchAdapter):
    model_type = "qwen3_moe"
    hf_architecture = "Qwen3MoeForCausalLM"
    qkv_bias = False
    qk_norm = QK_NORM_PER_HEAD
    shared_expert = False
    dense_layers_possible = True

    def mlp_fields_from_hf(self, d: dict, source: str) -> dict:
        dense = self.sparse_step_dense_layers(d, source)
        experts = d["num_experts"] if "num_experts" in d else self.need(d, "num_local_experts", source)
        return dict(moe_intermediate_size=self.need(d, "moe_intermediate_size", source), num_experts=experts,
                    shared_expert_intermediate_size=0, intermediate_size=d.get("intermediate_size", 0),
                    dense_layers=dense)

    def family_fields_to_hf(self, cfg) -> dict:
        return dict(
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size or cfg.moe_intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            decoder_sparse_step=1,  # dense layers are listed one by one instead
            mlp_only_layers=list(cfg.dense_layers),
            attention_bias=False,
            use_sliding_window=False,
            output_router_logits=False,
        )
