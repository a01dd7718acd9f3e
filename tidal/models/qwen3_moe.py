"""Qwen3-MoE (``Qwen3MoeForCausalLM``): q/k RMSNorm per head, optional top-k
renormalisation (``norm_topk_prob``), dense MLP layers given by ``mlp_only_layers`` and
``decoder_sparse_step``. Runner API: see ``tidal/models/common.py``."""

from __future__ import annotations

from typing import Any

from tidal.models.common import CheckpointNames, DecoderSpec, MoECausalLM, base_spec_kwargs


class Qwen3MoeForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj"
    )

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        num_layers = hf_config.num_hidden_layers
        num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
        mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        mask = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=True,
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=mask,
        )
