"""The server's lifecycle (docs/operations.md#lifecycle): starting, ready, draining, and
whether new generation requests are admitted.

- Ready (``/ready`` 200) once every rank served its first step (``AsyncLLM.warm_up``:
  one token per rank) and while not draining, asleep or dead.
- SIGTERM/SIGINT (``DrainingServer``) drains instead of stopping: new generation
  requests get 503 with ``Retry-After``, ``/health`` stays 200 (``draining``: liveness
  holds), the requests in flight finish for up to ``--shutdown-timeout`` seconds, then
  the rest end with finish reason ``abort`` and a message saying why; then uvicorn stops
  and the lifespan shuts the engines down. A second signal stops at once.
- While the engines sleep (``/sleep``, ``tidal/launch/sleep.py``) generation requests
  get 503 with ``Retry-After`` too.

In flight = a generation route's ASGI call, from its headers to the last byte of its
(streamed) body: counted by ``AdmissionMiddleware``, so a drain waits for the responses
to reach their clients, not only for the engine to finish.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Annotated, Any

import uvicorn
from msgspec import Meta

from tidal.config import check_options, option
from tidal.launch.errors import APIError

logger = logging.getLogger(__name__)

# What a refused client is told to wait before retrying (here, or at another replica).
RETRY_AFTER_S = 5
# Routes that start engine requests: refused while draining or asleep, counted in flight.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# How long the aborted streams get to send their last chunk after the timeout.
ABORT_FLUSH_S = 5.0


@dataclass(frozen=True)
class ShutdownOptions:
    """``launch`` flags (tidal/config.py's ``option``)."""

    shutdown_timeout: Annotated[float, Meta(ge=0)] = option(
        30.0,
        help="seconds requests in flight may take to finish after SIGTERM (new ones get "
        "503 meanwhile); then they are aborted (finish_reason 'abort') and the server "
        "exits. 0: abort at once",
    )

    def __post_init__(self) -> None:
        check_options(self)


class Phase(enum.Enum):
    STARTING = "starting"  # engines up, not every rank has served a step yet
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: no new requests, the ones in flight finish


class Lifecycle:
    """The phase, the sleep flag and the generation requests in flight. Loop-only."""

    def __init__(self, shutdown_timeout_s: float = ShutdownOptions.shutdown_timeout) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.phase = Phase.STARTING
        self.sleeping = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task | None = None

    def refusal(self) -> APIError | None:
        """Why a new generation request is refused now (503), or None."""
        if self.phase is Phase.DRAINING:
            return APIError(503, "the server is shutting down", code="server_draining")
        if self.sleeping:
            return APIError(
                503, "the engines are asleep: POST /wake_up first", code="engine_sleeping"
            )
        return None

    def readiness(self, engine_dead: bool) -> str | None:
        """None when ready, else why not (``/ready``'s status)."""
        if engine_dead:
            return "dead"
        if self.phase is not Phase.READY:
            return self.phase.value
        return "sleeping" if self.sleeping else None

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def become_ready(self, warm_up: Callable[[], Awaitable[None]] | None) -> None:
        """READY once ``warm_up`` (a step on every rank) succeeded; retried while it fails
        (a rank still recovering), never after a drain began."""
        while warm_up is not None and self.phase is Phase.STARTING:
            try:
                await warm_up()
                break
            except Exception:  # noqa: BLE001 - not ready yet; /ready says so meanwhile
                logger.warning("warm-up step failed; /ready stays 503", exc_info=True)
                await asyncio.sleep(1.0)
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY
            logger.info("ready: every rank served its first step")

    def start_drain(self, abort_all: Callable[[str], int], on_done: Callable[[], None]) -> None:
        """Stop admitting and drain (idempotent); ``on_done()`` when nothing is in flight."""
        if self._drain_task is not None:
            return
        self.phase = Phase.DRAINING
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(abort_all, on_done))

    async def _drain(self, abort_all: Callable[[str], int], on_done: Callable[[], None]) -> None:
        timeout = self.shutdown_timeout_s
        logger.info(
            "draining: %d request(s) in flight get up to %gs to finish", self.in_flight, timeout
        )
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            message = f"server shutting down: not finished within --shutdown-timeout={timeout:g}s"
            aborted = abort_all(message)
            logger.warning("drain timeout: aborted %d request(s) still running", aborted)
            try:  # their final chunks go out; a client that does not read them is dropped
                await asyncio.wait_for(self._idle.wait(), ABORT_FLUSH_S)
            except TimeoutError:
                logger.warning("%d response(s) still unsent; closing anyway", self.in_flight)
        logger.info("drained; shutting down")
        on_done()


class AdmissionMiddleware:
    """Refuses generation requests while draining or asleep (503, ``Retry-After``) and
    counts the admitted ones until their response is sent."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self.lifecycle.refusal()
        if refusal is not None:
            response = refusal.response()
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains (``Lifecycle.start_drain``) and then
    exits 0; a second signal is uvicorn's own stop."""

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        abort_all: Callable[[str], int],
        on_serving: Callable[[], None] | None = None,
    ) -> None:
        """``on_serving``: called once the app has started and the socket accepts, with
        this server's signal handlers in place (a signal from whoever waits for it then
        drains instead of meeting the handlers of the start)."""
        super().__init__(config)
        self.lifecycle, self.abort_all = lifecycle, abort_all
        self.on_serving = on_serving
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_serving is not None:
            self.on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.lifecycle.phase is Phase.DRAINING or self.should_exit:
            super().handle_exit(sig, frame)
            return
        logger.info("%s: draining", signal.Signals(sig).name)
        # Not recorded as a captured signal: uvicorn would re-raise it on the way out,
        # and the process would end killed by it instead of exiting 0.
        self._loop.call_soon_threadsafe(
            self.lifecycle.start_drain, self.abort_all, self._stop_serving
        )

    def _stop_serving(self) -> None:
        self.should_exit = True
