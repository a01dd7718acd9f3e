"""The engine client's transport (docs/architecture.md#frontend-client): every zmq socket the
frontend talks to its engines and the DP coordinator through, CURVE over TCP, and the
rule that a failed client sends nothing more.

``EngineTransport`` owns the asyncio context and its sync shadow, the ZAP handler, the
input ROUTER (requests to every engine), the output PULL (every engine's outputs) and,
with DP, the two coordinator sockets (load snapshots in, wake-ups and topologies out).
Its sockets are made and bound on the constructing thread (startup is synchronous);
afterwards only the event loop's thread uses them (the server's loop, or the loop thread
of ``LoopThreadClient``), so they need no lock. Releasing them is the client's
``_MPResources`` (it also stops the engines first).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from tidal.config import ParallelConfig
from tidal.distributed.zmq_auth import (
    CurveKeys,
    curve_keys,
    secure_client,
    secure_server,
    start_authenticator,
)
from tidal.dp_coordinator.proc import CoordinatorAddresses
from tidal.frontend.launchers.proc_manager import FrontendAddresses, bound_endpoint
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreRequestType, engine_identity


def engine_input_router(ctx: zmq.Context) -> zmq.Socket:
    """The ROUTER the frontend sends every engine its requests on (from the event loop).

    ``ROUTER_MANDATORY``: a send to an engine with no route raises EHOSTUNREACH (it is
    gone) instead of vanishing. With it, a send to a peer at its high-water mark blocks,
    and a frozen engine reads nothing: about 2,000 messages would then block the event
    loop, the liveness check that kills that engine included. No send limit (SNDHWM 0):
    what a frozen engine is sent waits in memory until it is found and killed, seconds.
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock


def _curve_for(input_address: str, ipc: str, par: ParallelConfig) -> CurveKeys | None:
    """Over TCP (ranks on other hosts) every control-plane socket is a CURVE peer and a
    ZAP handler admits only holders of the shared secret (tidal/distributed/zmq_auth.py);
    over IPC, None. Over TCP nothing lives in the ipc directory, so it goes now: were it
    kept, a SIGKILLed frontend would leave it behind (only ipc engines remove it)."""
    if not input_address.startswith("tcp://"):
        return None
    shutil.rmtree(ipc, ignore_errors=True)
    return curve_keys(par.data_parallel_auth_key)


def _sync_context(ctx: zmq.asyncio.Context) -> zmq.Context:
    """A sync shadow of ``ctx`` with linger 0 by default, the ZAP handler's own sockets
    included: nothing the frontend still has queued when it closes them is worth a
    ``term()`` that waits."""
    sync_ctx = zmq.Context.shadow(ctx.underlying)
    sync_ctx.setsockopt(zmq.LINGER, 0)
    return sync_ctx


