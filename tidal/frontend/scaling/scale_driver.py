"""The scale driver: the asyncio I/O shell that carries out what the pure
``ScaleController`` (``tidal.frontend.scaling.scale_controller``) decides (docs/architecture.md#elastic).

One task on the event loop owns the controller. Everything that reaches it goes through
one queue, so the controller sees one event at a time, in arrival order:

- admissions (``scale()``), answered at once when they start nothing (a duplicate, a
  conflict, a plan error, nothing to do), else when the operation's ``RecordResult`` runs;
- ``ScaleReport``s, read by the client from the engines' output socket (``on_report``);
- engine exits: the process monitor's (``on_exit``, for the engines ``owns_engine``
  claims: joiners, leavers, engines no longer serving) and those of ``StopEngines``;
- ``EngineStarted`` / ``EngineExited`` from the joiners' startup handshake;
- ``RequestsMigrated`` after a ``MigrateRequests``;
- a tick at ``controller.next_deadline()``.

Actions run in the order the controller returned them. Quick ones run inline (routing,
topology, SCALE frames -- retried briefly while a joiner's input route appears --,
migration); the blocking ones run on a worker thread in the background and report back
as events: ``SpawnEngines`` (start the processes, then ``wait_for_joiners`` ->
``EngineStarted`` each, or ``EngineExited`` naming the one that failed) and
``StopEngines`` (stop, reap -> ``EngineExited`` each).

Each operation gets a fresh ``TCPStore`` for its standby groups (``store_address`` of the
new topology). A rolled-back operation's store is destroyed at once (joiners stuck in a
rendezvous fail fast); a committed one's stays while its topology is the served one (the
live groups were made on it) and goes when the next operation commits; an operation
whose outcome is unknown keeps it until the outcome is learnt.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

from tidal.config import EngineConfig
from tidal.distributed.groups import serve_store
from tidal.elastic.plan import expert_nbytes
from tidal.frontend.liveness_monitor import ScaleHooks
from tidal.frontend.scaling.scale_controller import ScaleController
from tidal.frontend.scaling.scale_events import (
    Action,
    AdmitScale,
    EngineExited,
    EngineStarted,
    Event,
    ExcludeFromRouting,
    FailDeployment,
    MigrateRequests,
    PublishTopology,
    RecordResult,
    RequestsMigrated,
    RestoreRouting,
    SendAbort,
    SendCommit,
    SendPrepare,
    SpawnEngines,
    StopEngines,
)
from tidal.frontend.scaling.scale_records import (
    Admission,
    OperationRecord,
    ScalePhase,
    ScaleRequest,
    ScaleResponse,
    ScaleTimeouts,
    fault_summary,
)
from tidal.layers.quant import quant_method_from_config
from tidal.models.registry import get_model_class
from tidal.protocol.elastic import ScaleMessage, ScaleReport
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------ what it drives


class ScaleClient(Protocol):
    """What the driver needs from the engine client (``AsyncMPClient``)."""

    @property
    def topology(self) -> Topology: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the deployment is dead (no scaling then), or None."""
        ...

    def start(self) -> None:
        """Start reading the engines' outputs (the scale reports arrive there)."""
        ...

    def set_topology(self, topology: Topology) -> None: ...

    def exclude_from_routing(self, engine_ids: Iterable[int]) -> None: ...

    def restore_routing(self, engine_ids: Iterable[int]) -> None: ...

    async def send_scale(self, engine_ids: Iterable[int], message: ScaleMessage) -> list[int]: ...

    def migrate(self, engine_id: int, request_ids: Iterable[str] | None = None) -> int: ...

    def fail_deployment(self, reason: str) -> None: ...


class ScaleProcesses(Protocol):
    """What the driver needs from the engine process manager (``EngineProcManager``);
    the blocking calls run on a worker thread."""

    def spawn(self, engine_ids: Iterable[int], topology: Topology) -> None: ...

    def wait_for_joiners(self, engine_ids: Iterable[int], timeout_s: float) -> None: ...

    def stop(
        self, engine_ids: Iterable[int], *, force: bool = False, timeout_s: float = 10.0
    ) -> Any: ...


