"""``HeldParamsModule``: an ``nn.Module`` whose parameters may live only in a CPU path's
packed layout (``tidal/kernels/cpu_paths.py``), read and written through an explicit API
in their checkpoint shape.

Why: keeping a checkpoint-shaped parameter beside each packed copy doubled the
weights held. So once a path packs a parameter, the module releases it
(``release_param``): the pack is the only copy. Code that needs the checkpoint layout
calls ``read_weights(names)`` (exact copies, rebuilt from the pack; nothing is kept on the
module, so a look never doubles the memory) and ``write_weights(values)`` (writes and
re-packs in one call, so a write cannot be left out of the pack). Reading a released
parameter by attribute (``moe.w13``) raises AttributeError naming ``read_weights``: it
used to rebuild a copy silently, and a write through that copy was lost unless the
writer remembered to re-pack. Parameters no path packed stay ordinary attributes, and
both calls serve them too. ``state_dict()`` shows released parameters rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

Unpack = Callable[[], Tensor]


class HeldParamsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._unpackers: dict[str, Unpack] = {}  # released parameter -> its rebuild
        # released parameter -> its checkpoint (shape, dtype): writes are checked against it
        self._released_specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._register_state_dict_hook(_state_dict_unpacked)

    # ---- the explicit API --------------------------------------------------------------

    def read_weights(self, names: Iterable[str] | None = None) -> dict[str, Tensor]:
        """Copies of the weights ``names`` (parameters, released or not, or buffers; None:
        every parameter) in their checkpoint shape, exact; nothing is kept on the module."""
        out: dict[str, Tensor] = {}
        for name in self._weight_names(names):
            unpack = self._unpackers.get(name)
            out[name] = unpack() if unpack is not None else self._plain(name).detach().clone()
        return out

    @torch.no_grad()
    def write_weights(self, values: Mapping[str, Tensor]) -> None:
        """Set the weights named in ``values`` (checkpoint-shaped, of the weight's dtype):
        an ordinary one is written in place (its storage kept); released ones are packed
        again now, with the rest of their pack rebuilt from it."""
        for name, value in values.items():
            shape, dtype = self._spec(name)
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"{type(self).__name__}.write_weights: {name!r} must be "
                    f"{tuple(shape)} {dtype}, got {tuple(value.shape)} {value.dtype}"
                )
        released = {n: v for n, v in values.items() if n in self._unpackers}
        for name, value in values.items():
            if name not in released:
                self._plain(name).copy_(value)
        if released:
            self._repack(released)

    # ---- for subclasses ---------------------------------------------------------------

    def release_param(self, name: str, unpack: Unpack) -> None:
        """The packed layout holds parameter ``name`` from now on: drop its storage;
        ``unpack()`` rebuilds it (a checkpoint-shaped copy)."""
        param = self._parameters.pop(name, None)
        if param is not None:  # else moved from one pack to another: the spec stands
            self._released_specs[name] = (param.shape, param.dtype)
        self._unpackers[name] = unpack

    def restore_param(self, name: str, value: Tensor) -> None:
        """``name`` is an ordinary parameter again, holding ``value``."""
        self._unpackers.pop(name, None)
        self._released_specs.pop(name, None)
        self._parameters[name] = nn.Parameter(value, requires_grad=False)

    def is_released(self, name: str) -> bool:
        return name in self._unpackers

    def _weight(self, name: str) -> Tensor:
        """The parameter ``name`` itself or, released, a transient rebuild (the module's
        own slow paths and re-packing; never kept)."""
        unpack = self._unpackers.get(name)
        return unpack() if unpack is not None else self._plain(name)

    def _restore_group(self, names: Iterable[str], values: Mapping[str, Tensor]) -> None:
        """Make the parameters ``names`` of one pack ordinary again: those in ``values``
        from them, the others rebuilt from the pack first. The subclass then drops the old
        pack and packs them again (``_repack``)."""
        parts = {n: values[n] if n in values else self._weight(n) for n in names}
        for name, value in parts.items():
            self.restore_param(name, value)

    def _repack(self, values: dict[str, Tensor]) -> None:
        """Pack again the released parameters ``values`` names, holding those values."""
        raise NotImplementedError(f"{type(self).__name__} releases no parameters")

    # ---- attribute access ---------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        unpackers = self.__dict__.get("_unpackers")
        if unpackers and name in unpackers:
            raise AttributeError(
                f"{type(self).__name__}.{name} is held only in its CPU path's packed layout: "
                f"read it with read_weights([{name!r}]), write it with write_weights"
            )
        return super().__getattr__(name)

    def _plain(self, name: str) -> Tensor:
        for table in (self._parameters, self._buffers):
            value = table.get(name)
            if value is not None:
                return value
        raise KeyError(f"{type(self).__name__} has no weight {name!r}")

    def _spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        spec = self._released_specs.get(name)
        if spec is not None:
            return spec
        value = self._plain(name)
        return value.shape, value.dtype

    def _weight_names(self, names: Iterable[str] | None) -> list[str]:
        if names is not None:
            return list(names)
        return [n for n, p in self._parameters.items() if p is not None] + list(self._unpackers)


def _state_dict_unpacked(
    module: HeldParamsModule, state: dict[str, Any], prefix: str, _meta: Any
) -> None:
    for name, unpack in module._unpackers.items():
        if prefix + name not in state:
            state[prefix + name] = unpack()
