"""Engine processes seen from the frontend: where they connect (``frontend_addresses``),
starting the local ones, the startup handshake with every rank (local or headless
elsewhere), watching for death, stopping them (``EngineProcManager``), and starting a
headless host's ranks (``spawn_headless_engines``).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.distributed.ports import IPC_DIR_PREFIX, get_open_port
from tidal.distributed.zmq_auth import CurveKeys, secure_server
from tidal.dp_coordinator.proc import CoordinatorAddresses
from tidal.engine_core.entry import ENGINE_ENTRY_MODULE, start_engine_process
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    EngineAddresses,
    EngineHello,
    EngineReady,
    encode,
    engine_id_of,
)
from tidal.protocol.topology import Topology
from tidal.utils.procs import ModuleProcess

STARTUP_TIMEOUT_S = 300.0


def ipc_dir() -> str:
    """A fresh private directory for this deployment's ``ipc://`` sockets: mkdtemp creates
    it with mode 0700, so only this user can reach them."""
    return tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)


class EngineProcManager:
    """Starts the local engine processes, runs the startup handshake with every rank
    (local or headless elsewhere), watches local ones for death, stops them.

    Engines run ``python -m <entry_module>`` (``tidal.engine_core.entry``), never
    multiprocessing's spawn: that would re-run the caller's ``__main__`` in each of them."""

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
    ) -> None:
        self.config = config
        self.topology = topology  # the engines to wait for, sent to each in the handshake
        self.procs: dict[int, ModuleProcess] = {}
        self.num_blocks: dict[int, int] = {}
        self._shutting_down = False
        self._monitor: threading.Thread | None = None
        self._handshake = ctx.socket(zmq.ROUTER)
        try:
            secure_server(self._handshake, curve, handshake_address)
            self._handshake.bind(handshake_address)
        except BaseException:  # e.g. the RPC port is taken: fail, or ctx.term() would hang
            self._handshake.close(linger=0)
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
        try:
            self._start(local, handshake_address, entry_module or ENGINE_ENTRY_MODULE)
        except BaseException:
            self.shutdown()  # the ranks started before the failure
            raise

    def _start(self, engine_ids: list[int], handshake_address: str, entry_module: str) -> None:
        for e in engine_ids:
            # At launch an engine's id is its launch rank (ids 0..N-1 in rank order).
            cfg = self.config.with_parallel(data_parallel_rank=e)
            self.procs[e] = start_engine_process(cfg, e, handshake_address, entry_module)

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
                    self._on_handshake(*self._handshake.recv_multipart(), pending_ready)

    def _on_handshake(self, ident: bytes, payload: bytes, pending: set[int]) -> None:
        try:
            hello = msgspec.msgpack.decode(payload, type=EngineHello)
        except msgspec.ValidationError:
            hello = None
        if hello is not None:
            # Answered even when the id is not in the topology: the engine then refuses to
            # start with a message naming the flags and reports it in READY(error), which
            # fails the startup here with the same message.
            self._handshake.send_multipart([ident, encode(self._addresses)])
            return
        ready = msgspec.msgpack.decode(payload, type=EngineReady)
        if ready.error:
            raise EngineDeadError(f"engine {ready.engine_index} failed to start: {ready.error}")
        if ready.engine_index not in self.topology:
            raise EngineDeadError(
                f"engine {ready.engine_index} is not in the deployment (engines "
                f"{self.topology.engine_ids})"
            )
        if ready.parallel_config_hash != self._addresses.parallel_config_hash:
            raise EngineDeadError(
                f"engine {ready.engine_index} has a different config "
                f"({ready.parallel_config_hash} != {self._addresses.parallel_config_hash})"
            )
        self.num_blocks[ready.engine_index] = ready.num_blocks
        pending.discard(ready.engine_index)

    def _check_alive(self, when: str) -> None:
        for idx, p in self.procs.items():
            if p.exitcode is not None:
                raise EngineDeadError(f"engine {idx} exited with code {p.exitcode} {when}")

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` once if any engine process exits unexpectedly.

        ``on_death`` should not keep its owner alive (pass a function over a weak
        reference): this thread lives as long as the engines do."""
        if not self.procs:
            return
        self._monitor = threading.Thread(
            target=self._watch, args=(on_death,), name="engine-monitor", daemon=True
        )
        self._monitor.start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        sentinels = {p.sentinel: idx for idx, p in self.procs.items()}
        died = wait_sentinels(list(sentinels))
        if self._shutting_down:
            return
        idx = sentinels[died[0]]
        on_death(f"engine {idx} exited unexpectedly (exit code {self.procs[idx].exitcode})")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every engine (each drains, then exits), SIGKILL what is left at the
        deadline, reap them all. Idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)
        # Every engine has exited, so the monitor's wait has returned (or is about to):
        # join it before its sentinels are closed under it.
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(2)
        for p in self.procs.values():
            p.close()
        self._handshake.close(linger=0)


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
    return FrontendAddresses(
        f"tcp://{host}:{get_open_port(host)}",
        f"tcp://{host}:{get_open_port(host)}",
        f"tcp://{host}:{rpc}",
        CoordinatorAddresses.tcp(host, ports),
    )


def spawn_headless_engines(config: EngineConfig, handshake_address: str) -> list[ModuleProcess]:
    """``launch --headless``: start this host's ranks; they handshake with the frontend
    at ``handshake_address`` (tcp) and get every other address from it."""
    par = config.parallel
    first = par.data_parallel_start_rank
    procs: list[ModuleProcess] = []
    try:
        for idx in range(first, first + par.data_parallel_size_local):
            cfg = config.with_parallel(data_parallel_rank=idx)
            procs.append(start_engine_process(cfg, idx, handshake_address))
    except BaseException:
        for p in procs:  # the ranks started before the failure
            p.kill()
            p.join()
            p.close()
        raise
    return procs