# A fresh TCPStore server for one operation: (the object that keeps it alive, "host:port").
StoreFactory = Callable[[], tuple[Any, str]]


def tcp_store_factory(host: str) -> StoreFactory:
    """Host each operation's store on ``host`` (the DP address), on a free port."""

    def make() -> tuple[Any, str]:
        store = serve_store(host)  # listens on ``host`` only, not every interface
        return store, f"{host}:{store.port}"

    return make


def expert_sizes(config: EngineConfig) -> tuple[int, int]:
    """(number of logical experts, bytes of one expert over all MoE layers) of the model
    as the ranks hold it, which is what a transfer moves: ``w13 [2I, H]`` and ``w2 [H, I]``
    per MoE layer, in the model's dtype or quantized with their scales (an FP8 expert is
    about half a bf16 one), and the biases where the experts have them."""
    mc = config.model
    spec = get_model_class(mc.architecture).spec_from_config(mc.hf_config)
    num_moe_layers = sum(spec.moe_layer_mask)
    hidden, inter = spec.hidden_size, spec.moe_intermediate_size
    dtype_bytes = mc.torch_dtype.itemsize
    quant = quant_method_from_config(mc.hf_config, mc.model, mc.quantization)
    if quant is None:
        nbytes = expert_nbytes(hidden, inter, num_moe_layers, dtype_bytes)
    else:
        layer = quant.held_bytes(2 * inter, hidden) + quant.held_bytes(hidden, inter)
        nbytes = layer * num_moe_layers
    if spec.expert_bias:  # GPT-OSS: b13 [2I] and b2 [H], in the model's dtype
        nbytes += (2 * inter + hidden) * dtype_bytes * num_moe_layers
    return spec.num_experts, nbytes


def controller_for(
    config: EngineConfig, topology: Topology, timeouts: ScaleTimeouts | None = None
) -> ScaleController:
    """The controller of a deployment serving ``topology`` with this model and config."""
    num_experts, bytes_per_expert = expert_sizes(config)
    cores = len(os.sched_getaffinity(0)) if config.device == "cpu" else None
    return ScaleController(
        topology,
        num_experts,
        config.parallel.num_redundant_experts,
        bytes_per_expert=bytes_per_expert,
        timeouts=timeouts,
        cpu_cores=cores,
        recover=config.parallel.recovers_ranks,
        restore_size=topology.size if config.parallel.elastic_restore else None,
    )


# ------------------------------------------------------------------------------ driver


@dataclass
class _Admit:
    request: ScaleRequest
    reply: asyncio.Future  # (ScaleResponse, waiter future | None)


class _Tick:
    pass


def _log_own_admission(reply: asyncio.Future) -> None:
    if reply.cancelled():
        return
    e = reply.exception()
    if e is not None:
        logger.warning("scale driver: own operation not admitted: %s", e)
        return
    resp, _ = reply.result()
    rec = resp.record
    if resp.admission is Admission.STARTED:
        logger.warning(
            "scale driver: %s %s started: %d -> %d engines (dead %s)",
            rec.trigger,
            rec.operation_id,
            rec.from_size,
            rec.to_size,
            rec.dead,
        )


_TICK = _Tick()

# What the driver's queue carries: admissions, the deadline tick, the controller's events.
_Item = _Admit | _Tick | Event

Listener = Callable[[dict[str, Any]], None]


