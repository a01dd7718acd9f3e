"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) and DeepSeek-V3 (``DeepseekV3ForCausalLM``, also
Kimi-K2's class): multi-head latent attention (``tidal/layers/mla.py``: a compressed
latent KV cache, optional query LoRA ``q_lora_rank``, decoupled interleaved rotary keys,
YaRN with ``mscale``/``mscale_all_dim``), shared experts (``n_shared_experts`` of
``moe_intermediate_size``), dense MLPs in the first ``first_k_dense_replace`` layers and
then every ``moe_layer_freq``-th layer MoE. Routing: V3's ``noaux_tc`` (sigmoid scores, a
correction bias, group-limited top-k over ``n_group``/``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``); V2's softmax ``greedy`` or ``group_limited_greedy`` (best expert
per group), scaled by ``routed_scaling_factor``. The multi-token-prediction layers a V3
checkpoint holds after the last decoder layer are not served. Runner API: see
``tidal/models/common.py``."""

from __future__ import annotations

import re
from typing import Any

import torch

from tidal.layers.mla import MLASpec
from tidal.layers.rotary import rope_theta_from_config, yarn_from_config, yarn_mscale
from tidal.models.common import (
    CheckpointNames,
    DecoderSpec,
    ModelEntry,
    MoECausalLM,
    QKNorm,
    check_common_config,
)
from tidal.moe.router import Routing, Scoring

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _routing(hf_config: Any, v3: bool) -> Routing:
    top_k = hf_config.num_experts_per_tok
    scaling = float(hf_config.routed_scaling_factor)
    if v3:  # noaux_tc
        method = getattr(hf_config, "topk_method", "noaux_tc") or "noaux_tc"
        if method != "noaux_tc":
            raise NotImplementedError(f"DeepSeek-V3 topk_method {method!r} (only noaux_tc)")
        return Routing(
            top_k=top_k, renormalize=bool(hf_config.norm_topk_prob), scoring=Scoring.SIGMOID,
            num_groups=hf_config.n_group, topk_group=hf_config.topk_group,
            correction_bias=True, scaling_factor=scaling,
        )  # fmt: skip
    method = hf_config.topk_method
    match method:
        case "greedy":
            groups, keep = 1, 1
        case "group_limited_greedy":
            groups, keep = hf_config.n_group, hf_config.topk_group
        case _:
            raise NotImplementedError(
                f"DeepSeek-V2 topk_method {method!r} (greedy, group_limited_greedy)"
            )
    # transformers' V2 router scales the raw top-k softmax scores and never renormalises
    # (it reads no norm_topk_prob); so does this.
    return Routing(
        top_k=top_k, renormalize=False, scoring=Scoring.SOFTMAX, num_groups=groups,
        topk_group=keep, scaling_factor=scaling,
    )  # fmt: skip


class DeepseekV2ForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj",
        shared_expert="shared_experts",
    )  # fmt: skip
    V3 = False

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        check_common_config(hf_config)
        layers = hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        theta, yarn = rope_theta_from_config(hf_config), yarn_from_config(hf_config)
        qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        if yarn is not None and yarn.mscale_all_dim:
            scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        mla = MLASpec(
            q_lora_rank=hf_config.q_lora_rank or 0,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            # transformers' V2 rotates complex pairs, always interleaved
            rope_interleaved=bool(getattr(hf_config, "rope_interleave", True)) or not cls.V3,
            softmax_scale=scale,
            bias=bool(hf_config.attention_bias),
        )
        experts = hf_config.n_routed_experts or 0
        freq = getattr(hf_config, "moe_layer_freq", 1) or 1
        first_moe = hf_config.first_k_dense_replace or 0
        return DecoderSpec(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,  # MLA: every head reads the one latent; for TP checks
            head_dim=qk_head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            max_position=hf_config.max_position_embeddings,
            qkv_bias=False,
            o_bias=False,
            qk_norm=QKNorm.NONE,
            num_experts=experts,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            routing=_routing(hf_config, cls.V3),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=tuple(
                experts > 0 and i >= first_moe and i % freq == 0 for i in range(layers)
            ),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rotary_dim=hf_config.qk_rope_head_dim,
            rope_yarn=yarn,  # cos/sin; the softmax's mscale_all_dim part is in ``mla``
            shared_expert_intermediate_size=(
                hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0)
            ),
            mla=mla,
        )

    def ignores_weight(self, name: str) -> bool:
        m = _LAYER.match(name)  # V3's MTP layers: numbered from num_hidden_layers on
        return m is not None and int(m.group(1)) >= self.spec.num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    V3 = True


# Small MLA dims for the tiny checkpoints (the configs' defaults are full size);
# transformers sizes the rotary tables by head_dim, which must be the rope part.
_TINY_MLA = {
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,
    "v_head_dim": 16,
}


def _tiny_config_v2(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    return {
        "n_routed_experts": experts,
        "moe_intermediate_size": moe_inter,
        "intermediate_size": inter,
        "norm_topk_prob": norm_topk,
        "q_lora_rank": None,
        **_TINY_MLA,
    }


def _tiny_config_v3(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    return {
        **_tiny_config_v2(experts, moe_inter, inter, norm_topk),
        "q_lora_rank": 24,
        "n_group": 1,
        "topk_group": 1,
    }


def _tiny_init(model: Any, generator: torch.Generator) -> None:
    # transformers starts the correction bias at zero: random, so it steers the choice.
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=generator) * 0.1)


# MLA has no KV heads: transformers repeats K/V num_heads / num_key_value_heads times, so
# the tests' checkpoints set them equal.
V2_ENTRY = ModelEntry(
    architecture="DeepseekV2ForCausalLM",
    model_type="deepseek_v2",
    model=DeepseekV2ForCausalLM,
    hf_config_class="DeepseekV2Config",
    hf_model_class="DeepseekV2ForCausalLM",
    tiny_config=_tiny_config_v2,
    # No q LoRA (V2-Lite); softmax group-limited routing (2 groups of 4, 1 kept), scaled;
    # two shared experts; every layer MoE.
    test_config={
        "num_key_value_heads": 4,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "n_shared_experts": 2,
    },
)
V3_ENTRY = ModelEntry(
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    model=DeepseekV3ForCausalLM,
    hf_config_class="DeepseekV3Config",
    hf_model_class="DeepseekV3ForCausalLM",
    tiny_config=_tiny_config_v3,
    # q LoRA, a dense first layer, sigmoid routing with a correction bias over 2 groups
    # (1 kept), renormalised and scaled; one shared expert.
    test_config={
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
    },
    tiny_init=_tiny_init,
)