class EngineTransport:
    """The frontend's sockets. State: the contexts, the sockets, the addresses bound,
    ``dead_reason`` (set once the client failed: every send then raises
    ``EngineDeadError``). Startup on the constructing thread, then the event loop's."""

    def __init__(self, addresses: FrontendAddresses, ipc_dir: str, par: ParallelConfig) -> None:
        self.ipc_dir = ipc_dir
        self.addresses = addresses
        self.curve = _curve_for(addresses.input, ipc_dir, par)
        self.dead_reason: str | None = None
        self.ctx = zmq.asyncio.Context()
        # Sockets are made through a sync shadow of the asyncio context: startup is
        # synchronous, and the readers wrap theirs in asyncio views once the loop runs.
        self.sync_ctx = _sync_context(self.ctx)
        self.authenticator: ThreadAuthenticator | None = None  # ZAP, over TCP
        self.input_socket: zmq.Socket | None = None
        self.output_socket: zmq.Socket | None = None
        self.snapshot_socket: zmq.Socket | None = None  # subscribed: read by the reader
        self.upstream_socket: zmq.Socket | None = None  # never subscribed: sends only
        self._views: list[zmq.asyncio.Socket] = []

    def open(self) -> None:
        """The ZAP handler (over TCP), and the input ROUTER and output PULL, bound before
        the engines start: they are told where."""
        self.authenticator = start_authenticator(self.sync_ctx, self.curve)
        self.input_socket = inp = engine_input_router(self.sync_ctx)
        self.output_socket = out = self.sync_ctx.socket(zmq.PULL)
        self.addresses = replace(
            self.addresses,
            input=self.bind(inp, self.addresses.input),
            output=self.bind(out, self.addresses.output),
        )

    def bind(self, sock: zmq.Socket, address: str) -> str:
        """Bind ``sock`` at ``address`` (a CURVE server over TCP); the address bound: a
        ``tcp://host:*`` one gets the port the bind chose."""
        secure_server(sock, self.curve, address)
        sock.bind(address)
        return bound_endpoint(sock, address)

    def connect_coordinator(self, addrs: CoordinatorAddresses) -> None:
        """Two sockets to the coordinator's frontend publisher: one subscribed (snapshots,
        read by the reader), one never subscribed (wake-ups and topologies out): a
        socket is used for one purpose by one task."""
        self.snapshot_socket = snap = self.sync_ctx.socket(zmq.XSUB)
        secure_client(snap, self.curve, addrs.frontend_publish)
        snap.connect(addrs.frontend_publish)
        snap.send(b"\x01")  # subscribe to everything
        self.upstream_socket = up = self.sync_ctx.socket(zmq.XSUB)
        secure_client(up, self.curve, addrs.frontend_publish)
        up.connect(addrs.frontend_publish)

    @property
    def output_address(self) -> str:
        """Where engines send their outputs (the output PULL)."""
        return self.addresses.output

    # ------------------------------------------------------------------ sending

    def send(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> None:
        """One frame to ``engine``; ``EngineDeadError`` once the client failed,
        ``zmq.ZMQError`` (EHOSTUNREACH) when the engine has no route."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        assert self.input_socket is not None  # opened at startup
        self.input_socket.send_multipart([engine_identity(engine), req_type.value, payload])

    def try_send(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> bool:
        """One frame; False while the engine's input route does not exist yet (a joiner
        right after READY) or no longer does (it exited)."""
        try:
            self.send(engine, req_type, payload)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def send_upstream(self, frame: bytes) -> None:
        """One frame to the coordinator (a wake-up, a topology)."""
        assert self.upstream_socket is not None  # connected with the DP machinery
        self.upstream_socket.send(frame)

    def drain_registrations(self) -> None:
        """Read the input registrations of engines started after launch (joiners): an
        empty frame each, nothing else ever arrives there."""
        assert self.input_socket is not None
        while True:
            try:
                self.input_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    # ------------------------------------------------------------------ reading

    def output_reader(self) -> zmq.asyncio.Socket:
        """An asyncio view of the output PULL (on the running loop)."""
        assert self.output_socket is not None
        return self._view(self.output_socket)

    def snapshot_reader(self) -> zmq.asyncio.Socket:
        assert self.snapshot_socket is not None
        return self._view(self.snapshot_socket)

    def _view(self, sock: zmq.Socket) -> zmq.asyncio.Socket:
        view = zmq.asyncio.Socket.from_socket(sock)
        self._views.append(view)
        return view

    def stop_reading(self) -> None:
        """The asyncio views registered their fds with the event loop; the sockets are
        closed through their sync objects, which does not unregister them, and a client
        started later on the same loop reuses those fd numbers (its reader would never
        wake). Unregister first (pyzmq's own close does the same)."""
        for view in self._views:
            if not view.closed:
                view._clear_io_state()

    def sockets(self) -> list[zmq.Socket]:
        """Every socket made, for closing (all before the context)."""
        socks = (self.input_socket, self.output_socket, self.snapshot_socket, self.upstream_socket)
        return [s for s in socks if s is not None]
