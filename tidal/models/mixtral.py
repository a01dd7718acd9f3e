"""Mixtral (``MixtralForCausalLM``): every layer is MoE, softmax top-k then
renormalised, experts named ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down) on
disk. Runner API: see ``tidal/models/common.py``."""

from __future__ import annotations

from typing import Any

from tidal.models.common import CheckpointNames, DecoderSpec, MoECausalLM, base_spec_kwargs


class MixtralForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2"
    )

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            attention_bias=False,
            qk_norm=False,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            moe_intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=(True,) * hf_config.num_hidden_layers,
        )
