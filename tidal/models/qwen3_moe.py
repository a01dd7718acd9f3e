"""Qwen3-MoE (``Qwen3MoeForCausalLM``): q/k RMSNorm per head, optional top-k
renormalisation (``norm_topk_prob``), dense MLP layers given by ``mlp_only_layers`` and
``decoder_sparse_step``. Runner API: see ``tidal/models/common.py``."""

from __future__ import annotations

from typing import Any

from tidal.models.common import (
    CheckpointNames,
    DecoderSpec,
    ModelEntry,
    MoECausalLM,
    QKNorm,
    base_spec_kwargs,
    sparse_step_layer_mask,
)
from tidal.moe.router import Routing


class Qwen3MoeForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj"
    )

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=QKNorm.PER_HEAD,
            num_experts=num_experts,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            routing=Routing(
                hf_config.num_experts_per_tok, bool(getattr(hf_config, "norm_topk_prob", False))
            ),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=sparse_step_layer_mask(hf_config, num_experts),
        )


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    return {
        "num_experts": experts,
        "moe_intermediate_size": moe_inter,
        "intermediate_size": inter,
        "norm_topk_prob": norm_topk,
    }


ENTRY = ModelEntry(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    model=Qwen3MoeForCausalLM,
    hf_config_class="Qwen3MoeConfig",
    hf_model_class="Qwen3MoeForCausalLM",
    tiny_config=_tiny_config,
)
