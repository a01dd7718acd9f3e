"""GLM-4.5 (``Glm4MoeForCausalLM``): partial rotary (``partial_rotary_factor`` of each
head), QKV bias (``attention_bias``; O has none), optional per-head q/k norm
(``use_qk_norm``), sigmoid routing with a score-correction bias and group-limited top-k
(``n_group``, ``topk_group``; noaux_tc) scaled by ``routed_scaling_factor``, shared experts
(``n_shared_experts`` of ``moe_intermediate_size``), dense MLPs in the first
``first_k_dense_replace`` layers. The multi-token-prediction layers a checkpoint may hold
after the last decoder layer are not served (transformers skips them too). Runner API:
see ``tidal/models/common.py``."""

from __future__ import annotations

import re
from typing import Any

import torch

from tidal.models.common import (
    CheckpointNames,
    DecoderSpec,
    ModelEntry,
    MoECausalLM,
    QKNorm,
    base_spec_kwargs,
)
from tidal.moe.router import Routing, Scoring

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj",
        shared_expert="shared_experts",
    )  # fmt: skip

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        layers = hf_config.num_hidden_layers
        first_moe = hf_config.first_k_dense_replace
        return DecoderSpec(
            **base_spec_kwargs(hf_config),
            qkv_bias=bool(hf_config.attention_bias),
            o_bias=False,
            qk_norm=QKNorm.PER_HEAD if hf_config.use_qk_norm else QKNorm.NONE,
            num_experts=hf_config.n_routed_experts,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            routing=Routing(
                top_k=hf_config.num_experts_per_tok,
                renormalize=bool(hf_config.norm_topk_prob),
                scoring=Scoring.SIGMOID,
                num_groups=hf_config.n_group,
                topk_group=hf_config.topk_group,
                correction_bias=True,
                scaling_factor=float(hf_config.routed_scaling_factor),
            ),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=tuple(i >= first_moe for i in range(layers)),
            shared_expert_intermediate_size=(
                hf_config.moe_intermediate_size * hf_config.n_shared_experts
            ),
        )

    def ignores_weight(self, name: str) -> bool:
        m = _LAYER.match(name)  # the MTP layers: numbered from num_hidden_layers on
        return m is not None and int(m.group(1)) >= self.spec.num_layers


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    return {
        "n_routed_experts": experts,
        "moe_intermediate_size": moe_inter,
        "intermediate_size": inter,
        "norm_topk_prob": norm_topk,
    }


def _tiny_init(model: Any, generator: torch.Generator) -> None:
    # transformers starts the correction bias at zero: random, so it steers the choice.
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=generator) * 0.1)


ENTRY = ModelEntry(
    architecture="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    model=Glm4MoeForCausalLM,
    hf_config_class="Glm4MoeConfig",
    hf_model_class="Glm4MoeForCausalLM",
    tiny_config=_tiny_config,
    # Each switch on: groups (2 of 8 experts' 4, 1 kept), scaling, q/k norm, QKV bias;
    # partial rotary (0.5) and a dense first layer are the config's defaults.
    test_config={
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    tiny_init=_tiny_init,
)
