"""The asyncio multiprocess client, for the API server: outputs arrive on an asyncio
queue, read by tasks on the caller's event loop. With elastic EP it also runs what the
scale driver asks of it on that loop (``send_scale``, ``migrate``, ``set_topology``; see
``mp_client``).

The reader tasks never die silently: a frame that does not decode is dropped, counted
(``dropped``) and logged; any other failure of a reader fails the client at once
(``_fail``: every pending request and utility call gets ``EngineDeadError``) instead of
leaving them waiting for outputs nobody reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq.asyncio

from tidal.config import EngineConfig
from tidal.dp_coordinator.handle import fetch_stats_async
from tidal.frontend.mp_client import OUTPUT_DECODER, MPClient, exit_reason
from tidal.protocol.elastic import ScaleMessage
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    DPCoordinatorStats,
    EngineCoreOutputs,
    EngineCoreRequestType,
    encode,
)
from tidal.utils.dropped import DropCounter

logger = logging.getLogger(__name__)

# A joining engine registers its input route before it loads the model, so the route
# exists long before its READY; this only covers a slow connect.
SCALE_SEND_RETRY_S = 5.0


class AsyncMPClient(MPClient):
    """asyncio client for the API server. Outputs arrive on an asyncio queue."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        self.dropped = DropCounter("frontend client", logger)  # undecodable frames
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
        try:
            while True:
                frame = await self._async_out.recv()
                try:
                    outs = OUTPUT_DECODER.decode(frame)
                except msgspec.DecodeError as e:
                    self.dropped.drop("engine output frame", e)
                    continue
                self._dispatch(outs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - fail every waiter now, never hang them
            self._reader_failed("output", e)

    def _dispatch(self, outs: EngineCoreOutputs) -> None:
        if outs.utility_output is not None:
            fut = self._pending_calls.pop(outs.utility_output.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(outs.utility_output)
        elif outs.engine_dead:
            reason = outs.dead_reason or "engine reported a fatal error"
            if self._scale_owns(outs.engine_index):
                # A joining or leaving engine: its exit (which follows) is the scale
                # driver's event, not a rank death.
                logger.warning("engine %d (scaling) died: %s", outs.engine_index, reason)
            else:
                self._fail(reason)
        elif self._on_outputs(outs):
            self._queue.put_nowait(outs)

    async def _read_snapshots(self) -> None:
        try:
            while True:
                frame = await self._async_snap.recv()
                try:
                    self._on_snapshot(frame)
                except msgspec.DecodeError as e:
                    self.dropped.drop("load snapshot frame", e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - fail every waiter now, never hang them
            self._reader_failed("load snapshot", e)

    def _reader_failed(self, name: str, error: BaseException) -> None:
        if self._closed:
            return  # shut down under the reader
        reason = f"the client's {name} reader failed: {type(error).__name__}: {error}"
        logger.error("%s", reason, exc_info=error)
        self._fail(reason)

    async def get_dp_stats_async(self, timeout_s: float = 2.0) -> DPCoordinatorStats:
        """The coordinator's full stats (DP only)."""
        return await fetch_stats_async(self.coordinator.addresses.stats, timeout_s, self._curve)

    def _on_engine_death(self, reason: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail, reason)
        elif self.dead_reason is None:
            self.dead_reason = reason

    def _on_engine_exit(self, engine_id: int, exitcode: int | None) -> None:
        # The monitor's thread: decide on the loop, where the scale driver's state lives.
        loop = self._loop
        if loop is None:
            if self.dead_reason is None:
                self.dead_reason = exit_reason(engine_id, exitcode)
            return
        try:
            loop.call_soon_threadsafe(self._handle_engine_exit, engine_id, exitcode)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _handle_engine_exit(self, engine_id: int, exitcode: int | None) -> None:
        hooks = self._scale_hooks
        if hooks is not None and hooks.owns_engine(engine_id):
            hooks.on_exit(engine_id, exitcode)
            return
        self._fail(exit_reason(engine_id, exitcode))

    # ---- elastic EP ----------------------------------------------------------------------

    def start(self) -> None:
        """Start reading outputs on the running loop (the scale driver needs the reports
        before any request was made)."""
        self._ensure_reader()

    async def send_scale(
        self,
        engine_ids: Iterable[int],
        message: ScaleMessage,
        *,
        retry_s: float = SCALE_SEND_RETRY_S,
    ) -> list[int]:
        """Send one SCALE frame (``ScalePrepare | ScaleCommit | ScaleAbort``) to each
        engine, in order. An engine whose input route is not there yet (a joiner right
        after READY) is retried for ``retry_s``; returns those still unreachable then (an
        engine that exited). Raises ``EngineDeadError`` once the client failed."""
        payload = encode(message)
        pending = list(dict.fromkeys(engine_ids))
        deadline = time.monotonic() + retry_s
        while True:
            self._drain_registrations()
            pending = [e for e in pending if not self._try_send_scale(e, payload)]
            if not pending or time.monotonic() >= deadline:
                return pending
            await asyncio.sleep(0.02)

    def _deliver_injected(self, outs: EngineCoreOutputs) -> None:
        self._ensure_reader()
        self._queue.put_nowait(outs)

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
        calls = [self.call_utility_async(method, *args, engine=e) for e in self.engine_ids]
        return list(await asyncio.gather(*calls))

    async def call_utility_async(self, method: str, *args: Any, engine: int | None = None) -> Any:
        self._ensure_reader()
        call = self._utility_request(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call.call_id] = fut
        self._send(
            self.engine_ids[0] if engine is None else engine,
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
        # The asyncio views of the sockets registered their fds with the event loop; the
        # sockets are closed below through their sync objects, which does not unregister
        # them, and a client started later on the same loop reuses those fd numbers (its
        # reader would never wake). Unregister first (pyzmq's own close does the same).
        for view in (getattr(self, "_async_out", None), getattr(self, "_async_snap", None)):
            if view is not None and not view.closed:
                view._clear_io_state()
        self._close_resources()
