"""Architecture name (``config.json`` ``architectures``) -> model class."""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module, class); imported lazily so reading a config needs no torch.
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("tidal.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("tidal.models.mixtral", "MixtralForCausalLM"),
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


def get_model_class(arch: str) -> type:
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported model architecture: {arch}; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
