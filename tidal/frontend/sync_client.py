"""The blocking multiprocess client, for the offline ``LLM``: a reader thread feeds a
queue.

The reader thread never dies silently: a frame that does not decode is dropped, counted
(``SyncMPClient.dropped``) and logged; any other failure of the reader fails the client at
once (every waiter gets ``EngineDeadError``) instead of leaving it waiting for outputs
nobody reads.

Liveness (docs/architecture.md#faults): the reader also judges the engines' heartbeats (``Liveness``:
silence, and the stall watchdog); an engine that froze or got stuck is killed and fails
the client, as a dead one does, instead of leaving ``generate`` waiting forever. (This
client runs deployments that do not recover from rank deaths; those that do run on
``LoopThreadClient``.)"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.frontend.liveness import Liveness
from tidal.frontend.mp_client import OUTPUT_DECODER, MPClient, exit_reason
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    EngineCoreOutputs,
    EngineCoreRequestType,
)
from tidal.utils.dropped import DropCounter

logger = logging.getLogger(__name__)


class SyncMPClient(MPClient):
    """Blocking client for the offline ``LLM``: a reader thread feeds a queue."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._pending_calls: dict[int, Future] = {}
        self.dropped = DropCounter("frontend client", logger)  # undecodable frames
        self.liveness = Liveness(stall_s=config.parallel.engine_stall_timeout)
        self._liveness_round = 0.0  # the reader's last liveness check
        # No scale driver runs here, so no request ever moves: no request book.
        super().__init__(config, asyncio_mode=False, entry_module=entry_module, migrates=False)
        self._liveness_round = time.monotonic()
        self.liveness.expect(self.engine_ids, self._liveness_round)  # ready now
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
        self.liveness.heard(
            outs.engine_index, time.monotonic(), outs.progress if outs.heartbeat else None
        )
        if outs.heartbeat:
            return  # liveness only
        if outs.utility_output is not None:
            fut = self._pending_calls.pop(outs.utility_output.call_id, None)
            if fut is not None:
                fut.set_result(outs.utility_output)
            return
        if outs.engine_dead:
            self._on_engine_death(outs.dead_reason or "engine reported a fatal error")
            return
        if self._on_outputs(outs):
            self.outputs.put_nowait(outs)

    def _check_liveness(self) -> None:
        """The reader thread, between frames: an engine found frozen or stuck is killed
        and fails the client (nothing recovers here)."""
        now = time.monotonic()
        if now - self._liveness_round < HEARTBEAT_INTERVAL_S or self.dead_reason is not None:
            return
        stalled = now - self._liveness_round > 2 * HEARTBEAT_INTERVAL_S  # we were starved
        self._liveness_round = now
        watched = set(self.engine_ids) | self.manager.watched_ids()
        for v in self.liveness.check(now, watched, loop_stalled=stalled):
            logger.error("engine %d: %s: declared dead", v.engine_id, v.cause)
            self.manager.kill(v.engine_id)
            self._on_engine_death(f"engine {v.engine_id}: {v.cause}")

    def _on_engine_exit(self, engine_id: int, exitcode: int | None) -> None:
        # No scale driver runs with the blocking client: every exit is a rank death.
        self._on_engine_death(exit_reason(engine_id, exitcode))

    def _deliver_injected(self, outs: EngineCoreOutputs) -> None:
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
        return self.call_utility_on(self.engine_ids[0], method, *args)

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
        return [self.call_utility_on(e, method, *args) for e in self.engine_ids]

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
    client, for as long as the client exists and has not been shut down. A failure that
    is not one bad frame fails the client."""
    try:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if snap is not None:
            poller.register(snap, zmq.POLLIN)
        while not stop.is_set():
            for ready, _ in poller.poll(100):
                if stop.is_set() or not _deliver(client_ref, ready is sock, ready.recv()):
                    return
            if not _check_liveness(client_ref):
                return
    except Exception as e:  # noqa: BLE001 - fail every waiter now, never hang them
        if not stop.is_set():
            _reader_failed(client_ref, e)


def _deliver(client_ref: weakref.ref[SyncMPClient], is_output: bool, frame: bytes) -> bool:
    """Hand one frame to the client; False once it is gone. A function of its own so the
    strong reference it takes ends with the call, not with the reader thread."""
    client = client_ref()
    if client is None:
        return False
    try:
        if is_output:
            outs = OUTPUT_DECODER.decode(frame)
        else:
            client._on_snapshot(frame)
            return True
    except msgspec.DecodeError as e:
        client.dropped.drop("engine output frame" if is_output else "load snapshot frame", e)
        return True
    client._dispatch(outs)
    return True


def _check_liveness(client_ref: weakref.ref[SyncMPClient]) -> bool:
    """``client._check_liveness()``; False once the client is gone."""
    client = client_ref()
    if client is None:
        return False
    client._check_liveness()
    return True


def _reader_failed(client_ref: weakref.ref[SyncMPClient], error: BaseException) -> None:
    client = client_ref()
    if client is None:
        return
    reason = f"the client's output reader failed: {type(error).__name__}: {error}"
    logger.error("%s", reason, exc_info=error)
    client._on_engine_death(reason)
