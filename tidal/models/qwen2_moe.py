"""Qwen2-MoE (``Qwen2MoeForCausalLM``): QKV bias (``qkv_bias``; O has none), softmax top-k
(renormalised with ``norm_topk_prob``), a shared expert beside the routed ones scaled by
``sigmoid(shared_expert_gate(x))``, dense MLP layers given by ``mlp_only_layers`` and
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


class Qwen2MoeForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj",
        shared_expert="shared_expert", shared_expert_gate="shared_expert_gate",
    )  # fmt: skip

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        num_experts = hf_config.num_experts
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
            o_bias=False,
            qk_norm=QKNorm.NONE,
            num_experts=num_experts,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            routing=Routing(hf_config.num_experts_per_tok, bool(hf_config.norm_topk_prob)),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=sparse_step_layer_mask(hf_config, num_experts),
            shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
            shared_expert_gate=True,
        )


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    return {
        "num_experts": experts,
        "moe_intermediate_size": moe_inter,
        "intermediate_size": inter,
        "shared_expert_intermediate_size": inter,
        "norm_topk_prob": norm_topk,
    }


ENTRY = ModelEntry(
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    model=Qwen2MoeForCausalLM,
    hf_config_class="Qwen2MoeConfig",
    hf_model_class="Qwen2MoeForCausalLM",
    tiny_config=_tiny_config,
    test_config={"shared_expert_intermediate_size": 48},  # != the dense MLPs' width
)
