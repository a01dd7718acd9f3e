"""The engine client: one asyncio client for every multiprocess deployment. The API
server's ``AsyncLLM`` runs it on its event loop; the offline ``LLM`` runs the same client
on a loop thread (``loop_client.LoopThreadClient``), so both see rank deaths, frozen
engines and reader failures alike. Outputs arrive on an asyncio queue, read by tasks on
that loop. With rank recovery or elastic EP it also runs what the scale driver asks of it
on that loop (``send_scale``, ``migrate``, ``set_topology``; see ``mp_client``).

The reader tasks never die silently: a frame that does not decode is dropped, counted
(``dropped``) and logged; any other failure of a reader fails the client at once
(``_fail``: every pending request and utility call gets ``EngineDeadError``) instead of
leaving them waiting for outputs nobody reads.

Liveness (docs/architecture.md#faults) runs on the loop too (``_heartbeats``): a HEARTBEAT to every
member each interval; every engine, local or remote, judged by ``Liveness`` (silence,
and the stall watchdog); what it declares is SIGKILLed when it is local and handled as an
exit. The coordinator is watched by its snapshots: one that falls silent is killed and
restarted like a dead one."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq.asyncio

from tidal.config import EngineConfig
from tidal.dp_coordinator.handle import fetch_stats_async
from tidal.frontend.liveness import Liveness, WakeRoute
from tidal.frontend.mp_client import (
    COORDINATOR_HEARTBEAT_S,
    OUTPUT_DECODER,
    MPClient,
    exit_reason,
)
from tidal.protocol.elastic import ScaleEvent, ScaleMessage
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
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
# A coordinator that published nothing (not even its heartbeat) this long is frozen: it
# is killed and restarted (docs/architecture.md#faults). Meanwhile, past two of its heartbeats, wake-ups
# also go straight to the engines (``_wake_route``).
COORDINATOR_TIMEOUT_S = 4 * COORDINATOR_HEARTBEAT_S
# A utility call's answer; the engines answer within milliseconds unless they are busy.
UTILITY_TIMEOUT_S = 60.0


class AsyncMPClient(MPClient):
    """The engine client (readers, liveness, failure) over ``MPClient`` (transport,
    routing, migration). Outputs arrive on an asyncio queue."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._call_targets: dict[int, int] = {}  # call id -> engine id
        self.liveness = Liveness(stall_s=config.parallel.engine_stall_timeout)
        self._coordinator_heard = time.monotonic()  # its last snapshot
        self._direct_wakeups_until = 0.0  # after a coordinator restart (see _wake_route)
        self._coordinator_restart: asyncio.Task | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        self.dropped = DropCounter("frontend client", logger)  # undecodable frames
        super().__init__(config, entry_module)

    def _ensure_reader(self) -> asyncio.Queue[EngineCoreOutputs]:
        """Start the reader (and the heartbeats) on the running loop once; the output
        queue it fills."""
        if self._reader_task is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._async_out = self.transport.output_reader()
            self._reader_task = self._loop.create_task(self._read_outputs())
            self._heartbeat_task = self._loop.create_task(self._heartbeats())
            if self.dp is not None:
                self._async_snap = self.transport.snapshot_reader()
                self._snapshot_task = self._loop.create_task(self._read_snapshots())
        assert self._queue is not None  # made with the reader
        return self._queue

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
        now = time.monotonic()
        self.liveness.heard(outs.engine_id, now, outs.progress if outs.heartbeat else None)
        if outs.heartbeat:
            return
        report = outs.scale_report
        if report is not None and report.event is ScaleEvent.GROUP_FAILED:
            # A collective broke: some member is probably dead. A silent one is declared
            # after a short silence from now on, not the full timeout.
            self.liveness.suspect(now)
        if outs.utility_output is not None:
            fut = self._pending_calls.pop(outs.utility_output.call_id, None)
            self._call_targets.pop(outs.utility_output.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(outs.utility_output)
        elif outs.engine_dead:
            reason = outs.dead_reason or "engine reported a fatal error"
            if self._scale_owns(outs.engine_id):
                # A joining or leaving engine: its exit (which follows) is the scale
                # driver's event, not a rank death.
                logger.warning("engine %d (scaling) died: %s", outs.engine_id, reason)
            else:
                self._fail(reason)
        elif self._on_outputs(outs):
            assert self._queue is not None  # made with this reader
            self._queue.put_nowait(outs)

    async def _read_snapshots(self) -> None:
        try:
            while True:
                frame = await self._async_snap.recv()
                self._coordinator_heard = time.monotonic()
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
        if self.coordinator is None:
            raise RuntimeError("no DP coordinator: the deployment has one rank")
        return await fetch_stats_async(
            self.coordinator.addresses.stats, timeout_s, self.transport.curve
        )

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

    async def _heartbeats(self) -> None:
        """Liveness (docs/architecture.md#faults), every HEARTBEAT_INTERVAL_S: a HEARTBEAT to every
        member (so headless ranks notice a dead frontend); every engine judged by
        ``self.liveness`` (members and local processes once heard from); the coordinator
        judged by its snapshots."""
        last_round = time.monotonic()
        self.liveness.expect(self.engine_ids, last_round)  # ready when we started
        self._coordinator_heard = last_round  # its snapshots are read from now on
        while self.dead_reason is None and not self._closed:
            now = time.monotonic()
            # The loop itself stalled (a burst of work): frames may wait unread, so the
            # silences measured now are not the engines'. Judge from the next round on.
            stalled = now - last_round > 2 * HEARTBEAT_INTERVAL_S
            last_round = now
            self._watch_coordinator(now, stalled)
            for e in list(self.engine_ids):
                if e in self.router.gone:
                    continue
                try:
                    self._send_frame(e, EngineCoreRequestType.HEARTBEAT, b"")
                except EngineDeadError:
                    return
                except zmq.ZMQError:
                    pass  # no route (gone, or a joiner not registered yet): nothing to tell
            watched = (set(self.engine_ids) | self.manager.watched_ids()) - self.router.gone
            for v in self.liveness.check(now, watched, loop_stalled=stalled):
                logger.error("engine %d: %s: declared dead", v.engine_id, v.cause)
                self._declare_dead(v.engine_id, v.cause)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _declare_dead(self, engine_id: int, cause: str) -> None:
        """An engine that stopped without dying (frozen, stuck): SIGKILL it if it runs
        here (its sockets close, so peers blocked on it fail at once), then handle it as
        an exit (docs/architecture.md#faults).

        The kill runs on a thread of its own: a launcher's kill may wait (a Ray rank's
        actor on a lost node), and the loop must keep reading the survivors' heartbeats
        and sending them ours meanwhile, or they would take the frontend for dead too. Not
        the default executor: the scale driver's long waits may fill it."""
        threading.Thread(
            target=self._kill_engine,
            args=(engine_id,),
            name=f"kill-engine-{engine_id}",
            daemon=True,
        ).start()
        self._handle_engine_exit(engine_id, None, cause)

    def _kill_engine(self, engine_id: int) -> None:
        try:
            self.manager.kill(engine_id)
        except Exception:  # noqa: BLE001 - its exit is handled already; the reap kills it
            logger.exception("engine %d: kill failed", engine_id)

    def _watch_coordinator(self, now: float, loop_stalled: bool) -> None:
        """A dead coordinator is restarted; one silent past ``COORDINATOR_TIMEOUT_S``
        (frozen) is killed first, so the next round restarts it."""
        coord = self.coordinator
        if coord is None or self._coordinator_restart is not None:
            return
        if not coord.is_alive():
            self._coordinator_restart = asyncio.create_task(self._restart_coordinator())
            return
        silent = now - self._coordinator_heard
        if silent > COORDINATOR_TIMEOUT_S and not loop_stalled:
            logger.error("the DP coordinator published nothing for %.1fs: killing it", silent)
            coord.kill()

    def _wake_route(self) -> WakeRoute:
        coord = self.coordinator
        if coord is None:
            return WakeRoute.COORDINATOR
        if not coord.is_alive():
            return WakeRoute.DIRECT
        now = time.monotonic()
        silent = now - self._coordinator_heard > 2 * COORDINATOR_HEARTBEAT_S
        if silent or now < self._direct_wakeups_until:
            return WakeRoute.COORDINATOR_AND_DIRECT
        return WakeRoute.COORDINATOR

    async def _restart_coordinator(self) -> None:
        """The DP coordinator died (docs/architecture.md#faults): start a new one on the same addresses
        with the current topology, at the last wave this frontend saw. Requests keep
        flowing meanwhile: routing uses the last snapshot, wake-ups go straight to the
        engines (``_wake_route``), and the engines' own messages to the coordinator wait
        in their sockets until it is back."""
        assert self.coordinator is not None and self.dp is not None
        code = self.coordinator.proc.exitcode
        logger.error("the DP coordinator died (exit code %s): restarting it", code)
        try:
            wave = self.dp.wave.wave
            await asyncio.to_thread(self.coordinator.restart, self.dp.topology, wave)
        except Exception as e:  # noqa: BLE001 - without it no wave can start: fail loudly
            if not self._closed:
                self._fail(f"the DP coordinator died and could not be restarted: {e}")
            return
        finally:
            self._coordinator_restart = None
        # Its sockets reconnect in the background: wake engines directly for a while too.
        self._coordinator_heard = time.monotonic()
        self._direct_wakeups_until = time.monotonic() + 2.0
        self.dp.wave.running = False  # when in doubt, paused: the next request wakes them
        logger.warning("DP coordinator restarted (%d restart(s))", self.coordinator.restarts)

    def _handle_engine_exit(
        self, engine_id: int, exitcode: int | None, cause: str | None = None
    ) -> None:
        if engine_id in self.router.gone:
            return  # reported once (a sentinel and a silence can both see it)
        self.liveness.forget(engine_id)
        hooks = self._scale_hooks
        if hooks is not None and hooks.owns_engine(engine_id):
            # Joining, leaving, or a rank death the deployment recovers from: the scale
            # driver's event. Only the calls waiting on this engine fail.
            self.router.gone.add(engine_id)
            reason = cause or exit_reason(engine_id, exitcode)
            for call_id, target in list(self._call_targets.items()):
                if target == engine_id:
                    del self._call_targets[call_id]
                    fut = self._pending_calls.pop(call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(EngineDeadError(reason))
            hooks.on_exit(engine_id, exitcode, cause)
            return
        self._fail(cause or exit_reason(engine_id, exitcode))

    def fail_deployment(self, reason: str) -> None:
        """Nothing can serve any more (the scale driver found every engine dead)."""
        self._fail(reason)

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
        after READY) is retried for ``retry_s``; returns those still unreachable then, and
        at once those known gone (exited or declared dead: waiting for them would hold
        the scale driver, and with it the recovery that removes them). Raises
        ``EngineDeadError`` once the client failed."""
        payload = encode(message)
        pending = list(dict.fromkeys(engine_ids))
        deadline = time.monotonic() + retry_s
        while True:
            self.transport.drain_registrations()
            gone = [e for e in pending if e in self.router.gone]
            pending = [
                e
                for e in pending
                if e not in gone
                and not self._try_send_frame(e, EngineCoreRequestType.SCALE, payload)
            ]
            if not pending or time.monotonic() >= deadline:
                return gone + pending
            await asyncio.sleep(0.02)

    def _deliver_injected(self, outs: EngineCoreOutputs) -> None:
        self._ensure_reader().put_nowait(outs)

    def _fail(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        if self._queue is not None:
            self._queue.put_nowait(EngineCoreOutputs(engine_dead=True, dead_reason=reason))
        for fut in list(self._pending_calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def get_output_async(self) -> EngineCoreOutputs:
        queue = self._ensure_reader()
        if self.dead_reason is not None and queue.empty():
            raise EngineDeadError(self.dead_reason)
        outs = await queue.get()
        if outs.engine_dead:
            raise EngineDeadError(outs.dead_reason or "engine died")
        return outs

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        live = [e for e in self.engine_ids if e not in self.router.gone]  # dead: no answer
        calls = [self.call_utility_async(method, *args, engine=e) for e in live]
        return list(await asyncio.gather(*calls))

    async def call_utility_async(
        self,
        method: str,
        *args: Any,
        engine: int | None = None,
        timeout_s: float = UTILITY_TIMEOUT_S,
    ) -> Any:
        """``method(*args)`` on ``engine`` (default: the first); ``EngineDeadError`` when it
        is gone or dies first, ``TimeoutError`` past ``timeout_s``."""
        self._ensure_reader()
        target = self.engine_ids[0] if engine is None else engine
        if target in self.router.gone:
            raise EngineDeadError(f"engine {target} is gone")
        call = self._utility_request(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call.call_id] = fut
        self._call_targets[call.call_id] = target
        try:
            self._send(target, EngineCoreRequestType.UTILITY, call)
            out = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending_calls.pop(call.call_id, None)
            self._call_targets.pop(call.call_id, None)
        if out.failure_message:
            raise RuntimeError(out.failure_message)
        return out.result

    def shutdown(self) -> None:
        """Stop the engines and release everything. Idempotent; also runs at interpreter
        exit if nobody called it (the reader tasks keep the client itself alive)."""
        for task in (
            self._reader_task,
            getattr(self, "_snapshot_task", None),
            getattr(self, "_heartbeat_task", None),
            getattr(self, "_coordinator_restart", None),  # its thread ends under the lock
        ):
            if task is not None and not task.done():
                task.cancel()
        self.transport.stop_reading()
        self._close_resources()
