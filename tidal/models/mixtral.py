"""Mixtral (``MixtralForCausalLM``): every layer is MoE, softmax top-k then
renormalised, experts named ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down) on
disk. Runner API: see ``tidal/models/common.py``."""

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


class MixtralForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2"
    )

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            qkv_bias=False,
            o_bias=False,
            qk_norm=QKNorm.NONE,
            num_experts=hf_config.num_local_experts,
            moe_intermediate_size=hf_config.intermediate_size,
            routing=Routing(hf_config.num_experts_per_tok, renormalize=True),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=(True,) * hf_config.num_hidden_layers,
        )


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    # Every layer is MoE and always renormalised: intermediate_size is the experts'.
    return {"num_local_experts": experts, "intermediate_size": moe_inter}


ENTRY = ModelEntry(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    model=MixtralForCausalLM,
    hf_config_class="MixtralConfig",
    hf_model_class="MixtralForCausalLM",
    tiny_config=_tiny_config,
)
