"""GPT-OSS (``GptOssForCausalLM``): every layer MoE; attention with q/k/v/o biases, a
learned sink logit per head and, in the ``sliding_attention`` layers of ``layer_types``,
a ``sliding_window``; YaRN rope. The router has a bias; each token takes its top-k
logits and softmaxes them (softmax top-k renormalised: the same weights). The experts
have biases and a clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).

Checkpoint: transformers' fused expert tensors, ``mlp.experts.gate_up_proj [E, H, 2I]``
(gate and up columns interleaved: gate at even indices), ``gate_up_proj_bias [E, 2I]``,
``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, each read as per-expert tensors in
the runtime's layout (``expand_tensor``); the router is ``mlp.router``. Only the
bf16/float32 layout is served: an MXFP4-quantised checkpoint (the upstream release) is
refused by name. Runner API: see ``tidal/models/common.py``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tidal.models.common import (
    CheckpointNames,
    DecoderSpec,
    ModelEntry,
    MoECausalLM,
    QKNorm,
    base_spec_kwargs,
)
from tidal.moe.reference import ClampedSwiGLU
from tidal.moe.router import Routing

# A stored fused tensor -> per expert: (projection, as ``names`` below calls it, "weight"
# or "bias", view of its row e).
_PER_EXPERT: dict[str, tuple[tuple[str, str, Callable[[Tensor], Tensor]], ...]] = {
    "gate_up_proj": (  # [H, 2I] -> [I, H] each: gate at even columns, up at odd
        ("gate_proj", "weight", lambda t: t[:, 0::2].t()),
        ("up_proj", "weight", lambda t: t[:, 1::2].t()),
    ),
    "gate_up_proj_bias": (
        ("gate_proj", "bias", lambda t: t[0::2]),
        ("up_proj", "bias", lambda t: t[1::2]),
    ),
    "down_proj": (("down_proj", "weight", lambda t: t.t()),),  # [I, H] -> [H, I]
    "down_proj_bias": (("down_proj", "bias", lambda t: t),),
}
_FUSED = re.compile(rf"^(model\.layers\.\d+\.mlp\.experts)\.({'|'.join(_PER_EXPERT)})$")
_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}  # windowed?


class GptOssForCausalLM(MoECausalLM):
    names = CheckpointNames(
        moe_module="mlp", expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj",
        router="router",
    )  # fmt: skip

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        quant = getattr(hf_config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
        if method is not None:
            raise NotImplementedError(
                f"GPT-OSS with {method!r} quantisation (e.g. the MXFP4 upstream checkpoint) is "
                "not supported: serve a bf16/float32 (dequantised) checkpoint"
            )
        layers = hf_config.num_hidden_layers
        types = list(hf_config.layer_types)
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown or len(types) != layers:
            raise NotImplementedError(f"layer_types {types} (known: {sorted(_LAYER_TYPES)})")
        window = hf_config.sliding_window
        bias = bool(hf_config.attention_bias)
        return DecoderSpec(
            **base_spec_kwargs(hf_config, sliding_windows=True),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=QKNorm.NONE,
            num_experts=hf_config.num_local_experts,
            moe_intermediate_size=hf_config.intermediate_size,
            routing=Routing(hf_config.num_experts_per_tok, renormalize=True, router_bias=True),
            dense_intermediate_size=hf_config.intermediate_size,
            moe_layer_mask=(True,) * layers,
            layer_windows=tuple(window if _LAYER_TYPES[t] else None for t in types),
            attention_sinks=True,
            expert_bias=True,
            expert_activation=ClampedSwiGLU(
                float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
            ),
        )

    def expand_tensor(
        self, name: str, get: Callable[[], Tensor], shape: tuple[int, ...]
    ) -> list[tuple[str, Callable[[], Tensor]]] | None:
        """The fused expert tensors as per-expert ones: ``gate_proj``/``up_proj`` [I, H]
        (the even / odd columns of ``gate_up_proj``, transposed), ``down_proj`` [H, I],
        and their biases; read once, only if a local expert asks."""
        m = _FUSED.match(name)
        if m is None:
            return None
        base, stored = m.group(1), m.group(2)
        cache: dict[str, Tensor] = {}

        def whole() -> Tensor:
            if "t" not in cache:
                cache["t"] = get()
            return cache["t"]

        return [
            (f"{base}.{e}.{proj}.{kind}", lambda e=e, view=view: view(whole()[e]))
            for e in range(shape[0])
            for proj, kind, view in _PER_EXPERT[stored]
        ]


def _tiny_config(experts: int, moe_inter: int, inter: int, norm_topk: bool) -> dict[str, Any]:
    # Every layer is MoE and always renormalised: intermediate_size is the experts'.
    return {"num_local_experts": experts, "intermediate_size": moe_inter}


def _tiny_init(model: Any, generator: torch.Generator) -> None:
    # transformers starts the expert biases at zero and the sinks near it: random, so
    # they count.
    for name, param in model.named_parameters():
        if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        elif name.endswith(".sinks"):
            param.copy_(torch.randn(param.shape, generator=generator))


ENTRY = ModelEntry(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    model=GptOssForCausalLM,
    hf_config_class="GptOssConfig",
    hf_model_class="GptOssForCausalLM",
    tiny_config=_tiny_config,
    # A window shorter than the tests' prompts; a limit the tiny activations reach, so
    # the clamp acts; YaRN's factor 32 over a 64-token original context (the ramp then
    # spans the tiny heads' dims). Alternating layers are the config's default.
    test_config={
        "sliding_window": 8,
        "swiglu_limit": 0.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },  # fmt: skip
    tiny_init=_tiny_init,
)
