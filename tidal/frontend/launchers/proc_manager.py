"""Engine processes seen from the frontend: where they connect (``frontend_addresses``),
starting them through a launcher (``launchers/``: local processes, or Ray actors), the
startup handshake with every rank (started here or by a headless host elsewhere), watching
for exits, stopping them (``EngineProcManager``).

Elastic EP (docs/architecture.md#elastic-protocol) adds engines while the deployment serves: ``spawn`` starts
fresh engine ids whose handshake answer carries the *new* topology and ``joining=True``,
``wait_for_joiners`` runs their handshake (READY), and ``stop`` ends chosen engines
(leaving ones, or the joiners of a rolled-back operation). The monitor thread watches a
set that changes while it runs (a wake-up pipe makes it rebuild its wait list) and
reports every exit nobody asked for as ``on_exit(engine_id, exitcode)``; exits caused by
``stop`` or ``shutdown`` are expected and never reported.

Which launcher started a rank makes no difference here: every rank is an
``EngineHandle`` with a sentinel the monitor waits on (a Ray rank's turns readable when Ray
reports its engine exited or its actor or node dead), and the launcher is told when a rank
is gone (``release``: its devices, its placement group).

Threads: the handshake socket is used by one thread at a time (the caller of
``wait_for_ready`` at launch, then the thread running ``wait_for_joiners``: one scale
operation at a time). ``procs`` is guarded by a lock; a process's sentinel is closed
only once the monitor has dropped it from its wait list.

Faults (docs/architecture.md#faults):
- The warm launcher is no single point of failure (``launchers/mp.py``).
- An engine id never runs twice: the handshake answers a local engine id only from the
  pid this manager started for it; any other process (a stray fork of a cancelled warm
  spawn) is refused and exits.
- An engine started while the manager shuts down is stopped at once (``_start`` checks
  under the lock that ``shutdown`` takes its list under), so nothing outlives it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_sentinels

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.distributed.ports import IPC_DIR_PREFIX, get_open_port
from tidal.distributed.zmq_auth import CurveKeys, secure_server
from tidal.dp_coordinator.proc import CoordinatorAddresses
from tidal.executor.worker_proc import worker_process_name
from tidal.frontend.launchers.base import EngineHandle, Launcher, LaunchError
from tidal.frontend.launchers.mp import MPLauncher
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    EngineAddresses,
    EngineHello,
    EngineReady,
    encode,
    engine_id_of,
)
from tidal.protocol.topology import Topology
from tidal.utils.forkserver import ForkServer
from tidal.utils.procs import kill_if_named

logger = logging.getLogger(__name__)

# A started rank, whichever launcher started it.
EngineProcess = EngineHandle

STARTUP_TIMEOUT_S = 300.0


class EngineStartError(EngineDeadError):
    """A joining engine failed its startup (error, exit, timeout or stop); names it."""

    def __init__(self, engine_id: int, message: str) -> None:
        super().__init__(message)
        self.engine_id = engine_id


def ipc_dir() -> str:
    """A fresh private directory for this deployment's ``ipc://`` sockets: mkdtemp creates
    it with mode 0700, so only this user can reach them."""
    return tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)


class EngineProcManager:
    """Starts engine ranks through its launcher (``MPLauncher`` unless given one), runs
    the startup handshake with every rank (its own, or headless elsewhere), watches its
    own for death, stops them."""

    def __init__(
        self,
        config: EngineConfig,
        topology: Topology,
        ctx: zmq.Context,
        *,
        input_address: str,
        output_address: str,
        handshake_address: str,
        coordinator_addresses: tuple[str | None, str | None] = (None, None),
        entry_module: str | None = None,
        local_engines: list[int] | None = None,
        curve: CurveKeys | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.config = config
        self.launcher = (launcher or MPLauncher(config, entry_module)).with_config(config)
        self.topology = topology  # the engines to wait for, sent to each in the handshake
        self.procs: dict[int, EngineProcess] = {}
        self.num_blocks: dict[int, int] = {}
        # engine id -> its process (HELLO) and its workers' (READY, TP rank order): /stats.
        self.engine_pids: dict[int, int] = {}
        self.worker_pids: dict[int, list[int]] = {}
        self.engine_hosts: dict[int, str] = {}  # engine id -> host name (HELLO)
        self._shutting_down = False
        self._monitor: threading.Thread | None = None
        self._handshake_address = handshake_address
        # Guards procs, _expected, _reported, _generation; _changed wakes stop() once the
        # monitor has rebuilt its wait list (so a sentinel is never closed under it).
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0  # monitor wait-list rebuilds
        self._expected: set[int] = set()  # being stopped: their exit is no death
        # A launcher's start in flight (its handles not in procs yet), and those of them
        # that stop() cancelled: ``_start`` stops them as soon as the launcher returns.
        self._starting: set[int] = set()
        self._cancelled: set[int] = set()
        self._reported: set[int] = set()  # exit reported once; not watched any more
        # Joining engines (elastic EP): engine id -> the handshake answer they get.
        self._joiners: dict[int, EngineAddresses] = {}
        self._wake_r, self._wake_w = Pipe(duplex=False)
        # Held by the thread running wait_for_joiners: shutdown closes the handshake
        # socket only once that thread has let go of it.
        self._handshake_busy = threading.Lock()
        self._handshake = ctx.socket(zmq.ROUTER)
        try:
            secure_server(self._handshake, curve, handshake_address)
            self._handshake.bind(handshake_address)
        except BaseException:  # e.g. the RPC port is taken: fail, or ctx.term() would hang
            self._handshake.close(linger=0)
            self._wake_r.close()
            self._wake_w.close()
            raise
        self._addresses = EngineAddresses(
            input_address,
            output_address,
            coordinator_addresses[0],
            coordinator_addresses[1],
            config.config_hash(),
            topology,
        )
        local = topology.engine_ids if local_engines is None else local_engines
        # Local engines: the pid each was started as (the handshake answers only it).
        self._pids: dict[int, int | None] = {}
        self._hello: dict[int, bytes] = {}  # engine id -> handshake identity answered
        try:
            self._start(local)
        except BaseException:
            self.shutdown()  # the ranks started before the failure
            raise

    def _start(self, engine_ids: Iterable[int], *, warm: bool = False) -> None:
        """Start these ranks through the launcher (``warm``: a scale-up). Raises what the
        launcher raises (``LaunchError``), having started nothing; ``EngineStartError``
        when ``stop`` cancelled the start meanwhile (what it started is stopped here)."""
        ids = list(engine_ids)
        with self._lock:
            if self._shutting_down:
                raise EngineDeadError("the engine manager is shut down")
            self._starting.update(ids)
        try:
            handles = self.launcher.start(ids, self._handshake_address, warm=warm)
            with self._lock:
                stray = self._shutting_down  # shutdown took its list already: stop them here
                cancelled = sorted(self._cancelled.intersection(ids))
                if not stray and not cancelled:
                    for e, proc in handles.items():
                        self.procs[e] = proc
                        self._pids[e] = proc.pid
            if stray or cancelled:
                # Nobody else knows these processes: stopped here, or they would hold
                # their cores and devices (a Ray rank its actor and group) for good.
                _end_processes(handles, force=True, timeout_s=5.0)
                for e, proc in handles.items():
                    proc.close()
                    self.launcher.release(e)
                if cancelled:
                    e = cancelled[0]
                    raise EngineStartError(e, f"engine {e} was stopped during its startup")
                raise EngineDeadError(f"engines {ids} started while the deployment shut down")
        finally:
            with self._changed:  # a stop waiting for this start may return now
                self._starting.difference_update(ids)
                self._cancelled.difference_update(ids)
                self._changed.notify_all()
        self._wake()

    @property
    def zygote(self) -> ForkServer | None:
        """The mp launcher's warm launcher (elastic EP), if any."""
        return getattr(self.launcher, "zygote", None)

    @property
    def zygote_restarts(self) -> int:
        return getattr(self.launcher, "zygote_restarts", 0)

    def nodes(self) -> dict[int, str | None]:
        """Engine id -> the node it runs on: the launcher's (a Ray node id), else the host
        name its HELLO gave (a local or headless rank)."""
        with self._lock:
            ids = set(self.engine_pids) | set(self.procs)
            hosts = dict(self.engine_hosts)
        return {e: self.launcher.node_of(e) or hosts.get(e) for e in sorted(ids)}

    def kill(self, engine_id: int) -> None:
        """SIGKILL a local engine (frozen or stuck, docs/architecture.md#faults) without reaping it: its
        exit is then seen like any other. Remote engines: nothing to do here."""
        with self._lock:
            proc = self.procs.get(engine_id)
        if proc is not None and proc.is_alive():
            logger.error("engine %d (pid %d): killed", engine_id, proc.pid)
            proc.kill()

    def watched_ids(self) -> set[int]:
        """Local engines whose liveness matters: running, not being stopped."""
        with self._lock:
            return set(self.procs) - self._expected

    def set_topology(self, topology: Topology) -> None:
        """The committed topology (elastic EP): what later handshakes are answered with."""
        self.topology = topology
        self._addresses = msgspec.structs.replace(self._addresses, topology=topology)

    # ---- elastic EP: joining engines ---------------------------------------------------

    def spawn(self, engine_ids: Iterable[int], topology: Topology) -> None:
        """Start engine processes for fresh ids that join ``topology`` (a new epoch): their
        handshake answer carries it with ``joining=True``. Raises ``EngineStartError``
        naming the engine if one cannot start (then none was started)."""
        ids = list(engine_ids)
        if self._shutting_down:
            raise EngineDeadError("the engine manager is shut down")
        reply = msgspec.structs.replace(self._addresses, topology=topology, joining=True)
        with self._lock:
            used = [e for e in ids if e in self.procs]
            if used:
                raise ValueError(f"engine ids {used} already run")
            for e in ids:
                self._joiners[e] = reply
        try:
            self._start(ids, warm=True)
        except BaseException as err:
            with self._lock:
                for e in ids:  # never started: nothing will handshake as them
                    self._joiners.pop(e, None)
            if isinstance(err, EngineStartError):
                raise
            e = err.engine_id if isinstance(err, LaunchError) else ids[0]
            raise EngineStartError(e, f"engine {e} could not be started: {err}") from err

    def wait_for_joiners(
        self, engine_ids: Iterable[int], timeout_s: float = STARTUP_TIMEOUT_S
    ) -> None:
        """Blocking: run the startup handshake (HELLO -> addresses, READY) of the joining
        engines ``engine_ids``. Polls only the handshake socket, which only this thread
        uses meanwhile. Raises ``EngineStartError`` naming the engine on a READY error, a
        config mismatch, an exit, a stop or the timeout."""
        with self._handshake_busy:
            self._wait_for_joiners(set(engine_ids), timeout_s)

    def _wait_for_joiners(self, pending: set[int], timeout_s: float) -> None:
        if self._shutting_down and pending:
            raise EngineStartError(min(pending), "the deployment is shutting down")
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._handshake, zmq.POLLIN)
        while pending:
            if self._shutting_down:
                raise EngineStartError(min(pending), "the deployment is shutting down")
            for e in sorted(pending):
                with self._lock:
                    p = self.procs.get(e)
                    stopped = p is None or e in self._expected
                if stopped or p is None:
                    raise EngineStartError(e, f"engine {e} was stopped during its startup")
                code = p.exitcode
                if code is not None:
                    raise EngineStartError(
                        e, f"engine {e} exited with code {code} during its startup"
                    )
            if time.monotonic() > deadline:
                e = min(pending)
                raise EngineStartError(
                    e, f"engines {sorted(pending)} not ready within {timeout_s:.0f}s"
                )
            if poller.poll(100):
                ident, payload = self._handshake.recv_multipart()
                try:
                    self._on_handshake(ident, payload, pending, joining=True)
                except EngineStartError:
                    raise
                except EngineDeadError as err:
                    raise EngineStartError(min(pending), str(err)) from err

    # ---- elastic EP: stopping chosen engines -------------------------------------------

    def stop(
        self, engine_ids: Iterable[int], *, force: bool = False, timeout_s: float = 10.0
    ) -> dict[int, int | None]:
        """Blocking: stop these engines (SIGTERM: each drains, then exits; ``force``:
        SIGKILL), SIGKILL what is left at the deadline, reap, close and forget them.
        Their exits are expected (never reported to ``on_exit``). Ids not running here
        (already stopped, or remote) are skipped. Returns the exit codes.

        An engine still being started (a scale-up rolled back while the launcher places
        or starts it) is cancelled: the launcher is told to give up, and whatever it
        started is stopped as soon as it returns (``_start``); this waits for that up to
        ``timeout_s``, so its cores and devices are free when it returns."""
        ids = list(engine_ids)
        with self._lock:
            starting = [e for e in ids if e in self._starting]
            self._cancelled.update(starting)
            procs = {e: self.procs[e] for e in ids if e in self.procs}
            self._expected.update(procs)
        if starting:
            logger.warning("engines %s are stopped during their start: cancelled", starting)
            self.launcher.cancel(starting)
        _end_processes(procs, force=force, timeout_s=timeout_s)
        codes = {e: p.exitcode for e, p in procs.items()}
        self._forget(procs)
        if starting:
            with self._changed:
                done = self._changed.wait_for(
                    lambda: not self._starting.intersection(starting), timeout=timeout_s
                )
            if not done:
                logger.warning("engines %s: still starting; stopped once started", starting)
        return codes

    def _forget(self, procs: dict[int, EngineProcess]) -> None:
        """Drop stopped engines: out of the monitor's wait list first, then close."""
        with self._lock:
            workers = {e: self.worker_pids.pop(e, []) for e in procs}
            for e, p in procs.items():
                if self.procs.get(e) is p:
                    del self.procs[e]
                    self._pids.pop(e, None)
                self._joiners.pop(e, None)
                self._hello.pop(e, None)
                self._reported.discard(e)
                self.engine_pids.pop(e, None)
                self.engine_hosts.pop(e, None)
                self.launcher.release(e)  # reaped: its devices are free again
            gen = self._generation
            watching = self._monitor is not None and self._monitor.is_alive()
        for e, pids in workers.items():
            _kill_orphaned_workers(e, pids)
        monitor = self._monitor
        if watching and monitor is not None and monitor is not threading.current_thread():
            self._wake()
            with self._changed:
                self._changed.wait_for(
                    lambda: self._generation > gen or not monitor.is_alive(), timeout=5
                )
        for p in procs.values():
            p.close()

    def wait_for_ready(self, input_sock: zmq.Socket, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """HELLO -> addresses; input registration; READY. Raises on error, death or timeout."""
        deadline = time.monotonic() + timeout_s
        pending_ready = set(self.topology.engine_ids)
        pending_reg = set(self.topology.engine_ids)
        poller = zmq.Poller()
        poller.register(self._handshake, zmq.POLLIN)
        poller.register(input_sock, zmq.POLLIN)
        while pending_ready or pending_reg:
            self._check_alive("during startup")
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"engines {sorted(pending_ready | pending_reg)} not ready within {timeout_s:.0f}s"
                )
            for sock, _ in poller.poll(200):
                if sock is input_sock:
                    ident, _ = input_sock.recv_multipart()
                    pending_reg.discard(engine_id_of(ident))
                else:
                    ident, payload = self._handshake.recv_multipart()
                    self._on_handshake(ident, payload, pending_ready)

    def _on_handshake(
        self, ident: bytes, payload: bytes, pending: set[int], *, joining: bool = False
    ) -> None:
        """One handshake message. At launch (``joining`` False) READY must come from a
        member of the topology; for joiners (``joining``) from one of ``pending``, and an
        error names the engine (``EngineStartError``)."""
        try:
            hello = msgspec.msgpack.decode(payload, type=EngineHello)
        except msgspec.ValidationError:
            hello = None
        if hello is not None:
            # Answered even when the id is not in the topology: the engine then refuses to
            # start with a message naming the flags and reports it in READY(error), which
            # fails the startup here with the same message.
            e = hello.engine_id
            with self._lock:
                reply = self._joiners.get(e, self._addresses)
                self.engine_pids[e] = hello.pid
                if hello.host:
                    self.engine_hosts[e] = hello.host
                expected = self._pids.get(e)
                if expected is None or expected == hello.pid:
                    self._hello[e] = ident
                else:  # not the process started as this engine: it never runs twice
                    why = f"pid {hello.pid} is not engine {e}'s process (pid {expected})"
                    logger.warning("handshake refused: %s", why)
                    reply = msgspec.structs.replace(reply, refused=why)
            self._handshake.send_multipart([ident, encode(reply)])
            return
        try:
            ready = msgspec.msgpack.decode(payload, type=EngineReady)
        except msgspec.ValidationError:
            if joining:  # garbage on the socket (a stray peer): not a joiner's failure
                logger.warning("dropped an undecodable handshake message")
                return
            raise
        e = ready.engine_id
        with self._lock:
            answered = self._hello.get(e)
        if answered is not None and answered != ident:
            logger.warning("READY for engine %d from a process it was not answered: ignored", e)
            return
        error: str | None = None
        if ready.error:
            error = f"engine {e} failed to start: {ready.error}"
        elif joining and e not in pending:
            logger.warning("READY from engine %d, which is not starting now: ignored", e)
            return
        elif not joining and e not in self.topology:
            error = f"engine {e} is not in the deployment (engines {self.topology.engine_ids})"
        elif ready.parallel_config_hash != self._addresses.parallel_config_hash:
            error = (
                f"engine {e} has a different config "
                f"({ready.parallel_config_hash} != {self._addresses.parallel_config_hash})"
            )
        if error is not None:
            if joining and e in pending:
                raise EngineStartError(e, error)
            if joining:
                logger.warning("handshake of engine %d failed after the fact: %s", e, error)
                return
            raise EngineDeadError(error)
        self.num_blocks[e] = ready.num_blocks
        self.worker_pids[e] = list(ready.worker_pids)
        pending.discard(e)
        if joining:
            with self._lock:
                self._joiners.pop(e, None)  # its handshake is over

    def _check_alive(self, when: str) -> None:
        with self._lock:
            procs = list(self.procs.items())
        for idx, p in procs:
            if p.exitcode is not None:
                raise EngineDeadError(f"engine {idx} exited with code {p.exitcode} {when}")

    def start_monitor(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Call ``on_exit(engine_id, exitcode)`` once for each local engine process that
        exits without ``stop`` or ``shutdown`` asking it to, including engines spawned
        later. The caller decides what an exit means (the client: a rank death fails it,
        an engine of a scale operation is the scale driver's).

        ``on_exit`` runs on the monitor thread and should not keep its owner alive (pass
        a function over a weak reference): this thread lives as long as the manager."""
        if self._monitor is not None:
            return
        self._monitor = threading.Thread(
            target=self._watch, args=(on_exit,), name="engine-monitor", daemon=True
        )
        self._monitor.start()

    def _wake(self) -> None:
        """Make the monitor rebuild its wait list (an engine was added or dropped)."""
        if self._monitor is None:
            return  # it builds its list when it starts
        try:
            self._wake_w.send_bytes(b"w")
        except (OSError, ValueError):  # closed at shutdown
            pass

    def _watch(self, on_exit: Callable[[int, int | None], None]) -> None:
        while True:
            with self._lock:
                self._generation += 1
                self._changed.notify_all()
                if self._shutting_down:
                    return
                # An exited sentinel stays ready: watch each exit once (reported, or
                # expected: being stopped, its stop() reaps it).
                watched = {
                    p.sentinel: (e, p)
                    for e, p in self.procs.items()
                    if e not in self._reported and e not in self._expected
                }
            ready = wait_sentinels([self._wake_r, *watched])
            if self._wake_r in ready:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            exits: list[tuple[int, int | None]] = []
            with self._lock:
                if self._shutting_down:
                    continue  # notify, then return at the top
                for s in ready:
                    if s is self._wake_r:
                        continue
                    e, p = watched[typing.cast(int, s)]
                    if self.procs.get(e) is not p or e in self._expected or e in self._reported:
                        continue
                    self._reported.add(e)
                    self.launcher.release(e)  # dead: whoever starts next may use its devices
                    exits.append((e, p.exitcode))
            for e, code in exits:
                with self._lock:
                    pids = list(self.worker_pids.get(e, []))
                _kill_orphaned_workers(e, pids)
                try:
                    on_exit(e, code)
                except Exception:  # noqa: BLE001 - the monitor must keep watching
                    logger.exception("engine exit handler failed for engine %d", e)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every engine (each drains, then exits), SIGKILL what is left at the
        deadline, reap them all. Idempotent."""
        with self._lock:
            if self._shutting_down:
                return
            self._shutting_down = True
            procs = dict(self.procs)
        self.launcher.begin_close()
        self._wake()
        _end_processes(procs, force=False, timeout_s=timeout_s)
        with self._lock:
            workers = dict(self.worker_pids)
        for e, pids in workers.items():
            _kill_orphaned_workers(e, pids)
        # The monitor was woken and returns at the top of its loop: join it before its
        # sentinels are closed under it.
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(5)
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            p.close()
        self.launcher.close()  # after the ranks: they are stopped and reaped
        # A wait_for_joiners in progress sees _shutting_down within one poll (100 ms).
        released = self._handshake_busy.acquire(timeout=5)
        self._handshake.close(linger=0)
        if released:
            self._handshake_busy.release()
        self._wake_r.close()
        self._wake_w.close()


def _kill_orphaned_workers(engine_id: int, pids: list[int]) -> None:
    """An engine that exits stops its TP workers, and they leave on their own when it
    dies; one that cannot run (frozen: SIGSTOP, a VM pause) is killed here, so no worker
    outlives its rank (docs/architecture.md#faults)."""
    for pid in pids:
        if pid != os.getpid() and kill_if_named(pid, worker_process_name(engine_id, 0)[:-1]):
            logger.warning("engine %d's worker %d outlived it: killed", engine_id, pid)


def _end_processes(procs: dict[int, EngineProcess], *, force: bool, timeout_s: float) -> None:
    """SIGTERM (each engine drains, then exits) or, ``force``, SIGKILL every engine, wait
    until the deadline, SIGKILL what is left and reap it."""
    for p in procs.values():
        if p.is_alive():
            if force:
                p.kill()
            else:
                p.terminate()
    deadline = time.monotonic() + timeout_s
    for e, p in procs.items():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("engine %d did not exit within %.0fs: killed", e, timeout_s)
            p.kill()
            p.join(5)


@dataclass(frozen=True)
class FrontendAddresses:
    input: str
    output: str
    handshake: str
    coordinator: CoordinatorAddresses | None = None  # when data parallel


def frontend_addresses(config: EngineConfig, ipc_dir: str) -> FrontendAddresses:
    """IPC in a private directory when every rank is local; TCP on the DP address when
    some ranks run elsewhere (``--headless``): they find us at the RPC port."""
    par = config.parallel
    dp = par.is_data_parallel
    if par.data_parallel_size_local >= par.data_parallel_size:
        coord = CoordinatorAddresses.ipc(ipc_dir) if dp else None
        return FrontendAddresses(
            f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output", f"ipc://{ipc_dir}/handshake", coord
        )
    host = par.data_parallel_address
    rpc = par.data_parallel_rpc_port or get_open_port(host)
    ports = tuple(get_open_port(host) for _ in range(4))
    # Input and output: a port the bind itself picks (``*``; the frontend reads back the
    # bound one, ``bound_endpoint``), as engines learn them in the handshake. A port
    # picked ahead could be taken by another process before the bind.
    return FrontendAddresses(
        f"tcp://{host}:*", f"tcp://{host}:*", f"tcp://{host}:{rpc}",
        CoordinatorAddresses.tcp(host, ports),
    )  # fmt: skip


def bound_endpoint(sock: zmq.Socket, address: str) -> str:
    """The address ``sock`` was bound at: ``address`` itself, or with the port the bind
    chose for a ``tcp://host:*`` one."""
    if not address.endswith(":*"):
        return address
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
