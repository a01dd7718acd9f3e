"""One rank's device: pin threads or the GPU, join the process groups, load weights,
allocate the KV cache.

Process groups (``init_distributed``, with the DP machinery: DP > 1 or elastic EP): one
TCPStore (the topology's ``store_address``), hosted by DP rank 0, carries

- ``dp_group``: gloo over all DP ranks (prefix "dp"): CPU consensus — the busy loop's wave
  all-reduce and the per-forward token-count all-gather;
- ``ep_group`` (with ``enable_expert_parallel``; prefix "ep"): the MoE dispatch/combine
  and EPLB weight moves; gloo on CPU, NCCL on CUDA. EP rank == DP rank == the engine's
  position in the ``Topology``; the group size is the topology's (the live size).

Both are ``StatelessGroup``s (nothing in torch's global state), so elastic scaling can
build new ones beside them and swap: the elastic methods (standby groups, expert
transfers, swap, install) live in ``tidal/executor/elastic.py``; this class forwards them.

Security: the TCPStore and the gloo/NCCL peer connections have no authentication (the
ZMQ control plane does: tidal/distributed/zmq_auth.py). Multi-node deployments must keep
``data_parallel_address`` and the master port on a private network or behind a firewall.
Nothing read from them is unpickled (``StatelessGroup.all_gather_object`` is msgpack).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.distributed import ReduceOp

from tidal.config import EngineConfig, ParallelConfig
from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.groups import StatelessGroup, create_store
from tidal.executor.batch import ModelRunnerOutput, SchedulerOutput
from tidal.executor.elastic import ElasticWorkerState, parse_address
from tidal.executor.model_runner import ModelRunner
from tidal.protocol.elastic import ExpertTransferSpec
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)

# Group rendezvous and collective timeout. Generous: a peer may still be loading weights,
# or running a long CPU prefill, while this rank waits in a collective. A peer that froze
# does not cost this long: the serving groups' waits are abortable (``collectives``), and
# the recovery that removes the peer aborts them (DESIGN.md 6.5).
DIST_TIMEOUT_S = 300.0

_REDUCE_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}


def cpu_threads_for_rank(num_local_ranks: int) -> int:
    """Each rank on a node takes an equal share of the cores (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, num_local_ranks))


def _store_address(topology: Topology, parallel: ParallelConfig) -> tuple[str, int]:
    """``(host, port)`` of the groups' TCPStore: the topology's, else the launch flags."""
    if topology.store_address:
        return parse_address(topology.store_address)
    return parallel.data_parallel_address, parallel.data_parallel_master_port


