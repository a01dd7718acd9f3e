"""The supported architectures: each module's ``ModelEntry``, by the ``architectures``
name of ``config.json`` (the model class) and by ``model_type`` (the tiny-checkpoint
factory's ``arch``). Adding an architecture is its module plus one line in ``_ENTRIES``
(docs/contributing.md#adding-a-model)."""

from __future__ import annotations

from typing import Any

from tidal.models import deepseek_v2, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from tidal.models.common import ModelEntry, MoECausalLM

# Its only callers (EngineArgs, the loader, the model runner, the tiny factory) run where
# torch is loaded anyway, so the model classes are imported eagerly; transformers'
# classes, which only the tiny factory and the tests need, are named, not imported.
_ENTRIES: tuple[ModelEntry, ...] = (
    qwen3_moe.ENTRY,
    mixtral.ENTRY,
    qwen2_moe.ENTRY,
    olmoe.ENTRY,
    glm4_moe.ENTRY,
    gpt_oss.ENTRY,
    deepseek_v2.V2_ENTRY,
    deepseek_v2.V3_ENTRY,
)
_BY_ARCH = {e.architecture: e for e in _ENTRIES}
_BY_TYPE = {e.model_type: e for e in _ENTRIES}
assert len(_BY_ARCH) == len(_BY_TYPE) == len(_ENTRIES), "an architecture listed twice"


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def model_types() -> list[str]:
    """The ``model_type`` of every supported architecture, in registry order."""
    return [e.model_type for e in _ENTRIES]


def _unsupported(found: str) -> ValueError:
    return ValueError(
        f"unsupported model architecture: {found}; supported: {', '.join(supported_architectures())}"
    )


def resolve_architecture(hf_config: Any) -> str:
    """The first supported entry of ``hf_config.architectures``; ValueError otherwise."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _BY_ARCH:
            return arch
    raise _unsupported(
        ", ".join(archs)
        if archs
        else f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    )


def get_entry(arch: str) -> ModelEntry:
    """The entry of an ``architectures`` name; ValueError listing the supported ones."""
    entry = _BY_ARCH.get(arch)
    if entry is None:
        raise _unsupported(arch)
    return entry


def entry_for_model_type(model_type: str) -> ModelEntry:
    entry = _BY_TYPE.get(model_type)
    if entry is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(model_types())}"
        )
    return entry


def get_model_class(arch: str) -> type[MoECausalLM]:
    return get_entry(arch).model
