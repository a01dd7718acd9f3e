"""``--data-parallel-backend mp`` (the default, docs/architecture.md#launchers): engine ranks as local
processes of the frontend, other hosts' ranks started there by ``launch --headless``
(``spawn_headless_engines``), which reach the frontend over TCP.

Engines run ``python -m <entry_module>`` (``tidal.engine_core.entry``), never
multiprocessing's spawn: that would re-run the caller's ``__main__`` in each of them.

Elastic EP: a warm launcher (the zygote: imports done once) forks joining engines, so a
scale-up does not wait seconds for each new interpreter's imports. It is started once the
launch engines are (``start_warm_launcher``: it imports while they load). Tests that
substitute the entry module start their engines cold. The zygote is no single point of
failure: a keeper thread restarts one that died or stopped answering its pings (frozen:
SIGKILLed first); its forked engines are the frontend's, not its, and keep serving. A
spawn while no zygote is ready starts cold.

Devices (CUDA): a rank of tensor-parallel size N takes N free device slots of this host
when it starts and gives them back when it stops or dies (``DeviceSlots``); a rank that
cannot get them does not start (a scale-up then rolls back with that cause).

Cores (CPU): where the host runs several ranks, each takes a free group of cores
(``CoreSlots``, ``--cpu-affinity``) that its threads, TP workers included, are pinned to,
given back the same way; a rank that finds none free runs unpinned.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_sentinels

import torch

from tidal.config import EngineConfig
from tidal.distributed.core_slots import CoreSlots, host_cores, plan_groups
from tidal.distributed.device_slots import DeviceSlots
from tidal.engine_core.entry import (
    ENGINE_ENTRY_MODULE,
    spawn_engine,
    start_engine_process,
    start_engine_zygote,
)
from tidal.frontend.launchers.base import EngineHandle, Launcher, LaunchError
from tidal.frontend.launchers.registry import KINDS
from tidal.utils.forkserver import ForkedProcess, ForkServer
from tidal.utils.procs import ModuleProcess

logger = logging.getLogger(__name__)

# A local engine process: a fresh interpreter, or forked by the warm launcher.
EngineProcess = ModuleProcess | ForkedProcess

# The warm launcher's keeper: how often it pings the zygote, and after how long without
# an answer the zygote counts as frozen (killed and replaced).
ZYGOTE_PING_S = 1.0
ZYGOTE_TIMEOUT_S = 5.0
# A warm spawn is answered in milliseconds by a ready zygote; past this it is cancelled
# and the engine starts cold. A zygote still importing is waited for as long.
WARM_SPAWN_TIMEOUT_S = 10.0


class MPLauncher(Launcher):
    kind = KINDS["mp"]

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self.config = config
        self._entry_module = entry_module or ENGINE_ENTRY_MODULE
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # guards devices, cores, _zygote, _closed, _started
        self.devices = DeviceSlots(local_device_count(config))
        self.cores = host_core_slots(config)
        self._started: set[int] = set()
        self._closed = False
        self._zygote: ForkServer | None = None
        self.zygote_restarts = 0
        self._keeper: threading.Thread | None = None
        self._keeper_stop_r, self._keeper_stop_w = Pipe(duplex=False)

    def start_warm_launcher(self) -> None:
        """Elastic EP with the engine's own entry module: start the zygote and its keeper
        (once)."""
        par = self.config.parallel
        if not par.enable_elastic_ep or self._entry_module != ENGINE_ENTRY_MODULE:
            return
        if self._zygote is not None or self._closed:
            return
        self._zygote = start_engine_zygote(self.config)
        self._keeper = threading.Thread(target=self._keep_zygote, name="zygote-keeper", daemon=True)
        self._keeper.start()

    # ---- starting ranks ---------------------------------------------------------------

    def start(
        self, engine_ids: Sequence[int], handshake_address: str, *, warm: bool
    ) -> dict[int, EngineHandle]:
        started: dict[int, EngineHandle] = {}
        for e in engine_ids:
            try:
                started[e] = self._start_one(e, handshake_address, warm)
            except BaseException as err:
                for s, proc in started.items():  # all or nothing
                    proc.kill()
                    proc.join(5)
                    proc.close()
                    self.release(s)
                raise LaunchError(e, str(err)) from err
        if not warm and self._keeper is None:
            self.start_warm_launcher()  # after the launch ranks: it imports while they load
        return started

    def _start_one(self, e: int, handshake_address: str, warm: bool) -> EngineProcess:
        # At launch an engine's id is its launch rank (ids 0..N-1 in rank order); a
        # joining engine's is fresh (``Topology.new_engine_ids``).
        cfg = self.config.with_parallel(
            data_parallel_rank=e, device_ids=self._take_devices(e), cpu_cores=self._take_cores(e)
        )
        proc: EngineProcess | None = None
        zygote = self._zygote
        # A zygote still importing is waited for: it is done sooner than a cold start
        # would be, and the two would share the cores meanwhile.
        if warm and zygote is not None and zygote.wait_ready(WARM_SPAWN_TIMEOUT_S):
            try:
                proc = spawn_engine(zygote, cfg, e, handshake_address, WARM_SPAWN_TIMEOUT_S)
            except RuntimeError as err:  # gone or stuck: a cold start still works
                logger.warning("engine %d: warm start failed (%s); starting cold", e, err)
        if proc is None:
            try:
                proc = start_engine_process(cfg, e, handshake_address, self._entry_module)
            except BaseException:
                self.release(e)
                raise
        with self._lock:
            self._started.add(e)
        return proc

    def _take_devices(self, engine_id: int) -> tuple[int, ...]:
        """The rank's device slots (CUDA), ``NoFreeDevices`` when this host has too few."""
        if self.config.device != "cuda":
            return ()
        with self._lock:
            return self.devices.acquire(engine_id, self.config.parallel.tensor_parallel_size)

    def _take_cores(self, engine_id: int) -> tuple[int, ...]:
        """The rank's core group (CPU ranks pinned by ``--cpu-affinity``), else ``()``."""
        if self.cores is None:
            return ()
        with self._lock:
            return self.cores.acquire(engine_id)

    def release(self, engine_id: int) -> None:
        with self._lock:
            self.devices.release(engine_id)  # it exited or was reaped: free again
            if self.cores is not None:
                self.cores.release(engine_id)
            self._started.discard(engine_id)

    def node_of(self, engine_id: int) -> str | None:
        with self._lock:
            return self._host if engine_id in self._started else None

    # ---- the warm launcher's keeper -----------------------------------------------------

    @property
    def zygote(self) -> ForkServer | None:
        return self._zygote

    def _keep_zygote(self) -> None:
        """Restart the zygote when it died or froze (docs/architecture.md#faults); ping it meanwhile."""
        stop = self._keeper_stop_r
        while not self._closed:
            zygote = self._zygote
            if zygote is None:
                return
            watch = [stop] if zygote.sentinel is None else [stop, zygote.sentinel]
            if stop in wait_sentinels(watch, ZYGOTE_PING_S) or self._closed:
                return
            if zygote.alive and zygote.unresponsive(ZYGOTE_TIMEOUT_S):
                logger.error("the engine zygote answered nothing for %gs: killed", ZYGOTE_TIMEOUT_S)
                zygote.kill()
                zygote.gone.wait(5.0)
            if zygote.alive:
                try:
                    zygote.ping()
                except RuntimeError:
                    pass  # gone: restarted at the next turn
                continue
            self._restart_zygote(zygote)

    def _restart_zygote(self, old: ForkServer) -> None:
        """A new zygote for a dead one. Its children are the frontend's engines and keep
        running; a scale-up meanwhile starts cold (``_start_one``: not ready yet)."""
        logger.error("the engine zygote (pid %d) is gone: starting a new one", old.pid)
        old.close(timeout_s=1.0)
        with self._lock:
            if self._closed:
                return
            try:
                self._zygote = start_engine_zygote(self.config)
            except Exception:  # noqa: BLE001 - retried at the next turn; cold starts work
                logger.exception("could not start a new engine zygote")
                return
            self.zygote_restarts += 1

    def begin_close(self) -> None:
        """Stop the keeper first (it would restart a zygote that exits)."""
        with self._lock:
            self._closed = True
        try:
            self._keeper_stop_w.send_bytes(b"s")
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """After the engines are stopped and reaped: the keeper, then the zygote."""
        self.begin_close()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(5)
            self._keeper = None
        self._keeper_stop_r.close()
        self._keeper_stop_w.close()
        if self._zygote is not None:
            self._zygote.close()


