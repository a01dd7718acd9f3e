"""OLMoE (``OlmoeForCausalLM``): RMSNorm over the whole projected q and the whole
projected k (one weight over all heads, not per head), optional clamping of q, k and v
(``clip_qkv``), softmax top-k (renormalised with ``norm_topk_prob``), every layer MoE.
Runner API: see ``tidal/models/common.py``."""

from __future__ import annotations

from typing import Any

from tidal.models.common import (
    CheckpointNames,
    DecoderSpec,
    ModelEntry,
    MoECausalLM,
    QKNorm,
    base_spec_kwargs,
)
from tidal.moe.router import Routing


class OlmoeForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj"
    )

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        clip = getattr(hf_config, "clip_qkv", None)
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=QKNorm.FULL_WIDTH,
            qkv_clip=None if clip is None else float(clip),
            num_experts=hf_config.num_experts,
            moe_intermediate_size=hf_config.intermediate_size,
            routing=Routing(hf_config.num_experts_per_tok, bool(hf_config.norm_topk_prob)),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=(True,) * hf_config.num_hidden_layers,
        )


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    # Every layer is MoE: intermediate_size is the experts'.
    return {"num_experts": experts, "intermediate_size": moe_inter, "norm_topk_prob": norm_topk}


ENTRY = ModelEntry(
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    model=OlmoeForCausalLM,
    hf_config_class="OlmoeConfig",
    hf_model_class="OlmoeForCausalLM",
    tiny_config=_tiny_config,
    test_config={"clip_qkv": 2.0},  # small enough that some q/k/v values are clamped
)
