"""Executor ABC: how an engine core reaches its worker(s).

The engine core calls only these methods, never a worker directly (docs/architecture.md#layers), so an
executor whose workers live in other processes (``MultiprocExecutor``, TP > 1) is a
drop-in replacement for the in-process one (``UniProcExecutor``); ``create_executor``
(``tidal.executor.select``) picks by the config.

Threads: the engine's busy loop calls these; the elastic shell's helper threads call
``join_standby``, ``transfer_experts`` and ``standby_barrier`` meanwhile (see below)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tidal.config import EngineConfig
from tidal.executor.batch import ModelRunnerOutput, SchedulerOutput
from tidal.protocol.elastic import ExpertTransferSpec
from tidal.protocol.topology import Topology


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The processes of this rank's workers, in TP rank order (``/stats``)."""

    @abstractmethod
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` (from any thread) when a worker dies on its own: the
        rank is dead (docs/architecture.md#faults)."""

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker; one result per worker."""

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (sched,))[0]

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        self.collective_rpc("execute_dummy_batch", (num_tokens,))

    def all_reduce_dp(self, values: list[int], op: str = "sum") -> list[int]:
        """Reduce ``values`` (``op``: "sum" or "max") over the DP ranks (the busy loop's
        wave consensus): a collective, every rank calls it at the same step. One rank (no
        DP group): ``values``."""
        return self.collective_rpc("all_reduce_dp", (values, op))[0]

    # ---- liveness (docs/architecture.md#faults): called from the engine's I/O threads ----------------

    def abort_collectives(self, below_epoch: int, cause: str) -> None:
        """Thread-safe, from any thread while the busy loop may be blocked in a
        collective: every collective of serving groups older than ``below_epoch`` ends
        with ``GroupFailure`` (a recovery replaces those groups: a frozen peer must not
        hold the survivors until the collective timeout)."""
        self.collective_rpc("abort_collectives", (below_epoch, cause))

    def waiting_on_peers(self, thread_id: int) -> bool:
        """Thread-safe: whether thread ``thread_id`` (the busy loop's) waits in a
        collective for its peers (the stall watchdog must not take a rank waiting for a
        stuck peer for the stuck one)."""
        return any(self.collective_rpc("waiting_on_peers", (thread_id,)))

    # ---- elastic EP (docs/architecture.md#elastic-protocol; the engine's ``ElasticShell`` calls these) ----------
    # Helper-thread calls touch only the standby groups and staged experts of ``epoch``;
    # the others run on the busy loop's thread.

    def init_joiner(self, topology: Topology, engine_id: int) -> None:
        """A joining engine at startup: load the non-expert weights and allocate its expert
        slots (``topology.placement`` at its rank), no process group yet."""
        self.collective_rpc("init_joiner", (topology, engine_id))

    def join_standby(
        self,
        epoch: int,
        store_address: str,
        members: list[int],
        participants: list[int],
        engine_id: int,
        timeout_s: float,
    ) -> None:
        """Helper thread: create the standby groups of ``epoch`` on the TCPStore at
        ``store_address``: DP and EP over ``members`` (rank = position) if this engine is
        one, and the transfer group over ``participants``. Blocks until all have joined."""
        self.collective_rpc(
            "join_standby", (epoch, store_address, members, participants, engine_id, timeout_s)
        )

    def pack_expert_sends(self, epoch: int, sends: list[ExpertTransferSpec]) -> None:
        """Busy-loop thread: snapshot the weights of the experts this engine sends (so the
        helper never reads a slot an EPLB move is rewriting)."""
        self.collective_rpc("pack_expert_sends", (epoch, sends))

    def transfer_experts(
        self,
        epoch: int,
        sends: list[ExpertTransferSpec],
        receives: list[ExpertTransferSpec],
        engine_id: int,
        timeout_s: float,
    ) -> int:
        """Helper thread: send the packed experts and receive (stage) ``receives``, peer to
        peer over the transfer group, from disk where the source is None. Every engine
        walks the transfers in list order. Returns the bytes received (network + disk)."""
        return self.collective_rpc(
            "transfer_experts", (epoch, sends, receives, engine_id, timeout_s)
        )[0]

    def standby_barrier(self, epoch: int, wave: int, step: int) -> tuple[int, int]:
        """The first collective of the standby DP group of ``epoch``: MAX of (wave, step)."""
        return tuple(self.collective_rpc("standby_barrier", (epoch, wave, step))[0])

    def swap_groups(self, epoch: int) -> None:
        """The standby DP/EP groups of ``epoch`` become the current ones (the old ones are
        kept until ``destroy_retired_groups``); the transfer group is destroyed."""
        self.collective_rpc("swap_groups", (epoch,))

    def install_experts(self, epoch: int, layout: list[list[int]], rank: int) -> None:
        """Take rank ``rank`` of the placement ``layout`` (one row of logical experts per
        rank) in every MoE layer: kept experts, staged ones, disk for anything missing;
        dispatchers and EPLB rebuilt on the current (new) EP group."""
        self.collective_rpc("install_experts", (epoch, layout, rank))

    def destroy_standby(self, epoch: int) -> None:
        """Destroy whatever standby groups of ``epoch`` exist (idempotent, no peers)."""
        self.collective_rpc("destroy_standby", (epoch,))

    def discard_staged(self, epoch: int) -> None:
        self.collective_rpc("discard_staged", (epoch,))

    def destroy_retired_groups(self) -> None:
        """Survivor after a swap: destroy the old epoch's groups."""
        self.collective_rpc("destroy_retired_groups")

    def leave_groups(self) -> None:
        """Leaving engine at the commit: destroy the current groups."""
        self.collective_rpc("leave_groups")

    def abandon_groups(self) -> None:
        """A collective failed (rank death): destroy the current groups at once."""
        self.collective_rpc("abandon_groups")

    def set_num_threads(self, num_threads: int) -> None:
        self.collective_rpc("set_num_threads", (num_threads,))

    def get_expert_load(self) -> dict[int, list[int]]:
        """Per-layer expert load over the EPLB window, counted on this engine's rank(s)."""
        return self.collective_rpc("get_expert_load")[0]

    def get_eplb_info(self) -> dict[str, Any]:
        """EPLB rebalances so far and each MoE layer's physical -> logical expert layout."""
        return self.collective_rpc("get_eplb_info")[0]

    def get_cpu_kernels(self) -> dict[str, Any] | None:
        """The CPU path chosen for each op and the trial's timings (tidal/kernels/select.py),
        None off CPU."""
        return self.collective_rpc("get_cpu_kernels")[0]

    def shutdown(self) -> None:
        """Release the workers' process groups (each worker's ``shutdown``)."""
        self.collective_rpc("shutdown")