def local_device_count(config: EngineConfig) -> int:
    """Accelerators this host gives engine ranks (0 on CPU)."""
    return torch.cuda.device_count() if config.device == "cuda" else 0


def spawn_headless_engines(config: EngineConfig, handshake_address: str) -> list[ModuleProcess]:
    """``launch --headless``: start this host's ranks; they handshake with the frontend
    at ``handshake_address`` (tcp) and get every other address from it."""
    par = config.parallel
    first = par.data_parallel_start_rank
    procs: list[ModuleProcess] = []
    devices = DeviceSlots(local_device_count(config))
    cores = host_core_slots(config)
    try:
        for idx in range(first, first + par.data_parallel_size_local):
            slots = (
                devices.acquire(idx, par.tensor_parallel_size) if config.device == "cuda" else ()
            )
            pinned = cores.acquire(idx) if cores is not None else ()
            cfg = config.with_parallel(data_parallel_rank=idx, device_ids=slots, cpu_cores=pinned)
            procs.append(start_engine_process(cfg, idx, handshake_address))
    except BaseException:
        for p in procs:  # the ranks started before the failure
            p.kill()
            p.join()
            p.close()
        raise
    return procs


def host_core_slots(config: EngineConfig) -> CoreSlots | None:
    """This host's core groups, one per local rank, where its CPU ranks are pinned
    (``core_slots.plan_groups``, ``--cpu-affinity``); None where they are not."""
    par = config.parallel
    if config.device != "cpu":
        return None
    groups = plan_groups(
        par.cpu_affinity, host_cores(), par.data_parallel_size_local, par.tensor_parallel_size
    )
    return None if groups is None else CoreSlots(groups)
