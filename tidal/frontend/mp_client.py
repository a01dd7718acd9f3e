"""The engine client's transport, routing and migration (``MPClient``; its asyncio half,
``AsyncMPClient``, reads outputs and judges liveness): the frontend's sockets, the engine
processes, the DP coordinator, routing, and releasing all of it. ``__init__`` only
orders the concerns, each a function of its own: where the ranks run
(``_place_frontend``), the DP rendezvous (``_dp_rendezvous``), the sockets and CURVE
(``transport.EngineTransport``), the coordinator (``_start_coordinator``) and the
process manager (``_start_engines``).

Elastic EP (``--enable-elastic-ep``, docs/architecture.md#elastic), and rank recovery (any
data-parallel deployment unless ``--no-rank-recovery``: ``ParallelConfig.reconfigurable``)
add what the scale driver (``tidal.frontend.scaling.scale_driver``) executes through the client:
``set_topology`` (the coordinator, the balancer, the wave state, the process manager, the
ownership epoch), ``exclude_from_routing`` / ``restore_routing`` (leaving engines get no
new request), ``send_scale`` (SCALE frames) and ``migrate`` (resume an engine's requests
elsewhere). Then every engine request sent is recorded in a ``RequestBook``
(``tidal.frontend.request_book``): outputs of an engine that does not own the request are
dropped before they reach the caller. ``ScaleHooks`` route the engines' scale reports,
and the exits of engines in a scale operation, to the driver instead of failing the
client.
"""

from __future__ import annotations

import logging
import shutil
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from tidal.config import EngineConfig
from tidal.distributed.ports import get_open_port
from tidal.dp_coordinator.handle import DPCoordinator
from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.launchers.base import Launcher
from tidal.frontend.launchers.proc_manager import (
    EngineProcManager,
    FrontendAddresses,
    frontend_addresses,
    ipc_dir,
)
from tidal.frontend.launchers.registry import make_launcher
from tidal.frontend.liveness import WakeRoute
from tidal.frontend.migrator import Migrator
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.elastic import ScaleReport
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
    encode,
)
from tidal.protocol.topology import Topology

logger = logging.getLogger(__name__)

OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
# The coordinator publishes a snapshot at least this often (its heartbeat), so a frontend
# can tell a frozen one from a quiet one.
COORDINATOR_HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class ScaleHooks:
    """How the client hands elastic EP events to the scale driver (all called on the
    event loop's thread).

    ``owns_engine(engine_id)``: whether an exit (or ENGINE_CORE_DEAD) of this engine is
    the driver's (an engine joining or leaving in a scale operation, or one no longer
    serving) rather than a rank death that fails the client. ``on_exit(engine_id,
    exitcode, cause)`` is then called for the exit (``cause``: e.g. no heartbeat); ``on_report`` for every ``ScaleReport``."""

    on_report: Callable[[ScaleReport], None]
    owns_engine: Callable[[int], bool]
    on_exit: Callable[[int, int | None, str | None], None]


def _place_frontend(
    config: EngineConfig, entry_module: str | None
) -> tuple[Launcher, EngineConfig]:
    """Where the engine ranks run (docs/architecture.md#launchers) and the address this
    frontend is reached at there; the process manager owns the launcher once made."""
    launcher = make_launcher(config, entry_module)
    host = launcher.frontend_host(config.parallel.data_parallel_address)
    return launcher, config.with_parallel(data_parallel_address=host)


