"""Where engine processes run (docs/architecture.md#launchers): one ABC, one implementation per backend.

A launcher places, starts, watches and stops engine ranks; nothing else. The handshake,
the sockets, the stores and the process groups are the same whichever launcher started a
rank, so the engine process manager (``proc_manager``) holds a launcher and never asks
which one it is.

A started rank is an ``EngineHandle``: the part of ``multiprocessing.Process``'s interface
that process managers use, whatever the process is (a local child, a warm launcher's
fork, a process beside a Ray actor on another node). Its ``sentinel`` becomes readable
when the rank has exited (``multiprocessing.connection.wait`` watches it), so the
manager's one monitor thread watches local and Ray ranks alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from tidal.config import EngineConfig

if TYPE_CHECKING:
    from tidal.frontend.launchers.registry import LauncherKind


class EngineHandle(Protocol):
    """A started engine rank (``ModuleProcess``, ``ForkedProcess``, ``RayEngine``)."""

    name: str

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class LauncherUnavailable(RuntimeError):
    """The launcher cannot run at all (its cluster is unreachable); the message says
    which flag or variable to check. ``launch`` reports it as an error, not a traceback."""


class LaunchError(RuntimeError):
    """Ranks could not be started; ``engine_id`` names the (first) one, the message why.
    Nothing the failed ``start`` started is left behind."""

    def __init__(self, engine_id: int, message: str) -> None:
        super().__init__(message)
        self.engine_id = engine_id


class PlacementError(LaunchError):
    """Ranks could not be placed (no free node, a placement deadline passed); the message
    names what is missing."""


class Launcher(ABC):
    """Places and starts engine ranks, and frees their resources when they stop.

    Threads: ``start`` runs on one thread at a time (the launch, then one scale operation
    at a time); ``node_of`` from any thread; ``close`` once, after every handle it returned
    was stopped and closed."""

    #: Its ``--data-parallel-backend`` value and what that can do.
    kind: ClassVar[LauncherKind]
    #: What ranks are started with (``with_config``).
    config: EngineConfig

    def with_config(self, config: EngineConfig) -> Launcher:
        """Start ranks with ``config`` from now on: the deployment's final one, with the
        addresses and ports the frontend chose after making the launcher."""
        self.config = config
        return self

    def launch_ranks(self, engine_ids: Sequence[int]) -> list[int]:
        """Which of the launch ranks ``engine_ids`` this frontend starts: all of them where
        the launcher places every rank, else this host's share, the first
        ``--data-parallel-size-local`` (``--headless`` hosts start the others)."""
        if self.kind.starts_all_ranks:
            return list(engine_ids)
        return list(engine_ids[: self.config.parallel.data_parallel_size_local])

    @abstractmethod
    def start(
        self, engine_ids: Sequence[int], handshake_address: str, *, warm: bool
    ) -> dict[int, EngineHandle]:
        """Start these engine ranks, each told to handshake at ``handshake_address``.
        ``warm``: a scale-up, which should take what was started ahead. All or nothing:
        on a failure what this call started is stopped again and the error raised
        (``LaunchError``; ``PlacementError`` when resources are missing)."""

    @abstractmethod
    def node_of(self, engine_id: int) -> str | None:
        """The node a rank this launcher started runs on (Ray node id; host name), or
        None when it did not start it (a headless host's rank: its HELLO says)."""

    @abstractmethod
    def release(self, engine_id: int) -> None:
        """A rank this launcher started has exited or was stopped: what it held (device
        slots) is free again, and the launcher forgets it. Idempotent."""

    def frontend_host(self, configured: str) -> str:
        """The address ranks reach the frontend at, given ``--data-parallel-address``."""
        return configured

    def cancel(self, engine_ids: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """A ``start`` of these ranks running on another thread is no longer wanted (its
        scale-up rolled back): it may give up early, raising ``LaunchError`` and leaving
        nothing behind. Its caller stops whatever it returns anyway, so a launcher whose
        ``start`` is quick ignores this."""

    def begin_close(self) -> None:  # noqa: B027 - optional hook
        """The deployment is shutting down: start nothing more on its behalf (the warm
        launcher's keeper stops). The ranks are stopped after this, then ``close``."""

    @abstractmethod
    def close(self) -> None:
        """Release what the launcher holds itself (warm launchers, ranks started ahead,
        a cluster connection). Idempotent."""