class ScaleDriver:
    """Runs elastic EP operations: admits them, feeds the controller, executes its actions.

    Public API (event-loop thread only): ``await scale(new_size, drain_timeout_s,
    operation_id) -> ScaleResponse``, ``is_scaling``, ``history()``, ``add_listener(cb)``
    (``cb(record_dict)`` on every ``RecordResult``: the metrics), ``close()``. The client
    calls ``on_report`` / ``owns_engine`` / ``on_exit`` (``hooks()``)."""

    def __init__(
        self,
        controller: ScaleController,
        client: ScaleClient,
        processes: ScaleProcesses,
        *,
        make_store: StoreFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.controller = controller
        self.client = client
        self.processes = processes
        self._make_store = make_store
        self._clock = clock
        self._stop_timeout_s = stop_timeout_s
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task] = set()
        self._waiters: dict[str, asyncio.Future] = {}
        self._listeners: list[Listener] = []
        self._stores: dict[str, tuple[Any, str]] = {}  # operation id -> its store
        self._current_store: tuple[Any, str] | None = None  # the served topology's
        self._stopping: set[int] = set()  # every engine id it asked to stop
        self._gone: set[int] = set()  # exits seen by the monitor (before the loop has them)
        self._closed = False

    @classmethod
    def for_client(
        cls, config: EngineConfig, client: Any, timeouts: ScaleTimeouts | None = None
    ) -> ScaleDriver:
        """The driver of an ``AsyncMPClient`` (and its process manager), hooked into it."""
        driver = cls(
            controller_for(config, client.topology, timeouts),
            client,
            client.manager,
            make_store=tcp_store_factory(config.parallel.data_parallel_address),
        )
        client.set_scale_hooks(driver.hooks())
        return driver

    # ------------------------------------------------------------------ public API

    @property
    def is_scaling(self) -> bool:
        return self.controller.is_scaling

    def history(self) -> list[dict[str, Any]]:
        """Every operation the controller remembers (bounded), oldest first; a running one
        is last, with its current phase."""
        return [r.to_dict() for r in self.controller.history.values()]

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def scale(
        self,
        new_size: int,
        drain_timeout_s: float = 0.0,
        operation_id: str | None = None,
    ) -> ScaleResponse:
        """Run one operation to its end and return its record (``status_code`` 200), or
        answer at once: a repeated ``operation_id`` (its first record, finished or not),
        another operation running (409), nothing to do. ``ScalePlanError`` (a
        ``ValueError``: HTTP 400) for a request that cannot be served."""
        if self._closed:
            raise EngineDeadError("the scale driver is shut down")
        dead = self.client.dead_reason
        if dead is not None:
            raise EngineDeadError(dead)
        self._ensure_running()
        loop = asyncio.get_running_loop()
        reply: asyncio.Future = loop.create_future()
        self._post(_Admit(ScaleRequest(new_size, drain_timeout_s, operation_id), reply))
        resp, waiter = await reply
        if waiter is None:
            return resp
        record = await asyncio.shield(waiter)
        return ScaleResponse(resp.admission, record)

    def start(self) -> None:
        """Run the driver's task on the running loop now: engine exits and reports are
        handled from here on (a rank death may come before any scale call)."""
        if not self._closed:
            self._ensure_running()

    def close(self) -> None:
        """Stop driving: cancel the task and the background work, fail the callers still
        waiting, drop the stores. The engines are the client's to stop."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for t in [self._task, *self._background]:
            if t is not None and not t.done():
                t.cancel()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError("the deployment shut down during scaling"))
        self._waiters.clear()
        self._stores.clear()
        self._current_store = None

    # ------------------------------------------------------------------ client hooks

    def hooks(self) -> ScaleHooks:
        return ScaleHooks(self.on_report, self.owns_engine, self.on_exit)

    def on_report(self, report: ScaleReport) -> None:
        self._post(report)

    def owns_engine(self, engine_id: int) -> bool:
        """Whether an exit of ``engine_id`` is this driver's event rather than a rank
        death that fails the client: an engine joining or leaving in the running (or
        unresolved) operation, one being stopped, or one not serving at all (a joiner of
        a rolled-back operation, an engine that left)."""
        if engine_id in self._stopping:
            return True
        c = self.controller
        rec = c.current
        if rec is not None and (engine_id in rec.joining or engine_id in rec.leaving):
            return True
        if engine_id not in c.topology:
            return True
        # A member: a rank death the controller recovers from, while another can serve.
        others = set(c.live_members) - self._gone - {engine_id}
        return c.recover and bool(others)

    def on_exit(self, engine_id: int, exitcode: int | None, cause: str | None = None) -> None:
        """The monitor saw ``engine_id`` exit, or its heartbeats stop (an engine
        ``owns_engine`` claimed)."""
        if self._closed:
            return
        self._gone.add(engine_id)
        exited = EngineExited(engine_id, cause or f"exited with code {exitcode}")
        self._background_task(self._reap(engine_id, then=exited))

    async def _reap(self, engine_id: int, then: EngineExited | None = None) -> None:
        """An engine that exited on its own: reap and forget its process (the controller
        may never ask to stop it: it is already gone), then post ``then``. The controller
        learns of the exit only once the process is forgotten, so an operation it ends
        (a leaving engine's exit finishes a scale-down) never answers while the process
        is still listed."""
        try:
            await asyncio.to_thread(self.processes.stop, (engine_id,), force=True, timeout_s=5.0)
        except Exception:  # noqa: BLE001
            logger.exception("scale driver: reaping engine %d failed", engine_id)
        finally:
            if then is not None:
                self._post(then)

    # ------------------------------------------------------------------ the loop

    def _ensure_running(self) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
        if (self._task is None or self._task.done()) and not self._closed:
            self.client.start()  # reports arrive on the client's output reader
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _post(self, item: _Item) -> None:
        if self._closed:
            return
        self._ensure_running()
        assert self._queue is not None
        self._queue.put_nowait(item)

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            item = await self._queue.get()
            try:
                await self._process(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the driver must outlive a bad event
                logger.exception("scale driver: handling %r failed", item)
            self._arm_tick()

    async def _process(self, item: _Item) -> None:
        c = self.controller
        match item:
            case _Admit():
                await self._admit(item)
            case _Tick():
                await self._execute(c.tick(self._clock()))
            case EngineStarted() | EngineExited() | RequestsMigrated() | ScaleReport():
                if isinstance(item, EngineExited) and item.engine_id in c.topology:
                    # A member gone (dead, or leaving): no new request goes there from now
                    # on -- before its requests migrate, so none is routed to it after.
                    self.client.exclude_from_routing((item.engine_id,))
                await self._execute(c.handle(item, self._clock()))
            case _:
                assert_never(item)

    def _arm_tick(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.controller.next_deadline()
        if deadline is None or not math.isfinite(deadline) or self._closed:
            return
        delay = max(0.0, deadline - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._post, _TICK)

    async def _admit(self, item: _Admit) -> None:
        c = self.controller
        store: tuple[Any, str] | None = None
        try:
            if not c.is_scaling and self._make_store is not None:
                store = self._make_store()
            resp, actions = c.request_scale(
                item.request, self._clock(), store_address=None if store is None else store[1]
            )
        except Exception as e:  # noqa: BLE001 - ScalePlanError (400) or no store: the caller's
            c.admission_failed(item.request, self._clock())
            if not item.reply.done():
                item.reply.set_exception(e)
            return
        rec = resp.record
        waiter: asyncio.Future | None = None
        if resp.admission is Admission.STARTED and not rec.done:
            if store is not None:
                self._stores[rec.operation_id] = store
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[rec.operation_id] = waiter
        if not item.reply.done():
            item.reply.set_result((resp, waiter))
        await self._execute(actions)

    # ------------------------------------------------------------------ actions

    async def _execute(self, actions: list[Action]) -> None:
        for a in actions:
            try:
                await self._do(a)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next actions still run (rollbacks!)
                logger.exception("scale driver: %s failed", type(a).__name__)

    async def _do(self, a: Action) -> None:
        match a:
            case AdmitScale():
                # The controller's own operation (a recovery, a restore): admitted in turn,
                # through the same path as a caller's; nobody awaits its reply.
                reply = asyncio.get_running_loop().create_future()
                reply.add_done_callback(_log_own_admission)
                self._post(_Admit(a.request, reply))
            case FailDeployment():
                logger.error("scale driver: %s", a.reason)
                self.client.fail_deployment(a.reason)
            case SpawnEngines():
                await self._spawn(a)
            case ExcludeFromRouting():
                self.client.exclude_from_routing(a.engine_ids)
            case RestoreRouting():
                self.client.restore_routing(a.engine_ids)
            case SendPrepare() | SendCommit() | SendAbort():
                unreachable = await self.client.send_scale(a.engine_ids, a.message)
                if unreachable:
                    logger.warning(
                        "scale %s: engines %s unreachable for %s",
                        a.message.operation_id,
                        unreachable,
                        type(a.message).__name__,
                    )
            case PublishTopology():
                self.client.set_topology(a.topology)
                self._adopt_store(a.topology)
            case StopEngines():
                self._stopping.update(a.engine_ids)
                self._background_task(self._stop(a))
            case MigrateRequests():
                n = self.client.migrate(a.engine_id, a.request_ids)
                self._post(RequestsMigrated(a.engine_id, n, a.operation_id))
            case RecordResult():
                self._record(a.record)
            case _:
                assert_never(a)

    def _background_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _spawn(self, a: SpawnEngines) -> None:
        try:
            await asyncio.to_thread(self.processes.spawn, a.engine_ids, a.topology)
        except Exception as e:  # noqa: BLE001 - reported as the engine's failure
            failed = getattr(e, "engine_id", a.engine_ids[0])
            self._post(EngineExited(failed, f"could not be started: {e}"))
            self._stopping.add(failed)
            self._background_task(self._reap(failed))
            return
        self._background_task(self._await_joiners(a.engine_ids))

    async def _await_joiners(self, engine_ids: tuple[int, ...]) -> None:
        # The controller's own deadline (STARTING_ENGINES) fires first and stops them,
        # which ends this wait too; this bound is only a backstop.
        timeout = self.controller.timeouts.start_engines_s + 10.0
        try:
            await asyncio.to_thread(self.processes.wait_for_joiners, engine_ids, timeout)
        except Exception as e:  # noqa: BLE001 - EngineStartError names the engine
            failed = getattr(e, "engine_id", None)
            failed = engine_ids[0] if failed is None else failed
            self._post(EngineExited(failed, str(e)))
            # The controller counts it gone: make it so (it may still run, e.g. after a
            # READY with an error or a config mismatch).
            self._stopping.add(failed)
            await self._reap(failed)
            return
        for e in engine_ids:
            self._post(EngineStarted(e))

    async def _stop(self, a: StopEngines) -> None:
        timeout = 5.0 if a.force else self._stop_timeout_s
        try:
            await asyncio.to_thread(
                self.processes.stop, a.engine_ids, force=a.force, timeout_s=timeout
            )
        except Exception:  # noqa: BLE001 - still report them gone: nothing else would
            logger.exception("scale driver: stopping engines %s failed", a.engine_ids)
        for e in a.engine_ids:
            self._post(EngineExited(e, f"stopped: {a.reason}"))

    def _record(self, rec: OperationRecord) -> None:
        waiter = self._waiters.pop(rec.operation_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(rec)
        unresolved = rec.phase is ScalePhase.FAILED and rec.resolution is None
        if not unresolved:
            # Rolled back (or resolved as such): destroyed now, so joiners stuck in a
            # rendezvous on it fail fast. A committed one was adopted by PublishTopology.
            self._stores.pop(rec.operation_id, None)
        record = rec.to_dict()
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop scaling
                logger.exception("scale listener failed")

    def _adopt_store(self, topology: Topology) -> None:
        """The served topology's store is kept; the one it replaces is dropped."""
        for op_id, store in list(self._stores.items()):
            if store[1] == topology.store_address:
                del self._stores[op_id]
                self._current_store = store
                return


def fault_status(client: ScaleClient, driver: ScaleDriver | None) -> dict[str, Any]:
    """Rank deaths and their recoveries (docs/architecture.md#faults), for ``/health``,
    ``/stats``, the metrics and ``LLM``: ``degraded`` (why it serves below full health, or
    None), ``rank_deaths``, ``recovered``, ``recovery_s_last``, ``dead``, ``failed_groups``
    and ``deaths`` (one record each), ``serving_engines`` (live members; none once the
    deployment is dead) and ``coordinator_restarts``. None recorded where no driver runs.
    On the client's loop."""
    if driver is None:
        status = fault_summary()
        serving = client.topology.size
    else:
        status = driver.controller.faults()
        serving = len(driver.controller.live_members)
    status["serving_engines"] = 0 if client.dead_reason is not None else serving
    coordinator = getattr(client, "coordinator", None)  # None (or absent) below DP 2
    status["coordinator_restarts"] = getattr(coordinator, "restarts", 0)
    return status
