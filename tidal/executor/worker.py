"""One worker's device: pin threads or the GPU, join the process groups, load weights,
allocate the KV cache. A DP rank is one worker (in the engine's process, ``uniproc``) or,
with tensor parallelism, N worker processes (``multiproc``).

Process groups (``tidal/executor/process_groups.py`` names them):

- ``tp`` (TP size > 1, ``init_tensor_parallel``): the rank's own workers, on the engine's
  own TCPStore; gloo on CPU, NCCL on CUDA. Its failure is the rank's death
  (``LocalGroupFailure``), never a peer's to recover from;
- with the DP machinery (DP > 1 or elastic EP, ``init_distributed``), on one TCPStore (the
  topology's ``store_address``, hosted by the first worker of DP rank 0):
  ``dp``: gloo over the DP ranks' TP-rank-0 workers (``dp.tp{t}``: their t-th workers),
  the busy loop's wave all-reduce and the per-forward token-count all-gather;
  ``ep`` (with ``enable_expert_parallel``): every worker of every rank, the MoE
  dispatch/combine and EPLB weight moves; gloo on CPU, NCCL on CUDA. DP rank = the
  engine's position in the ``Topology``; EP rank = position * TP size + TP rank.

DP and EP groups are ``StatelessGroup``s (nothing in torch's global state), so elastic
scaling can build new ones beside them and swap: the elastic methods (standby groups,
expert transfers, swap, install) live in ``tidal/executor/elastic.py``.

RPC (docs/architecture.md#worker-rpc): the engine calls a worker's parts by name,
``WORKER_RPCS``: this class's ``@rpc`` methods as ``worker.*``, the model runner's as
``runner.*``, ``ElasticWorkerState``'s as ``elastic.*``; nothing forwards between them.

Devices: on CUDA the launcher hands each rank device slots (``tidal/distributed/device_slots``):
a worker process sees only its own (``CUDA_VISIBLE_DEVICES``) and uses ``cuda:0``; an
in-process worker uses ``device_index``. On CPU each worker takes its share of the cores:
``cores // (local ranks * TP size)`` threads.

Security: the TCPStore and the gloo/NCCL peer connections have no authentication (the
ZMQ control plane does: tidal/distributed/zmq_auth.py). Multi-node deployments must keep
``data_parallel_address`` and the master port on a private network or behind a firewall.
Nothing read from them is unpickled (``StatelessGroup.all_gather_object`` is msgpack).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
from torch.distributed import ReduceOp

from tidal.config import EngineConfig, ParallelConfig
from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.core_slots import pin_process
from tidal.distributed.groups import LocalGroupFailure, StatelessGroup, create_store
from tidal.distributed.tensor_parallel import TensorParallel
from tidal.executor.elastic import ElasticWorkerState, parse_address
from tidal.executor.model_runner import ModelRunner
from tidal.executor.process_groups import WorkerGroups, dp_prefix, worker_rank
from tidal.executor.rpc import Reduce, Rpc, RpcTable, rpc
from tidal.kernels.cpu_ext import kernel_available, set_spin_pool, spin_pool_state
from tidal.kernels.host_memory import release_free_heap
from tidal.protocol.topology import Topology
from tidal.protocol.worker import ReplyMode
from tidal.utils.cpu_threads import pool_spin_us, threads_per_rank, usable_cores

logger = logging.getLogger(__name__)

# Group rendezvous and collective timeout. Generous: a peer may still be loading weights,
# or running a long CPU prefill, while this rank waits in a collective. A peer that froze
# does not cost this long: the serving groups' waits are abortable (``collectives``), and
# the recovery that removes the peer aborts them (docs/architecture.md#faults).
DIST_TIMEOUT_S = 300.0
TP_STORE_HOST = "127.0.0.1"  # a rank's workers share a host

_REDUCE_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}


def cpu_threads_for_rank(num_local_workers: int) -> int:
    """Each worker on a node takes an equal share of the cores (at least one)."""
    return threads_per_rank(usable_cores(), num_local_workers)


def _store_address(topology: Topology, parallel: ParallelConfig) -> tuple[str, int]:
    """``(host, port)`` of the groups' TCPStore: the topology's, else the launch flags."""
    if topology.store_address:
        return parse_address(topology.store_address)
    return parallel.data_parallel_address, parallel.data_parallel_master_port


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        local_rank: int = 0,
        *,
        dist_timeout_s: float = DIST_TIMEOUT_S,
        tp_rank: int = 0,
        device_index: int = 0,
    ) -> None:
        """``tp_rank``: this worker's place in its rank (TP size from the config);
        ``device_index``: the CUDA device it uses (its slot, or 0 in a process that sees
        only its own device)."""
        self.config = config
        self.local_rank = local_rank
        self.dist_timeout_s = dist_timeout_s
        self.tp_rank = tp_rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.device = self._init_device(device_index)
        torch.manual_seed(config.model.seed)
        self.model_runner = ModelRunner(config, self.device)
        self.groups = WorkerGroups()
        self.tp_group: StatelessGroup | None = None
        self._tp_store: Any = None
        # The topology's expert placement (rows per worker) from init_distributed, if any.
        self._layout: list[list[int]] | None = None
        # Shared by the serving DP/EP groups (current and standby): abort flags, and
        # whether the busy loop waits on its peers now.
        self.collectives = CollectiveControl()
        # The thread that runs this worker's steps: the one that built it (an engine builds
        # its executor on its busy loop's thread; a worker process serves its steps on its
        # main thread). ``waiting_on_peers`` asks about it.
        self.home_thread = threading.get_ident()
        self._tp_generation = 0  # TP groups rebuilt so far (``abandon_groups``)
        self.elastic = ElasticWorkerState(
            config, self.device, self.model_runner, self.groups, self.collectives, tp_rank,
            self.tp_size,
        )  # fmt: skip

    def rpc_targets(self) -> dict[str, object]:
        """The object behind each namespace of ``WORKER_RPCS``."""
        return {"worker": self, "runner": self.model_runner, "elastic": self.elastic}

    def serve(self, rpc: Rpc, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run one engine call (``fn``, the bound method of ``rpc``; every executor calls
        through here). Every call but a step may change what the model's CPU decode plans
        read (weights, kernel paths, caches, expert placement): it runs inside the plans'
        ``changing``, the report that ``Verify.ON_CHANGE`` counts on."""
        runner = self.model_runner
        if rpc.method in STEP_RPCS or not runner.has_model:
            return fn(*args)
        with runner.model.decode_plans.changing():
            return fn(*args)

    @property
    def dp_group(self) -> StatelessGroup | None:
        return self.groups.dp

    @property
    def ep_group(self) -> StatelessGroup | None:
        return self.groups.ep

    def _init_device(self, device_index: int) -> torch.device:
        if self.config.device == "cuda":
            device = torch.device("cuda", device_index)
            torch.cuda.set_device(device)
            return device
        p = self.config.parallel
        if p.cpu_cores:  # the launcher pinned this rank (core_slots.py); TP workers share it
            pin_process(p.cpu_cores)
            torch.set_num_threads(threads_per_rank(len(p.cpu_cores), self.tp_size))
        else:
            torch.set_num_threads(cpu_threads_for_rank(p.data_parallel_size_local * self.tp_size))
        if kernel_available():  # OpenMP unless this engine process was spawned with a window
            set_spin_pool(pool_spin_us(os.environ))
        return torch.device("cpu")

    # Startup failures fail the startup (the executor's), not a serving rank.
    @rpc(local=True)
    def start(
        self,
        topology: Topology | None = None,
        engine_id: int | None = None,
        joining: bool = False,
        local_expert_ids: list[int] | None = None,
        tp_store_port: int | None = None,
    ) -> None:
        """Everything between construction and the KV cache, in order: the rank's TP group
        (``tp_store_port``, TP size > 1), then a joiner's startup (``init_joiner``: no DP/EP
        group yet) or the DP/EP groups of ``topology`` and the model (with EP the placement
        decides what to load). On failure the groups made so far are destroyed."""
        try:
            if tp_store_port is not None:
                self.init_tensor_parallel(tp_store_port)
            if joining:
                if topology is None or engine_id is None:
                    raise ValueError("a joining engine needs its topology and engine id")
                self.elastic.init_joiner(topology, engine_id)
                return
            self.init_distributed(topology, engine_id)
            self.load_model(local_expert_ids)
        except Exception:
            self.shutdown()
            raise

    # ---- process groups ----------------------------------------------------------------

    def init_tensor_parallel(self, store_port: int) -> None:
        """Join the rank's TP group (every worker of the rank calls it) on the engine's
        TCPStore at ``127.0.0.1:store_port``. Call before ``load_model``."""
        if self.tp_size == 1 or self.tp_group is not None:
            return
        # Rank + 1: the engine process hosts the store (it outlives any one worker).
        self._tp_store = create_store(
            TP_STORE_HOST,
            store_port,
            rank=self.tp_rank + 1,
            world_size=self.tp_size + 1,
            timeout_s=self.dist_timeout_s,
        )
        self._join_tp_group("tp")

    def _join_tp_group(self, prefix: str) -> None:
        self.tp_group = StatelessGroup.create(
            host=TP_STORE_HOST,
            port=0,
            rank=self.tp_rank,
            world_size=self.tp_size,
            backend=self._backend(),
            store=self._tp_store,
            prefix=prefix,
            timeout_s=self.dist_timeout_s,
            failure=LocalGroupFailure,
        )
        tp = self.model_runner.tp
        if tp.size == 1:
            self.model_runner.tp = TensorParallel(self.tp_rank, self.tp_size, self.tp_group)
        else:  # a rebuild: every layer holds this very object
            tp.group = self.tp_group

    def break_tensor_parallel(self) -> None:
        """Destroy the TP group now: a TP peer waiting in one of its collectives fails at
        once (``LocalGroupFailure``) instead of at the timeout. After a step that a peer
        rank's death cut short, a worker may be in a TP collective its peers will never
        enter; the engine then rebuilds the group (``abandon_groups``)."""
        if self.tp_group is not None:
            self.tp_group.destroy()

    def _rebuild_tensor_parallel(self) -> None:
        """A fresh TP group on the same store (every worker of the rank calls it: each
        gets the same calls, so their generations agree)."""
        if self.tp_size == 1:
            return
        self.break_tensor_parallel()
        self._tp_generation += 1
        self._join_tp_group(f"tp.{self._tp_generation}")

    def init_distributed(
        self, topology: Topology | None = None, engine_id: int | None = None
    ) -> None:
        """Join the DP group (and the EP group with expert parallelism) of ``topology`` as
        a worker of engine ``engine_id``: DP rank = its position there, DP size =
        ``topology.size`` (the live size, not the launch size in the config), TCPStore at
        ``topology.store_address``. Blocks until every member has called it. Call before
        ``load_model``. Without a topology: the launch one (ids 0..N-1, this config's rank
        and master port), or no DP group for a single rank (with EP and TP > 1, the EP
        group of the rank's own workers still forms, on the TP store)."""
        p = self.config.parallel
        if self.groups.dp is not None or self.groups.ep is not None:
            return
        if topology is None:
            if p.data_parallel_size <= 1:
                self._init_local_ep()
                return
            topology = Topology.initial(p.data_parallel_size, tp_size=self.tp_size)
            engine_id = p.data_parallel_rank
        if engine_id is None:
            raise ValueError("init_distributed: a topology needs this engine's id")
        position, world = topology.rank_of(engine_id), topology.size
        tp = self.tp_size
        host, port = _store_address(topology, p)
        if not port:
            raise ValueError(
                "data_parallel_master_port must be set (the launcher picks a free port) "
                f"for a DP group of {world}"
            )
        timeout = self.dist_timeout_s
        me = worker_rank(position, self.tp_rank, tp)
        g = self.groups
        g.store = create_store(host, port, rank=me, world_size=world * tp, timeout_s=timeout)
        serving = {"control": self.collectives, "epoch": topology.epoch}
        try:
            g.dp = StatelessGroup.create(
                host=host, port=0, rank=position, world_size=world, backend="gloo",
                store=g.store, prefix=dp_prefix(self.tp_rank), timeout_s=timeout, **serving,
            )  # fmt: skip
            if p.enable_expert_parallel:
                g.ep = StatelessGroup.create(
                    host=host, port=0, rank=me, world_size=world * tp, backend=self._backend(),
                    store=g.store, prefix="ep", timeout_s=timeout, **serving,
                )  # fmt: skip
        except Exception:
            self.shutdown()
            raise
        self.model_runner.set_process_groups(g.dp, g.ep)
        self._layout = topology.placement
        self.elastic.epoch = topology.epoch
        logger.info(
            "engine %d worker %d: DP rank %d/%d of epoch %d joined the process groups (EP: %s)",
            engine_id,
            self.tp_rank,
            position,
            world,
            topology.epoch,
            g.ep.backend_name if g.ep else "off",
        )

    def _init_local_ep(self) -> None:
        """One DP rank with EP over its TP workers: the EP group is the rank's workers."""
        if not self.config.parallel.enable_expert_parallel or self.tp_size == 1:
            return
        self.groups.ep = StatelessGroup.create(
            host=TP_STORE_HOST, port=0, rank=self.tp_rank, world_size=self.tp_size,
            backend=self._backend(), store=self._tp_store, prefix="ep",
            timeout_s=self.dist_timeout_s, failure=LocalGroupFailure,
        )  # fmt: skip
        self.model_runner.set_process_groups(None, self.groups.ep)

    def _backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @rpc(timeout_s=10.0)
    def shutdown(self) -> None:
        """Destroy the groups, standby and retired ones included (idempotent, does not
        wait for peers) and drop the stores."""
        self.elastic.shutdown()
        self.groups.destroy()
        self.model_runner.set_process_groups(None, None)
        if self.tp_group is not None:
            self.tp_group.destroy()
        self.tp_group = None
        self._tp_store = None

    # ---- model -------------------------------------------------------------------------

    def load_model(self, local_expert_ids: list[int] | None = None) -> None:
        """With EP the topology's placement (``init_distributed``) picks the experts."""
        self.model_runner.load_model(local_expert_ids, layout=self._layout)

    @rpc()
    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cpu":  # the end of startup: what loading freed goes back
            release_free_heap()

    @rpc(Reduce.SUM, local=True)  # a rank's bytes are its workers' together
    def free_kv_cache(self) -> int:
        """Sleep mode (docs/operations.md#sleep-mode): drop the KV cache, returning its
        bytes to the OS; ``initialize_kv_cache`` makes it again. Returns the bytes freed."""
        freed = self.model_runner.free_kv_cache()
        if self.device.type == "cpu":
            release_free_heap()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    @rpc(Reduce.SUM, local=True)  # a rank's weights are its workers' together
    def free_weights(self) -> int:
        """Sleep level 2: drop the model's weights (``ModelRunner.free_weights``) and
        return the memory to the OS; ``reload_weights`` reads them again. The bytes freed,
        measured: resident memory on CPU, allocated memory on GPU (the packed layouts the
        CPU paths hold are opaque to a count of tensors)."""
        before = self._held_bytes()
        self.model_runner.free_weights()
        gc.collect()  # the model's modules may hold reference cycles
        if self.device.type == "cpu":
            release_free_heap()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
        return max(0, before - self._held_bytes())

    def _held_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return psutil.Process().memory_info().rss

    @rpc()  # the CPU path trials agree over the TP group: every worker, in step
    def reload_weights(self) -> None:
        """Wake-up from level 2: load the weights again from the checkpoint."""
        self.model_runner.reload_weights()

    # With TP only the driver calls it: the DP group of the rank-0 workers carries the
    # ranks' consensus.
    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER, driver_only=True)
    def all_reduce_dp(self, values: list[int], op: str = "sum") -> list[int]:
        """Reduce ``values`` (``op``: "sum" or "max") over the DP group (gloo, CPU); as they
        are without one (DP=1). With TP only the driver calls it (its group is the ranks'
        consensus)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        if self.groups.dp is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        return self.groups.dp.all_reduce(t, _REDUCE_OPS[op]).tolist()

    # ---- liveness (docs/architecture.md#faults): the engine's I/O threads ask, any time ----
    # A worker process serves them on a thread of their own while its home thread is
    # blocked in a collective (``worker_proc``).

    @rpc(timeout_s=10.0)
    def abort_collectives(self, below_epoch: int, cause: str) -> None:
        """Collectives of serving groups older than ``below_epoch`` end now with
        ``GroupFailure``: a recovery replaces those groups, and a frozen peer must not hold
        the survivors until the collective timeout."""
        self.collectives.abort(below_epoch, cause)

    @rpc(Reduce.ANY, timeout_s=10.0, empty_after_shutdown=True)
    def waiting_on_peers(self) -> bool:
        """Whether the home thread (the one running steps) waits in a collective of the
        serving groups for its peers: the stall watchdog must not take a rank waiting for
        a stuck peer for the stuck one."""
        return self.collectives.is_waiting(self.home_thread)

    # ---- elastic EP: the rest is ``elastic.*`` (tidal/executor/elastic.py) --------------

    # Cleans up after a failure: bounded (the TP group's rendezvous included).
    @rpc(timeout_s=120.0)
    def abandon_groups(self) -> None:
        """A collective of the current DP/EP groups failed (a peer rank died): destroy
        them now (``ElasticWorkerState.abandon_groups``), and start a fresh TP group: the
        step the failure cut short may have left a TP peer in a TP collective, whose group
        that peer's worker process broke to free it (``WorkerProc``)."""
        self.elastic.abandon_groups()
        self._rebuild_tensor_parallel()

    @rpc(local=True)
    def set_num_threads(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)

    @rpc(Reduce.FIRST)
    def get_cpu_kernels(self) -> dict[str, Any] | None:
        """The measured kernel choices (``/stats``), with the cores this worker runs on and
        its thread count: pinned (``--cpu-affinity``) or the process's whole mask."""
        if not self.model_runner.has_model:  # asleep at level 2: no paths serve now
            return None
        report = getattr(self.model_runner.model, "cpu_paths", None)
        if report is None:
            return None
        return {
            **report.as_dict(),
            "cores": sorted(os.sched_getaffinity(0)),
            "pinned": bool(self.config.parallel.cpu_cores),
            "threads": torch.get_num_threads(),
            # the C++ kernels' spin pool window (microseconds), 0: they run on OpenMP
            "spin_pool_us": spin_pool_state()[0] if kernel_available() else 0,
        }


# The calls that only step the model (``Worker.serve``).
STEP_RPCS = frozenset({"runner.execute_model", "runner.execute_model_async"})

# The engine's view of a worker's parts (``Worker.rpc_targets`` on the worker's side).
WORKER_RPCS = RpcTable({"worker": Worker, "runner": ModelRunner, "elastic": ElasticWorkerState})
