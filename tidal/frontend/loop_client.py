"""The blocking facade of the engine client, for the offline ``LLM`` with its engines in
processes (every deployment but one CPU rank, which runs in the caller's process).

It runs the server's machinery unchanged -- an ``AsyncMPClient`` and, when the deployment
reconfigures itself (rank recovery, docs/architecture.md#faults, or elastic EP), its
``ScaleDriver`` -- on an event loop of its own, on a daemon thread, so an offline
deployment fails and recovers exactly as the server does: the same liveness checks,
recovery operations, request migration and coordinator restarts, no second
implementation of any of them.

The caller's thread reaches the loop through ``run_coroutine_threadsafe`` (each call waits
for its result, so errors such as a request that cannot be encoded reach the caller);
outputs come back on a thread-safe queue fed by a task on the loop. Nothing on the loop
refers to the facade, so dropping it (or interpreter exit) stops the engines too.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from tidal.config import EngineConfig
from tidal.frontend.async_client import UTILITY_TIMEOUT_S, AsyncMPClient
from tidal.frontend.core_client import EngineCoreClient
from tidal.frontend.scaling.scale_driver import ScaleDriver, fault_status
from tidal.frontend.scaling.scale_records import ScaleTimeouts
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest

R = TypeVar("R")

# How long shutdown waits for the engines to stop on the loop.
SHUTDOWN_TIMEOUT_S = 60.0


class LoopThreadClient(EngineCoreClient):
    """``EngineCoreClient`` over an ``AsyncMPClient`` (+ its ``ScaleDriver``, when the
    deployment reconfigures itself) on a loop thread."""

    def __init__(
        self,
        config: EngineConfig,
        entry_module: str | None = None,
        scale_timeouts: ScaleTimeouts | None = None,
    ) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._loop_thread = _LoopThread()
        self._loop = self._loop_thread.loop
        try:
            self.client, self.driver = self._run(
                _start(config, entry_module, scale_timeouts, self.outputs)
            )
        except BaseException:
            self._loop_thread.stop()
            raise
        self._loop_thread.client, self._loop_thread.driver = self.client, self.driver
        # Holds the loop thread, not self: a dropped facade is collected and stops all.
        self._finalizer = weakref.finalize(self, self._loop_thread.close)

    # ------------------------------------------------------------------ crossing over

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def call_on_loop(self, fn: Callable[[], R]) -> R:
        """``fn()`` on the loop thread (the client's sockets live there)."""

        async def call() -> R:
            return fn()

        return self._run(call())

    # ------------------------------------------------------------------ EngineCoreClient

    def add_request(self, request: EngineCoreRequest) -> None:
        self.call_on_loop(lambda: self.client.add_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._finalizer.alive:
            self.call_on_loop(lambda: self.client.abort_requests(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        outs = self.outputs.get()
        if outs.engine_dead:
            self.outputs.put(outs)  # keep failing later callers too
            raise EngineDeadError(outs.dead_reason or "engine died")
        return outs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.call_utility_on(self.engine_ids[0], method, *args)

    def call_utility_on(
        self, engine: int, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S
    ) -> Any:
        call = self.client.call_utility_async(method, *args, engine=engine, timeout_s=timeout_s)
        return self._run(call)  # the call itself times out

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every live rank (e.g. ``pause`` / ``resume``)."""
        return self._run(self.client.call_utility_all_async(method, *args))

    # ------------------------------------------------------------------ what tests read

    @property
    def engine_ids(self) -> list[int]:
        return self.client.engine_ids

    @property
    def topology(self) -> Any:
        return self.client.topology

    @property
    def manager(self) -> Any:
        return self.client.manager

    @property
    def coordinator(self) -> Any:
        return self.client.coordinator

    @property
    def dp(self) -> Any:
        return self.client.dp

    @property
    def request_book(self) -> Any:
        return self.client.request_book

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def dropped(self) -> Any:
        return self.client.dropped

    def fault_status(self) -> dict[str, Any]:
        """Rank deaths and their recoveries, as ``AsyncLLM.fault_status`` reports them."""
        return self.call_on_loop(lambda: fault_status(self.client, self.driver))

    def scaling_history(self) -> list[dict[str, Any]]:
        driver = self.driver
        return [] if driver is None else self.call_on_loop(driver.history)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the engines and the loop thread. Idempotent."""
        self._finalizer()


async def _start(
    config: EngineConfig,
    entry_module: str | None,
    timeouts: ScaleTimeouts | None,
    outputs: queue.Queue[EngineCoreOutputs],
) -> tuple[AsyncMPClient, ScaleDriver | None]:
    """On the loop: the client, its driver (when the deployment reconfigures itself, as
    ``AsyncLLM.drives_reconfiguration``) and the task that pumps outputs to ``outputs``."""
    client = AsyncMPClient(config, entry_module)  # blocks this loop: nothing else runs yet
    driver: ScaleDriver | None = None
    try:
        if config.parallel.reconfigurable:
            driver = ScaleDriver.for_client(config, client, timeouts)
        client.start()  # outputs, heartbeats and liveness from now on
        if driver is not None:
            driver.start()  # rank deaths are recovered from from now on
    except BaseException:
        client.shutdown()
        raise
    asyncio.get_running_loop().create_task(_pump_outputs(client, outputs))
    return client, driver


async def _pump_outputs(client: AsyncMPClient, outputs: queue.Queue[EngineCoreOutputs]) -> None:
    """Engine outputs to the caller's queue; the client's death ends it with an
    ``engine_dead`` batch (``get_output`` raises on it)."""
    while True:
        try:
            outs = await client.get_output_async()
        except EngineDeadError as e:
            outputs.put(EngineCoreOutputs(engine_dead=True, dead_reason=str(e)))
            return
        outputs.put(outs)


class _LoopThread:
    """The event loop on its daemon thread and what runs on it; ``close`` stops the
    driver, the client and the loop (the facade's finalizer: it must not refer back to
    the facade)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="engine-client-loop", daemon=True
        )
        self.thread.start()
        self.client: AsyncMPClient | None = None
        self.driver: ScaleDriver | None = None

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        client, driver = self.client, self.driver

        async def close() -> None:
            if driver is not None:
                driver.close()
            if client is not None:
                client.shutdown()
            # Let every task of this loop unwind before the loop goes.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(SHUTDOWN_TIMEOUT_S)
        finally:
            self.stop()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()