def _dp_rendezvous(config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """With DP, the master port (the configured one, else a free one) and the store
    address ``host:port`` the launch topology names; without, ``config`` and None."""
    par = config.parallel
    if not par.is_data_parallel:
        return config, None
    port = par.data_parallel_master_port or get_open_port(par.data_parallel_address)
    return (
        config.with_parallel(data_parallel_master_port=port),
        f"{par.data_parallel_address}:{port}",
    )


class MPClient:
    """The engine client's transport, routing and migration (``AsyncMPClient`` adds its
    readers, liveness and failure handling on the event loop): the frontend's sockets,
    the engine processes, the DP coordinator, routing, and releasing all of it.

    With the DP machinery (DP > 1 at launch, or elastic EP at any size) it also starts the
    DP coordinator, balances requests across ranks from the coordinator's published load,
    and runs the frontend's half of the wave protocol (stamp each request with the wave;
    wake the ranks when they are paused). Engines, coordinator and balancer all work from
    one ``Topology``: its engine ids are who gets requests, its size the live DP size.

    Everything that sends or changes state runs on the event loop's thread (the
    server's, or the loop thread of ``LoopThreadClient``), so the sockets and the request
    book need no lock."""

    def __init__(self, config: EngineConfig, entry_module: str | None = None) -> None:
        # Each concern in a function of its own; this only orders them.
        launcher, config = _place_frontend(config, entry_module)
        config, store = _dp_rendezvous(config)
        self.config = config
        par = config.parallel
        # The launch topology: engine ids 0..N-1 in rank order. Every engine gets it in the
        # handshake and takes its DP/EP rank and group size from it, not from the config.
        self._launch_topology = Topology.initial(
            par.data_parallel_size, store_address=store, tp_size=par.tensor_parallel_size
        )
        # Rank recovery / elastic EP: every engine request sent, its owner and outputs.
        book = RequestBook(0, config.model.max_model_len) if par.reconfigurable else None
        self._scale_hooks: ScaleHooks | None = None
        self._call_ids = iter(range(1, 1 << 62))
        self._closed = False
        self.coordinator: DPCoordinator | None = None
        ipc = ipc_dir()
        self.transport = EngineTransport(frontend_addresses(config, ipc), ipc, par)
        dp = (
            DPFrontendState(self._launch_topology, par.dp_lb_policy)
            if par.is_data_parallel
            else None
        )
        self.router = Router(self.transport, self._launch_topology, dp, book, self._wake_route)
        self.migrator = Migrator(book, self.router, _weak_callback(self._deliver_injected))
        try:
            self.transport.open()
            coord_addrs = self._start_coordinator()
            self._start_engines(launcher, coord_addrs)
        except BaseException:
            if getattr(self, "manager", None) is None:
                launcher.close()  # the manager closes it once it has it
            self._close_resources()
            raise
        # Released at shutdown(), when the client is garbage-collected, or at interpreter
        # exit, whichever comes first: a script that never calls shutdown() still exits.
        self._resources = _MPResources.of(self)
        self._finalizer = weakref.finalize(self, self._resources.close)
        self.manager.start_monitor(_weak_callback(self._on_engine_exit))

    def _start_engines(
        self, launcher: Launcher, coordinator_addresses: tuple[str | None, str | None]
    ) -> None:
        """``self.manager``, its ranks started and every one READY."""
        manager = EngineProcManager(
            self.config,
            self._launch_topology,
            self.transport.sync_ctx,
            input_address=self.addresses.input,
            output_address=self.output_address,
            handshake_address=self.addresses.handshake,
            coordinator_addresses=coordinator_addresses,
            local_engines=launcher.launch_ranks(self._launch_topology.engine_ids),
            curve=self.transport.curve,
            launcher=launcher,
        )
        self.manager = manager  # a failed wait below is then the manager's to close
        manager.wait_for_ready(self.input_socket)

    # ---- the transport's, by the names tests and callers use ----------------------------

    @property
    def dead_reason(self) -> str | None:
        """Why the client failed (every request and call then ends), or None."""
        return self.transport.dead_reason

    @dead_reason.setter
    def dead_reason(self, reason: str | None) -> None:
        self.transport.dead_reason = reason

    @property
    def input_socket(self) -> zmq.Socket:
        sock = self.transport.input_socket
        assert sock is not None  # opened at startup
        return sock

    @property
    def addresses(self) -> FrontendAddresses:
        return self.transport.addresses

    @property
    def ipc_dir(self) -> str:
        return self.transport.ipc_dir

    @property
    def ctx(self) -> zmq.asyncio.Context:
        return self.transport.ctx

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

    def _wake_route(self) -> WakeRoute:
        return WakeRoute.COORDINATOR

    @property
    def output_address(self) -> str:
        """Where engines send their outputs (this client's PULL socket)."""
        return self.transport.output_address

    def _start_coordinator(self) -> tuple[str | None, str | None]:
        par = self.config.parallel
        if not par.is_data_parallel:
            return (None, None)
        self.coordinator = DPCoordinator(
            self._launch_topology,
            self.addresses.coordinator,
            heartbeat_interval_s=COORDINATOR_HEARTBEAT_S,
            auth_key=par.data_parallel_auth_key if self.transport.curve else None,
        )
        addrs = self.coordinator.addresses
        self.transport.connect_coordinator(addrs)
        return (addrs.engine_publish, addrs.engine_input)

    # ---- sending -----------------------------------------------------------------------

    def _send(self, engine: int, req_type: EngineCoreRequestType, payload: Any) -> None:
        self._send_frame(engine, req_type, encode(payload))

    def _send_frame(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> None:
        self.transport.send(engine, req_type, payload)

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
        """Whether a request pinned to DP rank ``rank`` can go there: raises
        ``RankUnavailableError`` when its engine is dead (the deployment recovers without
        it); False when it leaves (a scale-down drains it: the request goes where the
        balancer sends it, as that rank's own requests do); True otherwise (or unpinned).
        A rank outside the topology is the balancer's to refuse."""
        return self.router.check_pinned_rank(rank)

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_reason is not None or getattr(self, "_closed", False):
            return  # nothing runs any more (a generator cancelled at shutdown lands here)
        self.migrator.forget(request_ids)
        self.router.abort(request_ids)

    def _on_outputs(self, outs: EngineCoreOutputs) -> bool:
        """Bookkeeping of one batch from an engine; False when nothing in it is for the
        caller (a scale report alone: it went to the scale driver). With elastic EP,
        outputs of an engine that does not own their request are removed first."""
        report = outs.scale_report
        if report is not None:
            hooks = self._scale_hooks
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

    # ---- elastic EP (docs/architecture.md#elastic): executed for the scale driver -----------------

    @property
    def request_book(self) -> RequestBook | None:
        return self.migrator.book

    def set_scale_hooks(self, hooks: ScaleHooks | None) -> None:
        self._scale_hooks = hooks

    def _scale_owns(self, engine_id: int) -> bool:
        hooks = self._scale_hooks
        return hooks is not None and hooks.owns_engine(engine_id)

    def set_topology(self, topology: Topology) -> None:
        """A committed reconfiguration: tell the coordinator (``DPSetTopology`` on the
        frontends' upstream socket), route by ``topology`` (balancer, wave state: the next
        request wakes the engines), answer later handshakes with it and move the ownership
        table to its epoch. Each receiver drops an older topology."""
        topology = self.router.set_topology(topology)
        self.manager.set_topology(topology)
        self.migrator.set_epoch(topology.epoch)

    def exclude_from_routing(self, engine_ids: Iterable[int]) -> None:
        """These engines get no automatically routed request (leaving in a scale-down):
        the balancer's draining set."""
        self.router.exclude(engine_ids)

    def restore_routing(self, engine_ids: Iterable[int]) -> None:
        self.router.restore(engine_ids)

    def _try_send_frame(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> bool:
        return self.transport.try_send(engine, req_type, payload)

    def migrate(self, engine_id: int, request_ids: Iterable[str] | None = None) -> int:
        """Resume requests of ``engine_id`` on other engines (``Migrator.migrate``):
        those named, or with None every one it still owns; how many moved or finished."""
        return self.migrator.migrate(engine_id, request_ids)

    def _deliver_injected(self, outs: EngineCoreOutputs) -> None:
        """Put outputs made here (not by an engine) on the caller's output queue."""
        raise NotImplementedError

    def _on_snapshot(self, frame: bytes) -> None:
        self.router.on_snapshot(frame)

    def _utility_request(self, method: str, args: tuple) -> UtilityRequest:
        return UtilityRequest(0, next(self._call_ids), method, list(args))

    def _on_engine_exit(self, engine_id: int, exitcode: int | None) -> None:
        """The process monitor (its thread): a local engine exited unasked."""
        raise NotImplementedError

    # ---- shutdown ----------------------------------------------------------------------

    def _close_resources(self) -> None:
        """Release everything now (a failed start, or shutdown). Idempotent."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif not self._closed:
            _MPResources.of(self).close()
        self._closed = True


class _MPResources:
    """What an MP client must release, held apart from the client: the client's
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
    def of(cls, client: MPClient) -> _MPResources:
        t = client.transport
        return cls(
            t.ctx,
            t.ipc_dir,
            getattr(client, "manager", None),
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
    """``method`` without a strong reference to its object (for long-lived threads)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def exit_reason(engine_id: int, exitcode: int | None) -> str:
    return f"engine {engine_id} exited unexpectedly (exit code {exitcode})"
