"""Engine clients used by frontends, behind one interface.

- ``InprocClient``: the EngineCore lives in the caller's process (tests, debugging).
- ``SyncMPClient``: engines in background processes; blocking API for the offline ``LLM``.
- ``AsyncMPClient``: the same for asyncio frontends (the API server).
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tidal.config import EngineConfig
from tidal.engine_core.entry import ENGINE_ENTRY_MODULE, start_engine_process
from tidal.engine_core.messages import (
    EngineAddresses,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHello,
    EngineReady,
    UtilityRequest,
    encode,
)
from tidal.engine_core.proc import engine_identity
from tidal.utils.procs import ModuleProcess
from tidal.utils.zmq_auth import (
    CurveKeys,
    curve_keys,
    secure_client,
    secure_server,
    start_authenticator,
)


class EngineCoreClient(ABC):
    """What the offline ``LLM`` needs from an engine, however it is hosted."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until some are available or the engine dies)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """Steps the engine core in the calling thread: get_output() is one step."""

    def __init__(self, config: EngineConfig) -> None:
        from tidal.engine_core.core import EngineCore

        self.engine = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine.step()
        merged = EngineCoreOutputs(outputs=[])
        for o in outputs.values():
            merged.outputs.extend(o.outputs)
            merged.scheduler_stats = o.scheduler_stats
        return merged

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def shutdown(self) -> None:
        self.engine.shutdown()


# ---- multiprocess clients ----------------------------------------------------------------

STARTUP_TIMEOUT_S = 300.0
_OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine process died or reported a fatal error; pending requests cannot finish."""


def _ipc_dir() -> str:
    # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
    return tempfile.mkdtemp(prefix="tidal-")


