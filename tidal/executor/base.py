"""Executor ABC: how an engine core reaches its worker(s).

The engine core never touches a worker directly (docs/architecture.md#layers): it calls
``executor.call("<namespace>.<method>", *args)`` (docs/architecture.md#worker-rpc), so an
executor whose workers live in other processes (``MultiprocExecutor``, TP > 1) is a
drop-in replacement for the in-process one (``UniProcExecutor``); ``create_executor``
(``tidal.executor.select``) picks by the config. Each worker method declares how the
results of a rank's workers combine (``tidal.executor.rpc.Reduce``); an executor only
carries calls.

Threads: the engine's busy loop makes most calls; the elastic shell's helper threads call
``elastic.join_standby``, ``elastic.transfer_experts`` and ``elastic.standby_barrier``
meanwhile, and the engine's I/O threads the liveness calls (``worker.abort_collectives``,
``worker.waiting_on_peers``). An executor is built on the busy loop's thread."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tidal.config import EngineConfig
from tidal.executor.rpc import Reduce, Rpc
from tidal.executor.worker import WORKER_RPCS


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def call(self, method: str, *args: Any, reduce: Reduce | None = None) -> Any:
        """Run ``method`` (``"<namespace>.<method>"``, an exported worker method) on the
        rank's workers and combine their results as the method declares; ``reduce``
        overrides that (``Reduce.EACH``: every answering worker's result). An unknown
        name raises ``RpcNameError`` before anything is sent."""
        r = WORKER_RPCS.resolve(method)
        results = self._run(r, args)
        return r.combine(results) if reduce is None else reduce.apply(results)

    @abstractmethod
    def _run(self, rpc: Rpc, args: tuple[Any, ...]) -> list[Any]:
        """Run ``rpc`` on the workers; the results of those that answer, in TP rank
        order."""

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The processes of this rank's workers, in TP rank order (``/stats``)."""

    @abstractmethod
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` (from any thread) when a worker dies on its own: the
        rank is dead (docs/architecture.md#faults)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers' process groups (each worker's ``shutdown``) and the
        workers themselves. Idempotent."""
