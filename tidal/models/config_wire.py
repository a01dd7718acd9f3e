"""An ``EngineConfig`` on the wire (a process's launch payload, msgspec msgpack).

The config is a tree of frozen dataclasses that msgspec encodes as they are, except
``ModelConfig.hf_config``, a transformers ``PretrainedConfig``: it travels as its
``to_dict()`` and is read on the other side as a ``WireHFConfig``, the same fields as
attributes. Used by every process that starts from a config: engines
(``tidal.engine_core.entry``) and their TP workers (``tidal.executor.worker_proc``).

Why not rebuild the transformers class: the engine reads plain fields of it
(``spec_from_config``, the vocab and EOS ids, the config hash), and importing
transformers to rebuild it cost each engine and TP worker process ~1.1 s of its cold
start and ~30 MB of resident memory, for no field the dict lacks. The
frontend, which reads the checkpoint, keeps transformers' own class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.config import EngineConfig


class WireHFConfig:
    """A checkpoint config's fields (its ``to_dict()``) as read-only attributes, with
    ``to_dict()`` giving them back as they came (the config hash reads it, so a rank's
    hash equals the frontend's)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"WireHFConfig is read-only (setting {name!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WireHFConfig) and self._fields == other._fields

    __hash__ = None  # type: ignore[assignment]  # mutable contents: like a dict

    def __repr__(self) -> str:
        return f"WireHFConfig(model_type={self._fields.get('model_type')!r})"

    def to_dict(self) -> dict[str, Any]:
        return dict(self._fields)


def split_hf_config(config: EngineConfig) -> tuple[EngineConfig, dict[str, Any] | None]:
    """``(config without hf_config, hf_config as a dict)``: both encode with msgspec."""
    hf = config.model.hf_config
    wire = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_config=None))
    return wire, (hf.to_dict() if hf is not None else None)


def join_hf_config(config: EngineConfig, hf: dict[str, Any] | None) -> EngineConfig:
    """The inverse of ``split_hf_config``: ``hf_config`` as a ``WireHFConfig``."""
    view = WireHFConfig(hf) if hf is not None else None
    model = dataclasses.replace(config.model, hf_config=view)
    return dataclasses.replace(config, model=model)
