"""The engine client's liveness monitor (docs/architecture.md#faults): heartbeats, engines
declared dead, the DP coordinator watched and restarted, and what an engine's exit does.

``LivenessMonitor`` owns the judges (``Liveness`` for the engines, ``CoordinatorWatch``
for the coordinator: pure, in ``liveness``), the heartbeat task and a coordinator restart
in progress, and the scale driver's ``ScaleHooks``. Every interval it sends each member a
HEARTBEAT (so headless ranks notice a dead frontend), asks the judges, SIGKILLs what
they declare (when it runs here) and handles it as an exit. An exit is the scale
driver's when its hooks own the engine (joining, leaving, or a death the deployment
recovers from: the engine is marked gone in the router and only the calls waiting on it
fail); otherwise it fails the client (``fail``). Runs on the event loop's thread; the
process monitor's thread only hands exits over (``on_engine_exit``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

import zmq

from tidal.dp_coordinator.handle import DPCoordinator
from tidal.frontend.launchers.proc_manager import EngineProcManager
from tidal.frontend.liveness import CoordinatorAction, CoordinatorWatch, Liveness, WakeRoute
from tidal.frontend.router import Router
from tidal.protocol.elastic import ScaleEvent, ScaleReport
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import HEARTBEAT_INTERVAL_S, EngineCoreOutputs, EngineCoreRequestType

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleHooks:
    """How the client hands elastic EP events to the scale driver (all called on the
    event loop's thread).

    ``owns_engine(engine_id)``: whether an exit (or ENGINE_CORE_DEAD) of this engine is
    the driver's (an engine joining or leaving in a scale operation, or one no longer
    serving) rather than a rank death that fails the client. ``on_exit(engine_id,
    exitcode, cause)`` is then called for the exit (``cause``: e.g. no heartbeat);
    ``on_report`` for every ``ScaleReport``."""

    on_report: Callable[[ScaleReport], None]
    owns_engine: Callable[[int], bool]
    on_exit: Callable[[int, int | None, str | None], None]


def exit_reason(engine_id: int, exitcode: int | None) -> str:
    return f"engine {engine_id} exited unexpectedly (exit code {exitcode})"


class LivenessMonitor:
    """Heartbeats, verdicts and exits. State: the judges, the hooks, the heartbeat and
    restart tasks, ``stopped`` (the client shut down: nothing is judged any more)."""

    def __init__(
        self,
        router: Router,
        manager: EngineProcManager,
        coordinator: DPCoordinator | None,
        *,
        stall_s: float,
        fail: Callable[[str], None],
        fail_calls_to: Callable[[int, str], None],
    ) -> None:
        self.router = router
        self.transport = router.transport
        self.manager = manager
        self.coordinator = coordinator
        self.liveness = Liveness(stall_s=stall_s)
        self.coordinator_watch = CoordinatorWatch(time.monotonic())
        self.hooks: ScaleHooks | None = None
        self._fail = fail  # the client's failure: every request and call ends
        self._fail_calls_to = fail_calls_to  # (engine, reason): only the calls waiting on it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self.stopped = False

    def start(self) -> None:
        """Heartbeats and verdicts on the running loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._heartbeat_task = self._loop.create_task(self._heartbeats())

    def stop(self) -> None:
        """Cancel the tasks (a coordinator restart's thread ends under its lock)."""
        self.stopped = True
        for task in (self._heartbeat_task, self._restart_task):
            if task is not None and not task.done():
                task.cancel()

    def owns(self, engine_id: int) -> bool:
        """Whether the scale driver handles this engine's death (see ``ScaleHooks``)."""
        hooks = self.hooks
        return hooks is not None and hooks.owns_engine(engine_id)

    # ------------------------------------------------------------------ what is heard

    def heard(self, outs: EngineCoreOutputs, now: float) -> None:
        """Any frame of an engine; a GROUP_FAILED report makes silences suspect."""
        self.liveness.heard(outs.engine_id, now, outs.progress if outs.heartbeat else None)
        report = outs.scale_report
        if report is not None and report.event is ScaleEvent.GROUP_FAILED:
            # A collective broke: some member is probably dead. A silent one is declared
            # after a short silence from now on, not the full timeout.
            self.liveness.suspect(now)

    def snapshot_heard(self) -> None:
        self.coordinator_watch.heard(time.monotonic())

    def wake_route(self) -> WakeRoute:
        """Where the router sends a wake-up (the coordinator's health decides)."""
        coord = self.coordinator
        if coord is None:
            return WakeRoute.COORDINATOR
        return self.coordinator_watch.wake_route(time.monotonic(), coord.is_alive())

    # ------------------------------------------------------------------ heartbeats

    async def _heartbeats(self) -> None:
        """Every HEARTBEAT_INTERVAL_S: a HEARTBEAT to every member; every engine judged
        (members, and local processes once heard from); the coordinator judged by its
        snapshots."""
        last_round = time.monotonic()
        self.liveness.expect(self.router.engine_ids, last_round)  # ready when we started
        self.coordinator_watch.heard(last_round)  # its snapshots are read from now on
        while self.transport.dead_reason is None and not self.stopped:
            now = time.monotonic()
            # The loop itself stalled (a burst of work): frames may wait unread, so the
            # silences measured now are not the engines'. Judge from the next round on.
            stalled = now - last_round > 2 * HEARTBEAT_INTERVAL_S
            last_round = now
            self._watch_coordinator(now, stalled)
            for e in self.router.live_engine_ids():
                if not self._send_heartbeat(e):
                    return
            watched = (set(self.router.engine_ids) | self.manager.watched_ids()) - self.router.gone
            for v in self.liveness.check(now, watched, loop_stalled=stalled):
                logger.error("engine %d: %s: declared dead", v.engine_id, v.cause)
                self.declare_dead(v.engine_id, v.cause)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _send_heartbeat(self, engine_id: int) -> bool:
        """False once the client failed (no more rounds)."""
        try:
            self.transport.send(engine_id, EngineCoreRequestType.HEARTBEAT, b"")
        except EngineDeadError:
            return False
        except zmq.ZMQError:
            pass  # no route (gone, or a joiner not registered yet): nothing to tell
        return True

    # ------------------------------------------------------------------ engines

    def declare_dead(self, engine_id: int, cause: str) -> None:
        """An engine that stopped without dying (frozen, stuck): SIGKILL it if it runs
        here (its sockets close, so peers blocked on it fail at once), then handle it as
        an exit.

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
        self.handle_exit(engine_id, None, cause)

    def _kill_engine(self, engine_id: int) -> None:
        try:
            self.manager.kill(engine_id)
        except Exception:  # noqa: BLE001 - its exit is handled already; the reap kills it
            logger.exception("engine %d: kill failed", engine_id)

    def on_engine_exit(self, engine_id: int, exitcode: int | None) -> None:
        """The process monitor's thread: a local engine exited unasked. Decided on the
        loop, where the scale driver's state lives."""
        loop = self._loop
        if loop is None:
            if self.transport.dead_reason is None:
                self.transport.dead_reason = exit_reason(engine_id, exitcode)
            return
        try:
            loop.call_soon_threadsafe(self.handle_exit, engine_id, exitcode)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def handle_exit(self, engine_id: int, exitcode: int | None, cause: str | None = None) -> None:
        """An engine exited or was declared dead (reported once)."""
        if engine_id in self.router.gone:
            return  # reported once (a sentinel and a silence can both see it)
        self.liveness.forget(engine_id)
        hooks = self.hooks
        if hooks is not None and hooks.owns_engine(engine_id):
            # Joining, leaving, or a rank death the deployment recovers from: the scale
            # driver's event. Only the calls waiting on this engine fail.
            self.router.gone.add(engine_id)
            self._fail_calls_to(engine_id, cause or exit_reason(engine_id, exitcode))
            hooks.on_exit(engine_id, exitcode, cause)
            return
        self._fail(cause or exit_reason(engine_id, exitcode))

    # ------------------------------------------------------------------ the coordinator

    def _watch_coordinator(self, now: float, loop_stalled: bool) -> None:
        """A dead coordinator is restarted; one silent too long (frozen) is killed
        first, so a later round restarts it."""
        coord = self.coordinator
        if coord is None:
            return
        action = self.coordinator_watch.check(now, coord.is_alive(), loop_stalled=loop_stalled)
        match action:
            case CoordinatorAction.NONE:
                pass
            case CoordinatorAction.RESTART:
                self._restart_task = asyncio.create_task(self._restart_coordinator(coord))
            case CoordinatorAction.KILL:
                silent = now - self.coordinator_watch.heard_at
                logger.error("the DP coordinator published nothing for %.1fs: killing it", silent)
                coord.kill()
            case _:
                assert_never(action)

    async def _restart_coordinator(self, coord: DPCoordinator) -> None:
        """The DP coordinator died: start a new one on the same addresses with the
        current topology, at the last wave this frontend saw. Requests keep flowing
        meanwhile: routing uses the last snapshot, wake-ups go straight to the engines
        (``wake_route``), and the engines' own messages to the coordinator wait in their
        sockets until it is back."""
        dp = self.router.dp
        assert dp is not None  # a coordinator runs only with the DP machinery
        logger.error("the DP coordinator died (exit code %s): restarting it", coord.proc.exitcode)
        try:
            await asyncio.to_thread(coord.restart, dp.topology, dp.wave.wave)
        except Exception as e:  # noqa: BLE001 - without it no wave can start: fail loudly
            self.coordinator_watch.restart_failed()
            if not self.stopped:
                self._fail(f"the DP coordinator died and could not be restarted: {e}")
            return
        finally:
            self._restart_task = None
        self.coordinator_watch.restarted(time.monotonic())
        dp.wave.running = False  # when in doubt, paused: the next request wakes them
        logger.warning("DP coordinator restarted (%d restart(s))", coord.restarts)