class Worker:
    def __init__(
        self, config: EngineConfig, local_rank: int = 0, *, dist_timeout_s: float = DIST_TIMEOUT_S
    ) -> None:
        self.config = config
        self.local_rank = local_rank
        self.dist_timeout_s = dist_timeout_s
        self.device = self._init_device()
        torch.manual_seed(config.model.seed)
        self.model_runner = ModelRunner(config, self.device)
        self.dp_group: StatelessGroup | None = None
        self.ep_group: StatelessGroup | None = None
        self._store: Any = None
        # The topology's expert placement (rows per rank) from init_distributed, if any.
        self._layout: list[list[int]] | None = None
        # Shared by the serving DP/EP groups (current and standby): abort flags, and
        # whether the busy loop waits on its peers now.
        self.collectives = CollectiveControl()
        self.elastic = ElasticWorkerState(self)

    def _init_device(self) -> torch.device:
        if self.config.device == "cuda":
            device = torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            return device
        torch.set_num_threads(cpu_threads_for_rank(self.config.parallel.data_parallel_size_local))
        return torch.device("cpu")

    # ---- process groups ----------------------------------------------------------------

    def init_distributed(
        self, topology: Topology | None = None, engine_id: int | None = None
    ) -> None:
        """Join the DP group (and the EP group with expert parallelism) of ``topology`` as
        engine ``engine_id``: rank = its position there, world size = ``topology.size``
        (the live size, not the launch size in the config), TCPStore at
        ``topology.store_address``. Blocks until every member has called it. Call before
        ``load_model``. Without a topology: the launch one (ids 0..N-1, this config's rank
        and master port), or no groups for a single rank."""
        p = self.config.parallel
        if self.dp_group is not None:
            return
        if topology is None:
            if p.data_parallel_size <= 1:
                return
            topology, engine_id = Topology.initial(p.data_parallel_size), p.data_parallel_rank
        if engine_id is None:
            raise ValueError("init_distributed: a topology needs this engine's id")
        rank, world = topology.rank_of(engine_id), topology.size
        host, port = _store_address(topology, p)
        if not port:
            raise ValueError(
                "data_parallel_master_port must be set (the launcher picks a free port) "
                f"for a DP group of {world}"
            )
        timeout = self.dist_timeout_s
        self._store = create_store(host, port, rank=rank, world_size=world, timeout_s=timeout)
        common = {
            "host": host,
            "port": 0,
            "rank": rank,
            "world_size": world,
            "control": self.collectives,
            "epoch": topology.epoch,
        }
        try:
            self.dp_group = StatelessGroup.create(
                **common, backend="gloo", store=self._store, prefix="dp", timeout_s=timeout
            )
            if p.enable_expert_parallel:
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                self.ep_group = StatelessGroup.create(
                    **common, backend=backend, store=self._store, prefix="ep", timeout_s=timeout
                )
        except Exception:
            self.shutdown()
            raise
        self.model_runner.set_process_groups(self.dp_group, self.ep_group)
        self._layout = topology.placement
        self.elastic.epoch = topology.epoch
        logger.info(
            "engine %d: DP rank %d/%d of epoch %d joined the process groups (EP: %s)",
            engine_id,
            rank,
            world,
            topology.epoch,
            self.ep_group.backend_name if self.ep_group else "off",
        )

    def shutdown(self) -> None:
        """Destroy the groups, standby and retired ones included (idempotent, does not
        wait for peers) and drop the store."""
        self.elastic.shutdown()
        for group in (self.ep_group, self.dp_group):
            if group is not None:
                group.destroy()
        self.ep_group = self.dp_group = None
        self.model_runner.set_process_groups(None, None)
        self._store = None

    # ---- model -------------------------------------------------------------------------

    def load_model(self, local_expert_ids: list[int] | None = None) -> None:
        """With EP the topology's placement (``init_distributed``) picks the experts."""
        self.model_runner.load_model(local_expert_ids, layout=self._layout)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def execute_dummy_batch(self, num_tokens: int = 1) -> None:
        self.model_runner.execute_dummy_batch(num_tokens)

    def all_reduce_dp(self, values: list[int], op: str = "sum") -> list[int]:
        """Reduce ``values`` (``op``: "sum" or "max") over the DP group (gloo, CPU); as they
        are without one (DP=1)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        if self.dp_group is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        return self.dp_group.all_reduce(t, _REDUCE_OPS[op]).tolist()

    def abort_collectives(self, below_epoch: int, cause: str) -> None:
        """Any thread: collectives of serving groups older than ``below_epoch`` end now."""
        self.collectives.abort(below_epoch, cause)

    def waiting_on_peers(self, thread_id: int) -> bool:
        """Any thread: whether thread ``thread_id`` waits in a collective of the serving
        groups for its peers."""
        return self.collectives.is_waiting(thread_id)

    # ---- elastic EP (tidal/executor/elastic.py; see Executor for the contract) ----------

    def init_joiner(self, topology: Topology, engine_id: int) -> None:
        self.elastic.init_joiner(topology, engine_id)

    def join_standby(
        self,
        epoch: int,
        store_address: str,
        members: list[int],
        participants: list[int],
        engine_id: int,
        timeout_s: float,
    ) -> None:
        self.elastic.join_standby(epoch, store_address, members, participants, engine_id, timeout_s)

    def pack_expert_sends(self, epoch: int, sends: list[ExpertTransferSpec]) -> None:
        self.elastic.pack_expert_sends(epoch, sends)

    def transfer_experts(
        self,
        epoch: int,
        sends: list[ExpertTransferSpec],
        receives: list[ExpertTransferSpec],
        engine_id: int,
        timeout_s: float,
    ) -> int:
        return self.elastic.transfer_experts(epoch, sends, receives, engine_id, timeout_s)

    def standby_barrier(self, epoch: int, wave: int, step: int) -> tuple[int, int]:
        return self.elastic.standby_barrier(epoch, wave, step)

    def swap_groups(self, epoch: int) -> None:
        self.elastic.swap_groups(epoch)

    def install_experts(self, epoch: int, layout: list[list[int]], rank: int) -> None:
        self.elastic.install_experts(epoch, layout, rank)

    def destroy_standby(self, epoch: int) -> None:
        self.elastic.destroy_standby(epoch)

    def discard_staged(self, epoch: int) -> None:
        self.elastic.discard_staged(epoch)

    def destroy_retired_groups(self) -> None:
        self.elastic.destroy_retired_groups()

    def leave_groups(self) -> None:
        self.elastic.leave_groups()

    def abandon_groups(self) -> None:
        self.elastic.abandon_groups()

    def set_num_threads(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)

    # ---- expert load balancing ---------------------------------------------------------

    def get_expert_load(self) -> dict[int, list[int]]:
        """This rank's per-layer expert load over the EPLB window (see ModelRunner)."""
        return self.model_runner.get_expert_load()

    def rebalance_experts(self) -> bool:
        """Collective over the EP group: every rank at the same step boundary."""
        return self.model_runner.rebalance_experts()

    def get_eplb_info(self) -> dict[str, Any]:
        return self.model_runner.get_eplb_info()
