"""``HeldParamsModule``: an ``nn.Module`` whose parameters may live only in a CPU path's
packed layout (``tidal/kernels/cpu_paths.py``), yet still read and write as the
checkpoint-shaped parameters they were.

Why: keeping a checkpoint-shaped parameter beside each packed copy doubled the
weights held. So once a path packs a parameter, the module releases it
(``release_param``): the pack is the only copy. Code that needs the checkpoint layout
reads the parameter by its old name as always (``moe.w13``, ``linear.weight``) and gets a
rebuilt, exact copy -- *materialized* until the module's ``weights_updated()`` (which
re-packs it, so writes through it land: the loader and EPLB write that way and already
call it) or its next forward (which drops it: a read-only look must not double the memory
for good). ``state_dict()`` shows released parameters rebuilt. A write through a
materialized copy not followed by ``weights_updated()`` is lost -- as it was before, when
the packed copy went stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

Unpack = Callable[[], Tensor]


class HeldParamsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._unpackers: dict[str, Unpack] = {}  # released parameter -> its rebuild
        self._materialized = False  # some released parameter was rebuilt and is held
        self._register_state_dict_hook(_state_dict_unpacked)

    def release_param(self, name: str, unpack: Unpack) -> None:
        """The packed layout holds parameter ``name`` from now on: drop its storage;
        reading it calls ``unpack()`` (a checkpoint-shaped copy)."""
        self._parameters.pop(name, None)
        self._unpackers[name] = unpack

    def restore_param(self, name: str, value: Tensor) -> None:
        """``name`` is an ordinary parameter again, holding ``value``."""
        self._unpackers.pop(name, None)
        self._parameters[name] = nn.Parameter(value, requires_grad=False)

    def is_released(self, name: str) -> bool:
        return name in self._unpackers

    def materialized_params(self) -> list[str]:
        """Released parameters rebuilt by a read and held since (to re-pack or drop)."""
        if not self._materialized:
            return []
        return [n for n in self._unpackers if n in self._parameters]

    def drop_materialized(self) -> None:
        """Release the rebuilt copies again (their reads are over; the pack is current)."""
        if self._materialized:
            for name in self._unpackers:
                self._parameters.pop(name, None)
            self._materialized = False

    def __getattr__(self, name: str) -> Any:
        unpackers = self.__dict__.get("_unpackers")
        if unpackers and name in unpackers:
            params = self.__dict__["_parameters"]
            if name not in params:
                params[name] = nn.Parameter(unpackers[name](), requires_grad=False)
                self.__dict__["_materialized"] = True
            return params[name]
        return super().__getattr__(name)


def _state_dict_unpacked(
    module: HeldParamsModule, state: dict[str, Any], prefix: str, _meta: Any
) -> None:
    for name, unpack in module._unpackers.items():
        if prefix + name not in state:
            state[prefix + name] = unpack()