class EngineProcManager:
    """Starts the local engine processes, runs the startup handshake with every rank
    (local or headless elsewhere), watches local ones for death, stops them.

    Engines run ``python -m <entry_module>`` (``tidal.engine_core.entry``), never
    multiprocessing's spawn: that would re-run the caller's ``__main__`` in each of them."""

    def __init__(
        self,
        config: EngineConfig,
        engine_indices: list[int],
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
        self.engine_indices = engine_indices
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
            config.parallel.data_parallel_master_port,
        )
        local = engine_indices if local_engines is None else local_engines
        try:
            self._start(local, handshake_address, entry_module or ENGINE_ENTRY_MODULE)
        except BaseException:
            self.shutdown()  # the ranks started before the failure
            raise

    def _start(self, indices: list[int], handshake_address: str, entry_module: str) -> None:
        for idx in indices:
            cfg = self.config.with_parallel(data_parallel_rank=idx)
            self.procs[idx] = start_engine_process(cfg, idx, handshake_address, entry_module)

    def wait_for_ready(self, input_sock: zmq.Socket, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """HELLO -> addresses; input registration; READY. Raises on error, death or timeout."""
        deadline = time.monotonic() + timeout_s
        pending_ready = set(self.engine_indices)
        pending_reg = set(self.engine_indices)
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
                    pending_reg.discard(int.from_bytes(ident, "little"))
                else:
                    self._on_handshake(*self._handshake.recv_multipart(), pending_ready)

    def _on_handshake(self, ident: bytes, payload: bytes, pending: set[int]) -> None:
        try:
            hello = msgspec.msgpack.decode(payload, type=EngineHello)
        except msgspec.ValidationError:
            hello = None
        if hello is not None:
            if hello.engine_index not in self.engine_indices:
                raise EngineDeadError(f"unexpected engine index {hello.engine_index}")
            self._handshake.send_multipart([ident, encode(self._addresses)])
            return
        ready = msgspec.msgpack.decode(payload, type=EngineReady)
        if ready.error:
            raise EngineDeadError(f"engine {ready.engine_index} failed to start: {ready.error}")
        if ready.parallel_config_hash != self._addresses.parallel_config_hash:
            raise EngineDeadError(
                f"engine {ready.engine_index} has a different parallel config "
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


def _encode(request: EngineCoreRequest) -> bytes:
    try:
        return encode(request)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        # A value the wire cannot carry (e.g. an int beyond 64 bits): the caller's error.
        raise ValueError(f"request {request.request_id!r} cannot be sent to the engine: {e}") from e


class DPFrontendState:
    """Frontend half of data parallelism (pure apart from the clock): which engine gets a
    request, the wave to stamp on it, and which engine holds which request. "rank" below
    is an engine id (the ZMQ identity; equal to the DP rank until a reconfiguration)."""

    def __init__(self, num_engines: int, parallel: Any) -> None:
        from tidal.dp_coordinator.balance import Balancer
        from tidal.dp_coordinator.state import FrontendWaveState

        self.balancer = Balancer(num_engines, parallel.dp_lb_policy)
        self.wave = FrontendWaveState()
        self.rank_of: dict[str, int] = {}

    def route(self, request: EngineCoreRequest) -> tuple[int, Any]:
        """Choose the rank, stamp the wave and record the request as sent there (before it
        is sent: its outputs may come back before the sender's next line runs). Returns
        the rank and the wake-up to send *after* the request, or None."""
        rank = self.balancer.choose(request.data_parallel_rank)
        wave, wake = self.wave.on_send(rank)
        request.current_wave = wave
        self.balancer.on_send(rank, time.monotonic())
        self.rank_of[request.request_id] = rank
        return rank, wake

    def unroute(self, request_id: str, rank: int, wake: Any) -> None:
        """Undo ``route`` for a request that was never sent: it is no longer in flight
        (to the balancer, a send and a finish that cancel out), and if its wake-up was
        not sent either, the next request must send one."""
        if self.rank_of.get(request_id) == rank:
            self._finished(request_id)
        if wake is not None:
            self.wave.running = False

    def on_outputs(self, outs: EngineCoreOutputs) -> None:
        for out in outs.outputs:
            if out.finished:
                self._finished(out.request_id)

    def on_abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._finished(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        return by_rank

    def _finished(self, request_id: str) -> int | None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.balancer.on_finish(rank)
        return rank

    def on_snapshot(self, snap: Any) -> None:
        self.balancer.on_snapshot(snap, time.monotonic())
        self.wave.on_snapshot(snap)

    def set_topology(self, topology: Any) -> None:
        """A reconfiguration (``tidal.protocol.topology.Topology``): route by it from now
        on and drop snapshots of older epochs. Requests on removed engines stay recorded
        until they finish or are aborted (migration re-routes them)."""
        self.balancer.set_topology(topology)
        self.wave.set_topology(topology)


@dataclass(frozen=True)
class FrontendAddresses:
    input: str
    output: str
    handshake: str
    coordinator: Any = None  # CoordinatorAddresses when data parallel


def _frontend_addresses(config: EngineConfig, ipc_dir: str) -> FrontendAddresses:
    """IPC in a private directory when every rank is local; TCP on the DP address when
    some ranks run elsewhere (``--headless``): they find us at the RPC port."""
    from tidal.dp_coordinator.proc import CoordinatorAddresses
    from tidal.elastic.groups import get_open_port

    par = config.parallel
    dp = par.data_parallel_size > 1
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


class MPClient(EngineCoreClient):
    """Shared part of the sync and async multiprocess clients: sockets, processes, routing.

    With data parallelism it also starts the DP coordinator, balances requests across
    ranks from the coordinator's published load, and runs the frontend's half of the wave
    protocol (stamp each request with the wave; wake the ranks when they are paused)."""

    def __init__(
        self, config: EngineConfig, *, asyncio_mode: bool, entry_module: str | None = None
    ) -> None:
        par = config.parallel
        if par.data_parallel_size > 1 and not par.data_parallel_master_port:
            from tidal.elastic.groups import get_open_port

            config = config.with_parallel(
                data_parallel_master_port=get_open_port(par.data_parallel_address)
            )
        self.config = config
        self.ipc_dir = _ipc_dir()
        self.ctx: zmq.Context = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.engine_indices = list(range(config.parallel.data_parallel_size))
        self.dead_reason: str | None = None
        self._call_ids = iter(range(1, 1 << 62))
        self._closed = False
        self.coordinator = None
        self.dp = None
        self.addresses = _frontend_addresses(config, self.ipc_dir)
        # Over TCP (ranks on other hosts) every control-plane socket is a CURVE peer and a
        # ZAP handler admits only holders of the shared secret (tidal/utils/zmq_auth.py).
        tcp = self.addresses.input.startswith("tcp://")
        self._curve = curve_keys(par.data_parallel_auth_key) if tcp else None
        # Sockets used during startup are synchronous even in asyncio mode.
        sync_ctx = zmq.Context.shadow(self.ctx.underlying) if asyncio_mode else self.ctx
        self._authenticator = start_authenticator(sync_ctx, self._curve)
        self.output_address = self.addresses.output
        try:
            self.input_socket = sync_ctx.socket(zmq.ROUTER)
            self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            secure_server(self.input_socket, self._curve, self.addresses.input)
            self.input_socket.bind(self.addresses.input)
            coord_addrs = self._start_coordinator(sync_ctx)
            self.manager = EngineProcManager(
                config,
                self.engine_indices,
                sync_ctx,
                input_address=self.addresses.input,
                output_address=self.output_address,
                handshake_address=self.addresses.handshake,
                coordinator_addresses=coord_addrs,
                entry_module=entry_module,
                local_engines=list(
                    range(min(par.data_parallel_size_local, par.data_parallel_size))
                ),
                curve=self._curve,
            )
            self._output_socket = self._bind_output(sync_ctx)
            self.manager.wait_for_ready(self.input_socket)
        except BaseException:
            self._close_resources()
            raise
        # Released at shutdown(), when the client is garbage-collected, or at interpreter
        # exit, whichever comes first: a script that never calls shutdown() still exits.
        self._resources = _MPResources.of(self)
        self._finalizer = weakref.finalize(self, self._resources.close)
        self.manager.start_monitor(_weak_callback(self._on_engine_death))

    def _bind_output(self, sync_ctx: zmq.Context) -> zmq.Socket:
        sock = sync_ctx.socket(zmq.PULL)
        secure_server(sock, self._curve, self.output_address)
        sock.bind(self.output_address)
        return sock

    def _start_coordinator(self, sync_ctx: zmq.Context) -> tuple[str | None, str | None]:
        if len(self.engine_indices) == 1:
            return (None, None)
        from tidal.dp_coordinator.proc import DPCoordinator

        self.coordinator = DPCoordinator(
            len(self.engine_indices),
            self.addresses.coordinator,
            auth_key=self.config.parallel.data_parallel_auth_key if self._curve else None,
        )
        addrs = self.coordinator.addresses
        self.dp = DPFrontendState(len(self.engine_indices), self.config.parallel)
        # Two sockets: one subscribed (snapshots, read by the reader), one never subscribed
        # (wake-ups, sent by the caller's thread): zmq sockets are not thread-safe.
        self._snapshot_socket = sync_ctx.socket(zmq.XSUB)
        secure_client(self._snapshot_socket, self._curve, addrs.frontend_publish)
        self._snapshot_socket.connect(addrs.frontend_publish)
        self._snapshot_socket.send(b"\x01")
        self._wakeup_socket = sync_ctx.socket(zmq.XSUB)
        secure_client(self._wakeup_socket, self._curve, addrs.frontend_publish)
        self._wakeup_socket.connect(addrs.frontend_publish)
        return (addrs.engine_publish, addrs.engine_input)

    # ---- sending -----------------------------------------------------------------------

    def _send(self, engine: int, req_type: EngineCoreRequestType, payload: Any) -> None:
        self._send_frame(engine, req_type, encode(payload))

    def _send_frame(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.input_socket.send_multipart([engine_identity(engine), req_type.value, payload])

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send an ADD. A request that cannot be encoded raises ``ValueError`` and leaves
        no trace (no rank holds it, no wake-up went out)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.dp is None:
            self._send_frame(self.engine_indices[0], EngineCoreRequestType.ADD, _encode(request))
            return
        rank, wake = self.dp.route(request)  # stamps the wave, so encode after it
        try:
            self._send_frame(rank, EngineCoreRequestType.ADD, _encode(request))
        except BaseException:
            self.dp.unroute(request.request_id, rank, wake)
            raise
        if wake is not None:
            # Only now that the ADD is out: the ranks this wakes wait in a collective for
            # the one holding the request, so it must be certain to get it.
            self._wakeup_socket.send(encode(wake))

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_reason is not None:
            return
        if self.dp is None:
            self._send(self.engine_indices[0], EngineCoreRequestType.ABORT, request_ids)
            return
        for rank, ids in self.dp.on_abort(request_ids).items():
            self._send(rank, EngineCoreRequestType.ABORT, ids)

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        if self.dp is not None:
            self.dp.on_outputs(outs)

    def _on_snapshot(self, frame: bytes) -> None:
        from tidal.dp_coordinator.proc import SNAPSHOT_DECODER

        self.dp.on_snapshot(SNAPSHOT_DECODER.decode(frame))

    def _utility_request(self, method: str, args: tuple) -> UtilityRequest:
        return UtilityRequest(0, next(self._call_ids), method, list(args))

    def _on_engine_death(self, reason: str) -> None:
        raise NotImplementedError

    # ---- shutdown ----------------------------------------------------------------------

    def _close_resources(self) -> None:
        """Release everything now (a failed start, or shutdown). Idempotent."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif not self._closed:
            _MPResources.of(self).close()
        self._closed = True


# Every socket attribute an MP client may own; all are closed before the context is.
_CLIENT_SOCKETS = ("input_socket", "_output_socket", "_snapshot_socket", "_wakeup_socket")


class _MPResources:
    """What an MP client must release, held apart from the client: the client's
    ``weakref.finalize`` closes it, so it must not refer back to the client (or the client
    could never be collected and a script that drops it would keep its engines)."""

    def __init__(
        self,
        ctx: zmq.Context,
        ipc_dir: str,
        manager: EngineProcManager | None,
        coordinator: Any,
        sockets: list[zmq.Socket],
        authenticator: Any = None,
    ) -> None:
        self.ctx = ctx
        self.ipc_dir = ipc_dir
        self.manager = manager
        self.coordinator = coordinator
        self.sockets = sockets
        self.authenticator = authenticator  # ZAP thread: stopped before the context ends
        # Threads that use the sockets: told to stop (stop) and joined before the sockets
        # are closed, since a zmq socket must not be closed under a thread polling it.
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def of(cls, client: MPClient) -> _MPResources:
        sockets = [getattr(client, n) for n in _CLIENT_SOCKETS if hasattr(client, n)]
        return cls(
            client.ctx,
            client.ipc_dir,
            getattr(client, "manager", None),
            client.coordinator,
            sockets,
            getattr(client, "_authenticator", None),
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.stop.set()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(5)
        if self.manager is not None:
            self.manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _weak_callback(method: Callable[[str], None]) -> Callable[[str], None]:
    """``method`` without a strong reference to its object (for long-lived threads)."""
    ref = weakref.WeakMethod(method)

    def call(reason: str) -> None:
        bound = ref()
        if bound is not None:
            bound(reason)

    return call


class SyncMPClient(MPClient):
    """Blocking client for the offline ``LLM``: a reader thread feeds a queue."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._pending_calls: dict[int, Future] = {}
        super().__init__(config, asyncio_mode=False, entry_module=entry_module)
        # The reader holds only a weak reference to the client (see _MPResources).
        self._reader = threading.Thread(
            target=_read_outputs,
            args=(
                weakref.ref(self),
                self._output_socket,
                getattr(self, "_snapshot_socket", None),
                self._resources.stop,
            ),
            name="client-output",
            daemon=True,
        )
        self._resources.threads.append(self._reader)
        self._reader.start()

    def _dispatch(self, outs: EngineCoreOutputs) -> None:
        if outs.utility_output is not None:
            fut = self._pending_calls.pop(outs.utility_output.call_id, None)
            if fut is not None:
                fut.set_result(outs.utility_output)
            return
        if outs.engine_dead:
            self._on_engine_death(outs.dead_reason or "engine reported a fatal error")
            return
        self._on_outputs(outs)
        self.outputs.put_nowait(outs)

    def _on_engine_death(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self.outputs.put_nowait(EngineCoreOutputs(engine_dead=True, dead_reason=reason))
        for fut in list(self._pending_calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    def get_output(self) -> EngineCoreOutputs:
        outs = self.outputs.get()
        if outs.engine_dead:
            self.outputs.put_nowait(outs)  # keep failing later callers too
            raise EngineDeadError(outs.dead_reason or "engine died")
        return outs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.call_utility_on(self.engine_indices[0], method, *args)

    def call_utility_on(self, engine: int, method: str, *args: Any, timeout_s: float = 60) -> Any:
        call = self._utility_request(method, args)
        fut: Future = Future()
        self._pending_calls[call.call_id] = fut
        self._send(engine, EngineCoreRequestType.UTILITY, call)
        out = fut.result(timeout_s)
        if out.failure_message:
            raise RuntimeError(out.failure_message)
        return out.result

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank (e.g. ``pause`` / ``resume``)."""
        return [self.call_utility_on(e, method, *args) for e in self.engine_indices]

    def shutdown(self) -> None:
        """Stop the engines and release everything. Idempotent; also runs when the client
        is garbage-collected or at interpreter exit."""
        self._close_resources()


def _read_outputs(
    client_ref: weakref.ref[SyncMPClient],
    sock: zmq.Socket,
    snap: zmq.Socket | None,
    stop: threading.Event,
) -> None:
    """SyncMPClient's reader thread: frames from the engines (and DP snapshots) to the
    client, for as long as the client exists and has not been shut down."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if snap is not None:
        poller.register(snap, zmq.POLLIN)
    while not stop.is_set():
        for ready, _ in poller.poll(100):
            if stop.is_set() or not _deliver(client_ref, ready is sock, ready.recv()):
                return


def _deliver(client_ref: weakref.ref[SyncMPClient], is_output: bool, frame: bytes) -> bool:
    """Hand one frame to the client; False once it is gone. A function of its own so the
    strong reference it takes ends with the call, not with the reader thread."""
    client = client_ref()
    if client is None:
        return False
    if is_output:
        client._dispatch(_OUTPUT_DECODER.decode(frame))
    else:
        client._on_snapshot(frame)
    return True


class AsyncMPClient(MPClient):
    """asyncio client for the API server. Outputs arrive on an asyncio queue."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        super().__init__(config, asyncio_mode=True, entry_module=entry_module)

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._async_out = zmq.asyncio.Socket.from_socket(self._output_socket)
            self._reader_task = self._loop.create_task(self._read_outputs())
            if self.dp is not None:
                self._async_snap = zmq.asyncio.Socket.from_socket(self._snapshot_socket)
                self._snapshot_task = self._loop.create_task(self._read_snapshots())

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._async_out.recv()
            outs = _OUTPUT_DECODER.decode(frame)
            if outs.utility_output is not None:
                fut = self._pending_calls.pop(outs.utility_output.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(outs.utility_output)
            elif outs.engine_dead:
                self._fail(outs.dead_reason or "engine reported a fatal error")
            else:
                self._on_outputs(outs)
                self._queue.put_nowait(outs)

    async def _read_snapshots(self) -> None:
        while True:
            self._on_snapshot(await self._async_snap.recv())

    async def get_dp_stats_async(self, timeout_s: float = 2.0) -> Any:
        """The coordinator's full stats (DP only)."""
        from tidal.dp_coordinator.proc import fetch_stats_async

        return await fetch_stats_async(self.coordinator.addresses.stats, timeout_s, self._curve)

    def _on_engine_death(self, reason: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail, reason)
        elif self.dead_reason is None:
            self.dead_reason = reason

    def _fail(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        if self._queue is not None:
            self._queue.put_nowait(EngineCoreOutputs(engine_dead=True, dead_reason=reason))
        for fut in list(self._pending_calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        if self.dead_reason is not None and self._queue.empty():
            raise EngineDeadError(self.dead_reason)
        outs = await self._queue.get()
        if outs.engine_dead:
            raise EngineDeadError(outs.dead_reason or "engine died")
        return outs

    def get_output(self) -> EngineCoreOutputs:
        raise RuntimeError("AsyncMPClient: use get_output_async()")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise RuntimeError("AsyncMPClient: use call_utility_async()")

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        calls = [self.call_utility_async(method, *args, engine=e) for e in self.engine_indices]
        return list(await asyncio.gather(*calls))

    async def call_utility_async(self, method: str, *args: Any, engine: int | None = None) -> Any:
        self._ensure_reader()
        call = self._utility_request(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call.call_id] = fut
        self._send(
            self.engine_indices[0] if engine is None else engine,
            EngineCoreRequestType.UTILITY,
            call,
        )
        out = await asyncio.wait_for(fut, 60)
        if out.failure_message:
            raise RuntimeError(out.failure_message)
        return out.result

    def shutdown(self) -> None:
        """Stop the engines and release everything. Idempotent; also runs at interpreter
        exit if nobody called it (the reader tasks keep the client itself alive)."""
        for task in (self._reader_task, getattr(self, "_snapshot_task", None)):
            if task is not None and not task.done():
                task.cancel()
        self._close_resources()


def make_sync_client(config: EngineConfig, multiprocess: bool = True) -> EngineCoreClient:
    return SyncMPClient(config) if multiprocess else InprocClient(config)
