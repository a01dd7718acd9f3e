"""The engine client (docs/architecture.md#frontend-client): one asyncio client for every
multiprocess deployment. The API server's ``AsyncLLM`` runs it on its event loop; the
offline ``LLM`` runs the same client on a loop thread (``loop_client.LoopThreadClient``),
so both see rank deaths, frozen engines and reader failures alike.

``AsyncMPClient`` is composed of parts, each a class in a module of its own:
``EngineTransport`` (``transport``: sockets, CURVE), ``Router`` (``router``: engine
choice, pinned ranks, the wave), ``Migrator`` (``migrator``: the request book, requests
moved off an engine) and ``LivenessMonitor`` (``liveness_monitor``: heartbeats, engines
declared dead, the coordinator's restarts, engine exits). Its ``__init__`` only orders
them, with the engine processes (``EngineProcManager``) and the DP coordinator. What is
its own: the readers (outputs, load snapshots) and the output queue, utility calls in
flight, and the failure (``_fail``: every pending request and call gets
``EngineDeadError``).

The reader tasks never die silently: a frame that does not decode is dropped, counted
(``dropped``) and logged; any other failure of a reader fails the client at once instead
of leaving requests waiting for outputs nobody reads.

Rank recovery and elastic EP (``ParallelConfig.reconfigurable``) add what the scale driver
(``tidal.frontend.scaling.scale_driver``) executes through the client: ``set_topology``,
``exclude_from_routing`` / ``restore_routing``, ``send_scale`` and ``migrate``; its
``ScaleHooks`` receive the engines' scale reports and the exits it owns.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from tidal.config import EngineConfig
from tidal.distributed.ports import get_open_port
from tidal.dp_coordinator.handle import DPCoordinator, fetch_stats_async
from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.launchers.base import Launcher
from tidal.frontend.launchers.proc_manager import (
    EngineProcManager,
    FrontendAddresses,
    frontend_addresses,
    ipc_dir,
)
from tidal.frontend.launchers.registry import make_launcher
from tidal.frontend.liveness import COORDINATOR_HEARTBEAT_S
from tidal.frontend.liveness_monitor import LivenessMonitor, ScaleHooks
from tidal.frontend.migrator import Migrator
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.elastic import ScaleMessage
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    DPCoordinatorStats,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
    encode,
)
from tidal.protocol.topology import Topology
from tidal.utils.dropped import DropCounter

logger = logging.getLogger(__name__)

OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
# A joining engine registers its input route before it loads the model, so the route
# exists long before its READY; this only covers a slow connect.
SCALE_SEND_RETRY_S = 5.0
# A utility call's answer; the engines answer within milliseconds unless they are busy.
UTILITY_TIMEOUT_S = 60.0


def _place_frontend(
    config: EngineConfig, entry_module: str | None
) -> tuple[Launcher, EngineConfig]:
    """Where the engine ranks run (docs/architecture.md#launchers) and the address this
    frontend is reached at there; the process manager owns the launcher once made."""
    launcher = make_launcher(config, entry_module)
    host = launcher.frontend_host(config.parallel.data_parallel_address)
    return launcher, config.with_parallel(data_parallel_address=host)


def _dp_rendezvous(config: EngineConfig) -> tuple[EngineConfig, Topology]:
    """With DP, the master port (the configured one, else a free one) that the launch
    topology's store address names. The launch topology: engine ids 0..N-1 in rank order;
    every engine gets it in the handshake and takes its DP/EP rank and group size from
    it, not from the config."""
    par = config.parallel
    store = None
    if par.is_data_parallel:
        port = par.data_parallel_master_port or get_open_port(par.data_parallel_address)
        config = config.with_parallel(data_parallel_master_port=port)
        store = f"{par.data_parallel_address}:{port}"
    topology = Topology.initial(
        par.data_parallel_size, store_address=store, tp_size=par.tensor_parallel_size
    )
    return config, topology


def _start_coordinator(
    config: EngineConfig, topology: Topology, transport: EngineTransport
) -> DPCoordinator | None:
    """With DP, the coordinator process, and the transport connected to it."""
    par = config.parallel
    if not par.is_data_parallel:
        return None
    coordinator = DPCoordinator(
        topology,
        transport.addresses.coordinator,
        heartbeat_interval_s=COORDINATOR_HEARTBEAT_S,
        auth_key=par.data_parallel_auth_key if transport.curve else None,
    )
    transport.connect_coordinator(coordinator.addresses)
    return coordinator


def _engine_manager(
    config: EngineConfig,
    topology: Topology,
    transport: EngineTransport,
    launcher: Launcher,
    coordinator: DPCoordinator | None,
) -> EngineProcManager:
    """The process manager, its ranks started (READY is ``wait_for_ready``'s)."""
    addrs = coordinator.addresses if coordinator is not None else None
    return EngineProcManager(
        config,
        topology,
        transport.sync_ctx,
        input_address=transport.addresses.input,
        output_address=transport.output_address,
        handshake_address=transport.addresses.handshake,
        coordinator_addresses=(
            (addrs.engine_publish, addrs.engine_input) if addrs is not None else (None, None)
        ),
        local_engines=launcher.launch_ranks(topology.engine_ids),
        curve=transport.curve,
        launcher=launcher,
    )


class PendingCalls:
    """Utility calls in flight: each call's future and target engine (event loop's
    thread)."""

    def __init__(self) -> None:
        self._ids = iter(range(1, 1 << 62))
        self._futures: dict[int, asyncio.Future[UtilityOutput]] = {}
        self._targets: dict[int, int] = {}  # call id -> engine id

    def open(self, method: str, args: tuple, engine: int) -> tuple[UtilityRequest, asyncio.Future]:
        call = UtilityRequest(0, next(self._ids), method, list(args))
        fut: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = fut
        self._targets[call.call_id] = engine
        return call, fut

    def close(self, call_id: int) -> None:
        self._futures.pop(call_id, None)
        self._targets.pop(call_id, None)

    def answer(self, out: UtilityOutput) -> None:
        fut = self._futures.pop(out.call_id, None)
        self._targets.pop(out.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(out)

    def fail_engine(self, engine_id: int, reason: str) -> None:
        """The calls waiting on ``engine_id`` fail (it is gone)."""
        for call_id, target in list(self._targets.items()):
            if target == engine_id:
                self._fail(call_id, reason)

    def fail_all(self, reason: str) -> None:
        for call_id in list(self._futures):
            self._fail(call_id, reason)

    def _fail(self, call_id: int, reason: str) -> None:
        self._targets.pop(call_id, None)
        fut = self._futures.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(EngineDeadError(reason))


class AsyncMPClient:
    """The engine client: transport, router, migrator and liveness monitor, the engine
    processes and the DP coordinator; outputs arrive on an asyncio queue.

    Everything that sends or changes state runs on the event loop's thread (the
    server's, or the loop thread of ``LoopThreadClient``), so no part needs a lock."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        # Only orders the parts; each is made by a function or class of its own.
        launcher, config = _place_frontend(config, entry_module)
        config, launch = _dp_rendezvous(config)
        self.config = config
        par = config.parallel
        ipc = ipc_dir()
        self.transport = EngineTransport(frontend_addresses(config, ipc), ipc, par)
        # Rank recovery / elastic EP: every engine request sent, its owner and outputs.
        book = RequestBook(0, config.model.max_model_len) if par.reconfigurable else None
        dp = DPFrontendState(launch, par.dp_lb_policy) if par.is_data_parallel else None
        self.router = Router(self.transport, launch, dp, book)
        self.migrator = Migrator(book, self.router, _weak_callback(self._deliver_injected))
        self.calls = PendingCalls()
        self.dropped = DropCounter("frontend client", logger)  # undecodable frames
        self._queue: asyncio.Queue[EngineCoreOutputs] | None = None  # made with the readers
        self._readers: list[asyncio.Task] = []
        self._closed = False
        self.coordinator: DPCoordinator | None = None
        self.manager: EngineProcManager | None = None
        try:
            self.transport.open()
            self.coordinator = _start_coordinator(config, launch, self.transport)
            self.manager = _engine_manager(
                config, launch, self.transport, launcher, self.coordinator
            )
            self.manager.wait_for_ready(self.input_socket)  # a failure: the manager closes
        except BaseException:
            if self.manager is None:
                launcher.close()  # the manager closes it once it has it
            self._close_resources()
            raise
        self.monitor = LivenessMonitor(
            self.router,
            self.manager,
            self.coordinator,
            stall_s=par.engine_stall_timeout,
            fail=_weak_callback(self._fail),
            fail_calls_to=self.calls.fail_engine,
        )
        self.router.wake_route = self.monitor.wake_route
        # Released at shutdown(), when the client is garbage-collected, or at interpreter
        # exit, whichever comes first: a script that never calls shutdown() still exits.
        self._resources = _MPResources.of(self)
        self._finalizer = weakref.finalize(self, self._resources.close)
        self.manager.start_monitor(_weak_callback(self.monitor.on_engine_exit))

    # ------------------------------------------------------------------ the parts' state

    @property
    def dead_reason(self) -> str | None:
        """Why the client failed (every request and call then ends), or None."""
        return self.transport.dead_reason

    @property
    def input_socket(self) -> zmq.Socket:
        """The ROUTER to every engine (tests send raw frames on it, on the loop)."""
        sock = self.transport.input_socket
        assert sock is not None  # opened at startup
        return sock

    @property
    def addresses(self) -> FrontendAddresses:
        return self.transport.addresses

    @property
    def output_address(self) -> str:
        """Where engines send their outputs."""
        return self.transport.output_address

    @property
    def ipc_dir(self) -> str:
        return self.transport.ipc_dir

    @property
    def topology(self) -> Topology:
        """The live deployment (it follows reconfigurations)."""
        return self.router.topology

    @property
    def engine_ids(self) -> list[int]:
        """The engines requests can go to, in rank order."""
        return self.router.engine_ids

    @property
    def dp(self) -> DPFrontendState | None:
        """The DP routing state (None without the DP machinery)."""
        return self.router.dp

    @property
    def request_book(self) -> RequestBook | None:
        return self.migrator.book

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send an ADD. A request that cannot be encoded raises ``ValueError`` and leaves
        no trace (no rank holds it, no wake-up went out).

        A request pinned (``data_parallel_rank``) to a rank whose engine is dead raises
        ``RankUnavailableError`` (HTTP 503: the deployment recovers without it); one
        pinned to a rank that leaves (a scale-down drains it) goes where the balancer
        sends it, as that rank's own requests do. An engine that vanished between its
        death and our learning of it (no route to it) is skipped like a dead one."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.router.add_request(request)

    def check_pinned_rank(self, rank: int | None) -> bool:
        """``Router.check_pinned_rank``: False when the pinned rank leaves (the balancer
        chooses), ``RankUnavailableError`` when its engine is dead."""
        return self.router.check_pinned_rank(rank)

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_reason is not None or self._closed:
            return  # nothing runs any more (a generator cancelled at shutdown lands here)
        self.migrator.forget(request_ids)
        self.router.abort(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        queue = self._ensure_reader()
        if self.dead_reason is not None and queue.empty():
            raise EngineDeadError(self.dead_reason)
        outs = await queue.get()
        if outs.engine_dead:
            raise EngineDeadError(outs.dead_reason or "engine died")
        return outs

    # ------------------------------------------------------------------ utility calls

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        calls = [
            self.call_utility_async(method, *args, engine=e) for e in self.router.live_engine_ids()
        ]
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
        call, fut = self.calls.open(method, args, target)
        try:
            self.transport.send(target, EngineCoreRequestType.UTILITY, encode(call))
            out = await asyncio.wait_for(fut, timeout_s)
        finally:
            self.calls.close(call.call_id)
        if out.failure_message:
            raise RuntimeError(out.failure_message)
        return out.result

    async def get_dp_stats_async(self, timeout_s: float = 2.0) -> DPCoordinatorStats:
        """The coordinator's full stats (DP only)."""
        if self.coordinator is None:
            raise RuntimeError("no DP coordinator: the deployment has one rank")
        addr = self.coordinator.addresses.stats
        return await fetch_stats_async(addr, timeout_s, self.transport.curve)

    # ------------------------------------------------------------------ the readers

    def start(self) -> None:
        """Start reading outputs on the running loop (the scale driver needs the reports
        before any request was made), with the heartbeats and liveness."""
        self._ensure_reader()

    def _ensure_reader(self) -> asyncio.Queue[EngineCoreOutputs]:
        """Start the readers (and the liveness monitor) on the running loop once; the
        output queue they fill."""
        if self._queue is None:
            loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            outputs = self.transport.output_reader()
            self._readers.append(loop.create_task(self._read_outputs(outputs)))
            self.monitor.start()
            if self.coordinator is not None:
                snapshots = self.transport.snapshot_reader()
                self._readers.append(loop.create_task(self._read_snapshots(snapshots)))
        return self._queue

    async def _read_outputs(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frame = await sock.recv()
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
        self.monitor.heard(outs, time.monotonic())
        if outs.heartbeat:
            return
        if outs.utility_output is not None:
            self.calls.answer(outs.utility_output)
        elif outs.engine_dead:
            reason = outs.dead_reason or "engine reported a fatal error"
            if self.monitor.owns(outs.engine_id):
                # A joining or leaving engine: its exit (which follows) is the scale
                # driver's event, not a rank death.
                logger.warning("engine %d (scaling) died: %s", outs.engine_id, reason)
            else:
                self._fail(reason)
        elif self._on_outputs(outs):
            assert self._queue is not None  # made with this reader
            self._queue.put_nowait(outs)

    def _on_outputs(self, outs: EngineCoreOutputs) -> bool:
        """Bookkeeping of one batch from an engine; False when nothing in it is for the
        caller (a scale report alone: it went to the scale driver). With rank recovery or
        elastic EP, outputs of an engine that does not own their request are removed
        first."""
        report = outs.scale_report
        if report is not None:
            hooks = self.monitor.hooks
            if hooks is not None:
                try:
                    hooks.on_report(report)
                except Exception:  # noqa: BLE001 - the output reader must go on
                    logger.exception("scale report handler failed")
            else:
                logger.warning("scale report with no scale driver: %s", report)
        self.migrator.accept(outs)
        self.router.on_outputs(outs)
        return report is None or bool(outs.outputs) or outs.scheduler_stats is not None

    async def _read_snapshots(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frame = await sock.recv()
                self.monitor.snapshot_heard()
                try:
                    self.router.on_snapshot(frame)
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

    def _deliver_injected(self, outs: EngineCoreOutputs) -> None:
        """Outputs made here (the migrator's finishes), to the caller's queue."""
        self._ensure_reader().put_nowait(outs)

    def _fail(self, reason: str) -> None:
        """Nothing is sent any more; every request (an ``engine_dead`` batch on the
        queue) and every utility call ends with ``EngineDeadError``."""
        if self.transport.dead_reason is None:
            self.transport.dead_reason = reason
        if self._queue is not None:
            self._queue.put_nowait(EngineCoreOutputs(engine_dead=True, dead_reason=reason))
        self.calls.fail_all(reason)

    # ------------------------------------------------------------------ for the scale driver

    def set_scale_hooks(self, hooks: ScaleHooks | None) -> None:
        self.monitor.hooks = hooks

    def fail_deployment(self, reason: str) -> None:
        """Nothing can serve any more (the scale driver found every engine dead)."""
        self._fail(reason)

    def set_topology(self, topology: Topology) -> None:
        """A committed reconfiguration: tell the coordinator, route by ``topology``
        (balancer, wave state: the next request wakes the engines), answer later
        handshakes with it and move the ownership table to its epoch. Each receiver
        drops an older topology."""
        assert self.manager is not None  # started
        topology = self.router.set_topology(topology)
        self.manager.set_topology(topology)
        self.migrator.set_epoch(topology.epoch)

    def exclude_from_routing(self, engine_ids: Iterable[int]) -> None:
        """These engines get no automatically routed request (leaving in a scale-down)."""
        self.router.exclude(engine_ids)

    def restore_routing(self, engine_ids: Iterable[int]) -> None:
        self.router.restore(engine_ids)

    def migrate(self, engine_id: int, request_ids: Iterable[str] | None = None) -> int:
        """Resume requests of ``engine_id`` on other engines (``Migrator.migrate``):
        those named, or with None every one it still owns; how many moved or finished."""
        return self.migrator.migrate(engine_id, request_ids)

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
                and not self.transport.try_send(e, EngineCoreRequestType.SCALE, payload)
            ]
            if not pending or time.monotonic() >= deadline:
                return gone + pending
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the engines and release everything. Idempotent; also runs at interpreter
        exit if nobody called it (the reader tasks keep the client itself alive)."""
        for task in self._readers:
            if not task.done():
                task.cancel()
        self.monitor.stop()
        self.transport.stop_reading()
        self._close_resources()

    def _close_resources(self) -> None:
        """Release everything now (a failed start, or shutdown). Idempotent."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif not self._closed:
            _MPResources.of(self).close()
        self._closed = True


class _MPResources:
    """What the client must release, held apart from the client: the client's
    ``weakref.finalize`` closes it, so it must not refer back to the client (or the client
    could never be collected and a script that drops it would keep its engines)."""

    def __init__(
        self,
        ctx: zmq.Context,
        ipc_dir: str,
        manager: EngineProcManager | None,
        coordinator: DPCoordinator | None,
        sockets: list[zmq.Socket],
        authenticator: ThreadAuthenticator | None = None,
        sync_ctx: zmq.Context | None = None,
    ) -> None:
        self.ctx = ctx
        # The context objects sockets were made through (the startup sockets' sync shadow
        # of an asyncio context, and the context itself): each tracks its own.
        self.contexts = [ctx] if sync_ctx in (None, ctx) else [sync_ctx, ctx]
        self.ipc_dir = ipc_dir
        self.manager = manager
        self.coordinator = coordinator
        self.sockets = sockets
        self.authenticator = authenticator  # ZAP thread: stopped before the context ends
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def of(cls, client: AsyncMPClient) -> _MPResources:
        t = client.transport
        return cls(
            t.ctx,
            t.ipc_dir,
            client.manager,
            client.coordinator,
            t.sockets(),
            t.authenticator,
            t.sync_ctx,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.manager is not None:
            self.manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        for ctx in self.contexts:
            close_every_socket(ctx)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def close_every_socket(ctx: zmq.Context) -> None:
    """Close, linger 0, every socket made through ``ctx`` that is still open, also one
    that only a failed call's traceback still holds: ``term()`` waits for every socket of
    its context, for good. ``Context.destroy``'s walk without its ``term`` (a shadow must
    not end the context it shares)."""
    for sock in list(getattr(ctx, "_sockets", None) or ()):
        if sock is not None and not sock.closed:
            sock.close(linger=0)


def _weak_callback(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` without a strong reference to its object (for long-lived threads, and
    for the parts: none of them keeps the client alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
