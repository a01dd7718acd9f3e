"""The coordinator process seen from outside: ``DPCoordinator`` starts it (a fresh
interpreter running ``tidal.dp_coordinator.entry``), owns its lifetime and stops it;
``fetch_stats`` / ``fetch_stats_async`` ask its ``stats`` socket for the full state
(``/stats``, the dashboard, tests). The process itself is ``proc.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from multiprocessing.connection import Connection

import msgspec
import zmq
import zmq.asyncio

from tidal.distributed.zmq_auth import CurveKeys, secure_client
from tidal.dp_coordinator.proc import CoordinatorAddresses, CoordinatorLaunch, unlink_ipc
from tidal.protocol.messages import STATS_DECODER, DPCoordinatorStats, DPStatsRequest, encode
from tidal.protocol.topology import Topology
from tidal.utils.procs import ModuleProcess

logger = logging.getLogger(__name__)

COORDINATOR_ENTRY_MODULE = "tidal.dp_coordinator.entry"


def fetch_stats(
    address: str,
    timeout_s: float = 2.0,
    ctx: zmq.Context | None = None,
    curve: CurveKeys | None = None,
) -> DPCoordinatorStats:
    """Ask the coordinator's ``stats`` socket for the full stats (blocking, bounded)."""
    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, curve, address)
        sock.connect(address)
        sock.send(encode(DPStatsRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"DP coordinator at {address} did not answer in {timeout_s}s")
        return STATS_DECODER.decode(sock.recv())
    finally:
        sock.close()


async def fetch_stats_async(
    address: str, timeout_s: float = 2.0, curve: CurveKeys | None = None
) -> DPCoordinatorStats:
    """``fetch_stats`` for an asyncio frontend."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, curve, address)
        sock.connect(address)
        await sock.send(encode(DPStatsRequest()))
        if not await sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"DP coordinator at {address} did not answer in {timeout_s}s")
        return STATS_DECODER.decode(await sock.recv())
    finally:
        sock.close()


class DPCoordinator:
    """Starts the coordinator process and owns its lifetime.

    ``topology``: the engines it starts with (an int: the launch topology of that size).
    ``addresses=None`` puts ipc sockets in a fresh private temp dir (removed on shutdown).
    ``addresses`` holds the bound addresses once the constructor returns."""

    def __init__(
        self,
        topology: Topology | int,
        addresses: CoordinatorAddresses | None = None,
        *,
        publish_interval_s: float = 0.1,
        heartbeat_interval_s: float = 3.0,
        history_len: int = 600,
        start_timeout_s: float = 30.0,
        auth_key: str | None = None,
    ) -> None:
        tmpdir = None
        if addresses is None:
            tmpdir = tempfile.mkdtemp(prefix="tidal-dpc-")  # mode 0700
            addresses = CoordinatorAddresses.ipc(tmpdir)
        if isinstance(topology, int):
            topology = Topology.initial(topology)
        self._tmpdir = tmpdir
        self._settings = (publish_interval_s, heartbeat_interval_s, history_len, auth_key)
        self._start_timeout_s = start_timeout_s
        self.restarts = 0
        # ``restart`` runs on a worker thread: it and ``shutdown`` exclude each other, and
        # a restart after a shutdown starts nothing (no process nobody would stop).
        self._lock = threading.RLock()
        self._closing = False
        self._start(addresses, topology, 0)

    def _start(self, addresses: CoordinatorAddresses, topology: Topology, wave: int) -> None:
        # A fresh interpreter running the entry module, not multiprocessing's spawn (which
        # would re-run the caller's __main__); it answers on a pipe it inherits.
        publish_interval_s, heartbeat_interval_s, history_len, auth_key = self._settings
        ready_r, ready_w = os.pipe()
        launch = CoordinatorLaunch(
            addresses,
            topology,
            publish_interval_s,
            heartbeat_interval_s,
            history_len,
            os.getpid(),
            ready_w,
            auth_key,
            wave,
        )
        recv_conn = Connection(ready_r, writable=False)
        try:
            self.proc = ModuleProcess(
                COORDINATOR_ENTRY_MODULE,
                "DPCoordinator",
                msgspec.msgpack.encode(launch),
                pass_fds=[ready_w],
            )
        except BaseException:
            recv_conn.close()
            raise
        finally:
            os.close(ready_w)
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, addresses, self._tmpdir, 5.0)
        try:
            self.addresses = _await_ready(recv_conn, self._start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        finally:
            recv_conn.close()

    def is_alive(self) -> bool:
        return self._finalizer.alive and self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the process (it froze: docs/architecture.md#faults); ``restart`` reaps it."""
        with self._lock:
            if self._finalizer.alive:
                self.proc.kill()

    def restart(self, topology: Topology, wave: int) -> None:
        """The process died (docs/architecture.md#faults): start a new one on the *same* addresses (the
        bound ones: engines and frontends reconnect by themselves), serving ``topology``
        from ``wave``, paused. Its load table fills from the engines' next stats.
        Blocking (a new interpreter): call it off the event loop."""
        with self._lock:
            if self._closing or not self._finalizer.alive:
                raise RuntimeError("the DP coordinator was shut down")
            self._finalizer.detach()
            _cleanup(self.proc, self.addresses, None, 5.0)  # reap it; keep the ipc dir
            try:
                self._start(self.addresses, topology, wave)
            except BaseException:
                if self._tmpdir is not None:  # _start's shutdown found no finalizer
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                raise
            # Counted once the new process answers: whoever reads the count (another
            # thread) then finds it alive, never the reaped one still in ``proc``.
            self.restarts += 1

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, join (kill after ``timeout_s``), unlink ipc files. Idempotent; waits
        for a restart in progress, whose new process it then stops."""
        with self._lock:
            self._closing = True
            detached = self._finalizer.detach()  # None once it ran or was detached
            if detached is not None:
                proc, addresses, tmpdir, _ = detached[2]
                _cleanup(proc, addresses, tmpdir, timeout_s)

    def __enter__(self) -> DPCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _await_ready(conn: Connection, timeout_s: float) -> CoordinatorAddresses:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"DP coordinator did not start within {timeout_s}s")
    try:
        reply = msgspec.msgpack.decode(conn.recv_bytes())
    except EOFError:
        raise RuntimeError("DP coordinator process exited during startup") from None
    if "error" in reply:
        raise RuntimeError(f"DP coordinator failed to start: {reply['error']}")
    return CoordinatorAddresses(*reply["addresses"])


def _cleanup(
    proc: ModuleProcess,
    addresses: CoordinatorAddresses,
    tmpdir: str | None,
    timeout_s: float,
) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        logger.warning("DP coordinator ignored SIGTERM for %.1fs; killing it", timeout_s)
        proc.kill()
        proc.join(timeout_s)
    proc.close()
    unlink_ipc(addresses)  # a killed process leaves its ipc files behind
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
