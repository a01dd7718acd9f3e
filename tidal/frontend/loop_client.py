"""The blocking client of a deployment that reconfigures itself, for the offline ``LLM``:
rank recovery (any data-parallel deployment, docs/architecture.md#faults) and elastic EP.

It runs the server's machinery unchanged -- an ``AsyncMPClient`` and its ``ScaleDriver``
-- on an event loop of its own, on a daemon thread, so an offline deployment survives a
rank death exactly as the server does: the same liveness checks, recovery operations,
request migration and coordinator restarts, no second implementation of any of them.
The caller's thread reaches the loop through ``run_coroutine_threadsafe`` (each call waits
for its result, so errors such as a request that cannot be encoded reach the caller);
outputs come back on a thread-safe queue fed by a task on the loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tidal.config import EngineConfig
from tidal.frontend.async_client import AsyncMPClient
from tidal.frontend.core_client import EngineCoreClient
from tidal.frontend.scaling.scale_driver import ScaleDriver
from tidal.frontend.scaling.scale_records import ScaleTimeouts
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest

R = TypeVar("R")

# A utility call's answer; the engines answer within milliseconds unless they are busy.
UTILITY_TIMEOUT_S = 60.0


class LoopThreadClient(EngineCoreClient):
    """``EngineCoreClient`` over an ``AsyncMPClient`` + ``ScaleDriver`` on a loop thread."""

    def __init__(
        self,
        config: EngineConfig,
        entry_module: str | None = None,
        scale_timeouts: ScaleTimeouts | None = None,
    ) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-client-loop", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._lock = threading.Lock()
        self.driver: ScaleDriver | None = None
        try:
            self.client: AsyncMPClient = self._run(
                self._start(config, entry_module, scale_timeouts)
            )
        except BaseException:
            self._stop_loop()
            raise

    async def _start(
        self, config: EngineConfig, entry_module: str | None, timeouts: ScaleTimeouts | None
    ) -> AsyncMPClient:
        client = AsyncMPClient(config, entry_module)  # blocks this loop: nothing else runs yet
        try:
            driver = ScaleDriver.for_client(config, client, timeouts)
            client.start()  # outputs, heartbeats and liveness from now on
            driver.start()  # rank deaths are recovered from from now on
        except BaseException:
            client.shutdown()
            raise
        self.driver = driver
        self._pump = asyncio.get_running_loop().create_task(self._pump_outputs(client))
        return client

    async def _pump_outputs(self, client: AsyncMPClient) -> None:
        """Engine outputs to the caller's queue; the client's death ends it with an
        ``engine_dead`` batch (``get_output`` raises on it)."""
        while True:
            try:
                outs = await client.get_output_async()
            except EngineDeadError as e:
                self.outputs.put(EngineCoreOutputs(engine_dead=True, dead_reason=str(e)))
                return
            self.outputs.put(outs)

    # ------------------------------------------------------------------ crossing over

    def _run(self, coro: Any, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _call(self, fn: Callable[[], R]) -> R:
        """``fn()`` on the loop thread (the client's sockets live there)."""

        async def call() -> R:
            return fn()

        return self._run(call())

    # ------------------------------------------------------------------ EngineCoreClient

    def add_request(self, request: EngineCoreRequest) -> None:
        self._call(lambda: self.client.add_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed:
            self._call(lambda: self.client.abort_requests(request_ids))

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
        return self._run(self.client.call_utility_async(method, *args, engine=engine), timeout_s)

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

    def fault_status(self) -> dict[str, Any]:
        """Rank deaths and their recoveries (as ``AsyncLLM.fault_status``)."""
        assert self.driver is not None
        return self._call(self.driver.controller.faults)

    def scaling_history(self) -> list[dict[str, Any]]:
        assert self.driver is not None
        return self._call(self.driver.history)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the engines and the loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():

            async def close() -> None:
                if self.driver is not None:
                    self.driver.close()
                self.client.shutdown()
                # Let every task of this loop unwind before the loop goes.
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self._run(close(), 60)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
