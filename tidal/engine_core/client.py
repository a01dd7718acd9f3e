"""Engine clients used by frontends, behind one interface.

- ``InprocClient``: the EngineCore lives in the caller's process (tests, debugging).
- ``SyncMPClient``: engines in background processes; blocking API for the offline ``LLM``.
- ``AsyncMPClient``: the same for asyncio frontends (the API server).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tidal.config import EngineConfig
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
    """Spawns engine processes, runs the startup handshake, watches for deaths, stops them.

    ``spawn_engines=False`` (headless ranks started elsewhere) only runs the handshake."""

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
        proc_target: Any = None,
        spawn_engines: bool = True,
    ) -> None:
        self.config = config
        self.engine_indices = engine_indices
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.num_blocks: dict[int, int] = {}
        self._shutting_down = False
        self._handshake = ctx.socket(zmq.ROUTER)
        self._handshake.bind(handshake_address)
        self._addresses = EngineAddresses(
            input_address,
            output_address,
            coordinator_addresses[0],
            coordinator_addresses[1],
            config.parallel.config_hash(),
        )
        if spawn_engines:
            self._spawn(handshake_address, proc_target)

    def _spawn(self, handshake_address: str, proc_target: Any) -> None:
        from tidal.engine_core.proc import run_engine_core

        mp = multiprocessing.get_context("spawn")
        for idx in self.engine_indices:
            cfg = self.config.with_parallel(data_parallel_rank=idx)
            p = mp.Process(
                target=proc_target or run_engine_core,
                args=(cfg, idx, handshake_address),
                name=f"EngineCore_DP{idx}",
                daemon=False,
            )
            p.start()
            self.procs[idx] = p

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

    def start_monitor(self, on_death: Any) -> None:
        """Call ``on_death(reason)`` once if any engine process exits unexpectedly."""
        if not self.procs:
            return

        def monitor() -> None:
            sentinels = {p.sentinel: idx for idx, p in self.procs.items()}
            died = wait_sentinels(list(sentinels))
            if self._shutting_down:
                return
            idx = sentinels[died[0]]
            on_death(f"engine {idx} exited unexpectedly (exit code {self.procs[idx].exitcode})")

        threading.Thread(target=monitor, name="engine-monitor", daemon=True).start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._shutting_down = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()  # SIGTERM: the engine drains, then exits
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)
        self._handshake.close(linger=0)


class MPClient(EngineCoreClient):
    """Shared part of the sync and async multiprocess clients: sockets, processes, routing."""

    def __init__(
        self, config: EngineConfig, *, asyncio_mode: bool, proc_target: Any = None
    ) -> None:
        self.config = config
        self.ipc_dir = _ipc_dir()
        self.ctx: zmq.Context = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.engine_indices = list(range(config.parallel.data_parallel_size))
        self.dead_reason: str | None = None
        self._call_ids = iter(range(1, 1 << 62))
        self._closed = False
        addr = f"ipc://{self.ipc_dir}"
        # Sockets used during startup are synchronous even in asyncio mode.
        sync_ctx = zmq.Context.shadow(self.ctx.underlying) if asyncio_mode else self.ctx
        self.input_socket = sync_ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.bind(f"{addr}/input")
        self.output_address = f"{addr}/output"
        try:
            self.manager = EngineProcManager(
                config,
                self.engine_indices,
                sync_ctx,
                input_address=f"{addr}/input",
                output_address=self.output_address,
                handshake_address=f"{addr}/handshake",
                proc_target=proc_target,
            )
            self._output_socket = self._bind_output(sync_ctx)
            self.manager.wait_for_ready(self.input_socket)
        except BaseException:
            self._close_resources()
            raise
        self.manager.start_monitor(self._on_engine_death)

    def _bind_output(self, sync_ctx: zmq.Context) -> zmq.Socket:
        sock = sync_ctx.socket(zmq.PULL)
        sock.bind(self.output_address)
        return sock

    # ---- sending -----------------------------------------------------------------------

    def _send(self, engine: int, req_type: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.input_socket.send_multipart([engine_identity(engine), req_type.value, encode(payload)])

    def choose_engine(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            return request.data_parallel_rank
        return self.engine_indices[0]

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self.choose_engine(request), EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            for engine in self.engine_indices:
                self._send(engine, EngineCoreRequestType.ABORT, request_ids)

    def _utility_request(self, method: str, args: tuple) -> UtilityRequest:
        return UtilityRequest(0, next(self._call_ids), method, list(args))

    def _on_engine_death(self, reason: str) -> None:
        raise NotImplementedError

    # ---- shutdown ----------------------------------------------------------------------

    def _close_resources(self) -> None:
        if self._closed:
            return
        self._closed = True
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.shutdown()
        for sock in (self.input_socket, getattr(self, "_output_socket", None)):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class SyncMPClient(MPClient):
    """Blocking client for the offline ``LLM``: a reader thread feeds a queue."""

    def __init__(self, config: EngineConfig, proc_target: Any = None) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._pending_calls: dict[int, Future] = {}
        self._stop = threading.Event()
        super().__init__(config, asyncio_mode=False, proc_target=proc_target)
        self._reader = threading.Thread(
            target=self._read_outputs, name="client-output", daemon=True
        )
        self._reader.start()

    def _read_outputs(self) -> None:
        sock = self._output_socket
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            self._dispatch(_OUTPUT_DECODER.decode(sock.recv()))

    def _dispatch(self, outs: EngineCoreOutputs) -> None:
        if outs.utility_output is not None:
            fut = self._pending_calls.pop(outs.utility_output.call_id, None)
            if fut is not None:
                fut.set_result(outs.utility_output)
            return
        if outs.engine_dead:
            self._on_engine_death(outs.dead_reason or "engine reported a fatal error")
            return
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

    def shutdown(self) -> None:
        self._stop.set()
        if self._reader.is_alive():
            self._reader.join(2)
        self._close_resources()


class AsyncMPClient(MPClient):
    """asyncio client for the API server. Outputs arrive on an asyncio queue."""

    def __init__(self, config: EngineConfig, proc_target: Any = None) -> None:
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        super().__init__(config, asyncio_mode=True, proc_target=proc_target)

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._async_out = zmq.asyncio.Socket.from_socket(self._output_socket)
            self._reader_task = self._loop.create_task(self._read_outputs())

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
                self._queue.put_nowait(outs)

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
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._close_resources()


def make_sync_client(config: EngineConfig, multiprocess: bool = True) -> EngineCoreClient:
    return SyncMPClient(config) if multiprocess else InprocClient(config)
