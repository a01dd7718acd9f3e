"""An ``EngineConfig`` on the wire (a process's launch payload, msgspec msgpack).

The config is a tree of frozen dataclasses that msgspec encodes as they are, except
``ModelConfig.hf_config``, a transformers ``PretrainedConfig``: it travels as its
``to_dict()`` and is rebuilt by its own config class, which reproduces it exactly. Used
by every process that starts from a config: engines (``tidal.engine_core.entry``) and
their TP workers (``tidal.executor.worker_proc``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig

from tidal.config import EngineConfig


def split_hf_config(config: EngineConfig) -> tuple[EngineConfig, dict[str, Any] | None]:
    """``(config without hf_config, hf_config as a dict)``: both encode with msgspec."""
    hf = config.model.hf_config
    wire = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_config=None))
    return wire, (hf.to_dict() if hf is not None else None)


def join_hf_config(config: EngineConfig, hf: dict[str, Any] | None) -> EngineConfig:
    """The inverse of ``split_hf_config``."""
    model = dataclasses.replace(config.model, hf_config=_rebuild_hf_config(config, hf))
    return dataclasses.replace(config, model=model)


def _rebuild_hf_config(config: EngineConfig, hf: dict[str, Any] | None) -> Any:
    if hf is None:
        return None
    config_class = CONFIG_MAPPING.get(hf.get("model_type", ""))
    if config_class is None:
        # Not a transformers-native model type: read it the way the launcher did.
        return AutoConfig.from_pretrained(config.model.model)
    return config_class.from_dict(hf)
