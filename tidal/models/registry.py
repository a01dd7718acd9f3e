"""Architecture name (``config.json`` ``architectures``) -> model class."""

from __future__ import annotations

from typing import Any

from tidal.models.common import MoECausalLM
from tidal.models.mixtral import MixtralForCausalLM
from tidal.models.qwen3_moe import Qwen3MoeForCausalLM

# config.json ``architectures`` entry -> model class. Its only callers (EngineArgs, the
# loader, the model runner) run where torch is loaded anyway, so the classes are eager.
_MODELS: dict[str, type[MoECausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> str:
    """The first supported entry of ``hf_config.architectures``; ValueError otherwise."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return arch
    found = (
        ", ".join(archs)
        if archs
        else f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    )
    raise ValueError(
        f"unsupported model architecture: {found}; supported: {', '.join(supported_architectures())}"
    )


def get_model_class(arch: str) -> type[MoECausalLM]:
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported model architecture: {arch}; supported: {', '.join(supported_architectures())}"
        )
    return _MODELS[arch]
