"""Which accelerators of a host each engine rank uses (docs/architecture.md#tensor-parallel): device slots are handed
out and returned, never derived from the engine id.

``engine_id % device_count`` put new ranks on busy devices after a few elastic cycles
(ids are never reused, so they walk around the devices while the free ones sit idle).
Here a host's launcher owns one ``DeviceSlots``: a rank of tensor-parallel size N takes N
free slots when it starts (``acquire``) and gives them back when it exits, however it
exits (``release``); a rank that cannot get N free slots does not start, with an error
naming what it needs and what is free.

Slot i is the i-th device this process can see: with ``CUDA_VISIBLE_DEVICES`` set, the
i-th entry of that list (``visible_devices``), so a worker pinned with the value
``visible_devices`` returns sees exactly its own device as ``cuda:0``.

Pure: no torch, no I/O (tested on CPU with a fake device count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class NoFreeDevices(ValueError):
    """Not enough free device slots on this host for a rank."""


class DeviceSlots:
    """The device slots of one host and their owners (engine ids)."""

    def __init__(self, num_devices: int) -> None:
        if num_devices < 0:
            raise ValueError(f"num_devices must be >= 0, got {num_devices}")
        self.num_devices = num_devices
        self._owner: dict[int, int] = {}  # slot -> engine id

    @property
    def free(self) -> list[int]:
        return [s for s in range(self.num_devices) if s not in self._owner]

    def held_by(self, owner: int) -> tuple[int, ...]:
        return tuple(sorted(s for s, o in self._owner.items() if o == owner))

    def acquire(self, owner: int, count: int) -> tuple[int, ...]:
        """``count`` free slots for ``owner``: the lowest run of adjacent free slots if
        there is one (neighbours usually share the fastest links), else the lowest free
        ones. ``NoFreeDevices`` when fewer are free; ``ValueError`` if ``owner`` already
        holds slots (a rank's devices are fixed for its life)."""
        if count < 1:
            raise ValueError(f"a rank needs at least one device slot, asked for {count}")
        if self.held_by(owner):
            raise ValueError(f"engine {owner} already holds device slots {self.held_by(owner)}")
        free = self.free
        if len(free) < count:
            busy = {o: self.held_by(o) for o in sorted(set(self._owner.values()))}
            raise NoFreeDevices(
                f"engine {owner} needs {count} device(s) (tensor_parallel_size) but only "
                f"{len(free)} of this host's {self.num_devices} are free {free}; in use: {busy}"
            )
        slots = _lowest_run(free, count) or tuple(free[:count])
        for s in slots:
            self._owner[s] = owner
        return slots

    def release(self, owner: int) -> tuple[int, ...]:
        """Return ``owner``'s slots (idempotent: nothing held, nothing returned)."""
        slots = self.held_by(owner)
        for s in slots:
            del self._owner[s]
        return slots


def _lowest_run(free: list[int], count: int) -> tuple[int, ...] | None:
    for i in range(len(free) - count + 1):
        run = free[i : i + count]
        if run[-1] - run[0] == count - 1:
            return tuple(run)
    return None


def visible_devices(slots: Sequence[int], env: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process that must see exactly ``slots``, as slot
    numbers of a process with environment ``env`` (whose own list, if any, they index)."""
    parent = env.get("CUDA_VISIBLE_DEVICES")
    if parent is None or not parent.strip():
        return ",".join(str(s) for s in slots)
    names = [n.strip() for n in parent.split(",") if n.strip()]
    bad = [s for s in slots if not 0 <= s < len(names)]
    if bad:
        raise ValueError(f"device slots {bad} are outside CUDA_VISIBLE_DEVICES={parent!r}")
    return ",".join(names[s] for s in slots)
