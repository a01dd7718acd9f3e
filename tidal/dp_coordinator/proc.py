"""The DP coordinator process: a thin ZMQ loop around ``CoordinatorState``. (Starting and
stopping it, and asking it for stats, is ``handle.py``.)

Sockets, all bound here (addresses are passed in: ``ipc://`` in the launcher's private
0700 temp dir, or ``tcp://`` for multi-node; ``tcp://host:*`` picks free ports and the
bound addresses are reported back):

``engine_publish``   XPUB -> engines (SUB or XSUB, subscribed to everything). Two frames:
                     ``[COORDINATOR_READY, CoordinatorReady]`` each time an engine
                     subscribes (the handshake: an engine waits for it before it relies on
                     START_DP_WAVE; engines past their handshake ignore later ones), then,
                     while a wave runs, ``[START_DP_WAVE, StartDPWave(wave)]`` again (a
                     broadcast sent before the subscription would be lost), and
                     ``[START_DP_WAVE, StartDPWave]`` broadcasts.
``engine_input``     PULL <- engines (PUSH): one frame, ``EngineCoreOutputs`` carrying
                     ``scheduler_stats`` and/or ``wave_complete`` / ``start_wave`` /
                     ``engine_dead``.
``frontend_publish`` XPUB -> frontends (XSUB): one frame, ``DPLoadSnapshot``. A new
                     subscription gets a snapshot at once. Frontends send
                     ``FrontendToCoordinator`` messages (wake-ups, topology) *upstream on the
                     same XSUB socket*: no extra socket, and a frontend that can send
                     is by construction one that receives snapshots.
``stats``            ROUTER <- DEALER/REQ: any request (``DPStatsRequest`` by convention)
                     is answered with ``DPCoordinatorStats`` (``/stats``, dashboard).

Over TCP (multi-node) every socket is a CURVE server and a ZAP handler in this process
admits only holders of the deployment's shared secret (``tidal/distributed/zmq_auth.py``); the
peers (engines, frontends, ``fetch_stats``) connect as CURVE clients.

Everything is msgspec msgpack; nothing is pickled. SIGTERM/SIGINT stop the loop cleanly
(sockets closed, ipc files unlinked); the process also exits when its parent dies.

A message on any socket that does not decode, or that the state refuses (raises on), is
dropped alone, counted and logged (``_CoordinatorLoop.dropped``): no frame a peer sends
can stop the loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tidal.distributed.zmq_auth import (
    CurveKeys,
    curve_keys,
    secure_server,
    start_authenticator,
)
from tidal.dp_coordinator.state import (
    Action,
    BroadcastStartWave,
    CoordinatorState,
    PublishSnapshot,
)
from tidal.protocol.messages import (
    COORDINATOR_READY,
    ENGINE_OUTPUTS_DECODER,
    FRONTEND_DECODER,
    EngineCoreRequestType,
    encode,
)
from tidal.protocol.topology import Topology
from tidal.utils.dropped import DropCounter

logger = logging.getLogger(__name__)

_POLL_CAP_MS = 100  # bounds the reaction time to a stop request or a dead parent
_DRAIN_MAX = 1000  # messages per socket per loop turn
_SUBSCRIBE, _UNSUBSCRIBE = 1, 0


@dataclass(frozen=True)
class CoordinatorAddresses:
    engine_publish: str  # engines SUBscribe (EngineAddresses.coordinator_input)
    engine_input: str  # engines PUSH (EngineAddresses.coordinator_output)
    frontend_publish: str  # frontends XSUB: snapshots down, wake-ups up
    stats: str  # DEALER/REQ -> full stats

    @classmethod
    def ipc(cls, directory: str) -> CoordinatorAddresses:
        names = ("dpc-engine-pub", "dpc-engine-in", "dpc-frontend-pub", "dpc-stats")
        return cls(*(f"ipc://{os.path.join(directory, n)}" for n in names))

    @classmethod
    def tcp(cls, host: str, ports: Sequence[int] | None = None) -> CoordinatorAddresses:
        """``ports`` (four) or None: bind free ports (read the real ones from ``DPCoordinator``)."""
        if ports is not None and len(ports) != 4:
            raise ValueError(f"the coordinator binds 4 ports; got {len(ports)}")
        port_strs = [str(p) for p in ports] if ports else ["*"] * 4
        return cls(*(f"tcp://{host}:{p}" for p in port_strs))

    def ipc_paths(self) -> list[str]:
        return [a[len("ipc://") :] for a in astuple(self) if a.startswith("ipc://")]


# ----------------------------------------------------------------------- the loop


def _drain(sock: zmq.Socket, events: dict, multipart: bool = False) -> list:
    """Up to ``_DRAIN_MAX`` ready messages, so no socket starves the others."""
    out: list = []
    if sock not in events:
        return out
    for _ in range(_DRAIN_MAX):
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK) if multipart else sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


class _StopFlag:
    """Set from a signal handler; read by the loop between polls."""

    def __init__(self) -> None:
        self.stopped = False

    def set(self, signum: int, frame: object) -> None:
        self.stopped = True


class _CoordinatorLoop:
    def __init__(
        self,
        ctx: zmq.Context,
        addresses: CoordinatorAddresses,
        state: CoordinatorState,
        stop: _StopFlag,
        curve: CurveKeys | None = None,
    ) -> None:
        self.state = state
        self.stop = stop
        self.dropped = DropCounter("DP coordinator", logger)
        self.engine_pub = self._bind(ctx, zmq.XPUB, addresses.engine_publish, curve)
        self.engine_in = self._bind(ctx, zmq.PULL, addresses.engine_input, curve)
        self.front_pub = self._bind(ctx, zmq.XPUB, addresses.frontend_publish, curve)
        self.stats = self._bind(ctx, zmq.ROUTER, addresses.stats, curve)
        self.poller = zmq.Poller()
        for s in (self.engine_pub, self.engine_in, self.front_pub, self.stats):
            self.poller.register(s, zmq.POLLIN)

    @staticmethod
    def _bind(ctx: zmq.Context, kind: int, address: str, curve: CurveKeys | None) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber, not just the first
        secure_server(sock, curve, address)
        sock.bind(address)
        return sock

    def bound_addresses(self) -> CoordinatorAddresses:
        socks = (self.engine_pub, self.engine_in, self.front_pub, self.stats)
        return CoordinatorAddresses(*(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks))

    def close(self) -> None:
        for s in (self.engine_pub, self.engine_in, self.front_pub, self.stats):
            s.close(linger=0)

    def run(self, parent_pid: int | None) -> None:
        while not self.stop.stopped:
            wait_ms = (self.state.next_deadline() - time.monotonic()) * 1000
            events = dict(self.poller.poll(int(min(max(wait_ms, 0), _POLL_CAP_MS))))
            self._execute(self._turn(events, time.monotonic()))
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("DP coordinator: parent %d is gone, exiting", parent_pid)
                return

    def _turn(self, events: dict, now: float) -> list[Action]:
        actions: list[Action] = []
        for msg in _drain(self.engine_pub, events):
            self._guarded("engine subscription", self._on_engine_subscription, msg)
        for msg in _drain(self.front_pub, events):
            actions += self._guarded("frontend message", self._on_frontend, msg, now)
        for msg in _drain(self.engine_in, events):
            actions += self._guarded("engine message", self._on_engine, msg, now)
        for frames in _drain(self.stats, events, multipart=True):
            self._guarded("stats request", self._on_stats, frames, now)
        return actions + self.state.tick(now)

    def _guarded(self, kind: str, handler: Callable[..., Any], *args: Any) -> list[Action]:
        """``handler(*args)``'s actions; a message it cannot handle is dropped alone."""
        try:
            return handler(*args) or []
        except (msgspec.DecodeError, ValueError) as e:  # a malformed message
            self.dropped.drop(kind, e)
        except Exception as e:  # noqa: BLE001 - a bug on one message must not stop the loop
            self.dropped.drop(kind, e, exc_info=True)
        return []

    def _on_engine_subscription(self, msg: bytes) -> None:
        if msg[:1] != bytes([_SUBSCRIBE]):
            return
        self.engine_pub.send_multipart([COORDINATOR_READY, encode(self.state.ready_message())])
        if self.state.running:
            # A START broadcast before this engine's subscription reached it would be lost
            # (slow joiner): after a coordinator restart (docs/architecture.md#faults) the engines
            # resubscribe while a rank may already wait in a collective. Repeat it for the
            # running wave, excluding nobody: a duplicate START is harmless (wave rules).
            start = BroadcastStartWave(self.state.wave, None)
            self.engine_pub.send_multipart(
                [EngineCoreRequestType.START_DP_WAVE.value, encode(start.message())]
            )

    def _on_frontend(self, msg: bytes, now: float) -> list[Action]:
        if msg[:1] == bytes([_SUBSCRIBE]):
            self.state.request_publish()  # a new frontend: give it the load at once
            return []
        if msg[:1] == bytes([_UNSUBSCRIBE]):
            return []
        return self.state.handle(FRONTEND_DECODER.decode(msg), now)

    def _on_engine(self, msg: bytes, now: float) -> list[Action]:
        out = ENGINE_OUTPUTS_DECODER.decode(msg)
        if out.engine_dead:
            logger.error("DP coordinator: engine %d died: %s", out.engine_id, out.dead_reason)
        return self.state.handle(out, now)

    def _on_stats(self, frames: list[bytes], now: float) -> None:
        # Reply under the request's envelope (DEALER: [id]; REQ: [id, b""]).
        self.stats.send_multipart(frames[:-1] + [encode(self.state.full_stats(now))])

    def _execute(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, PublishSnapshot):
                self.front_pub.send(encode(a.snapshot))
            elif isinstance(a, BroadcastStartWave):
                kind = EngineCoreRequestType.START_DP_WAVE.value
                self.engine_pub.send_multipart([kind, encode(a.message())])


def run_coordinator(
    addresses: CoordinatorAddresses,
    topology: Topology | int,
    *,
    publish_interval_s: float = 0.1,
    heartbeat_interval_s: float = 3.0,
    history_len: int = 600,
    ready_conn: Connection | None = None,
    parent_pid: int | None = None,
    auth_key: str | None = None,
    wave: int = 0,
) -> None:
    """The coordinator process's body (``tidal.dp_coordinator.entry``). Reports the bound
    addresses (or the startup error) as msgpack bytes on ``ready_conn``, then serves until
    SIGTERM. ``topology``: the engines it starts with (an int: the launch topology of that
    size). ``auth_key``: the shared secret of a TCP control plane (None: no CURVE)."""
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    ctx = zmq.Context()
    authenticator = None
    try:
        curve = curve_keys(auth_key)
        authenticator = start_authenticator(ctx, curve)  # before any bind
        state = CoordinatorState(
            topology, history_len, publish_interval_s, heartbeat_interval_s, wave=wave
        )
        loop = _CoordinatorLoop(ctx, addresses, state, stop, curve)
    except Exception as e:
        if ready_conn is not None:
            ready_conn.send_bytes(encode({"error": f"{type(e).__name__}: {e}"}))
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)  # closes the sockets bound before the failure
        unlink_ipc(addresses)
        raise
    try:
        if ready_conn is not None:
            ready_conn.send_bytes(encode({"addresses": list(astuple(loop.bound_addresses()))}))
            ready_conn.close()
        loop.run(parent_pid)
    finally:
        loop.close()
        if authenticator is not None:
            authenticator.stop()
        ctx.term()
        unlink_ipc(addresses)


def unlink_ipc(addresses: CoordinatorAddresses) -> None:
    """Remove the ipc socket files (a killed coordinator leaves them behind)."""
    for path in addresses.ipc_paths():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ----------------------------------------------------------------------- launch


class CoordinatorLaunch(msgspec.Struct, frozen=True):
    """What the launcher writes to the coordinator process's stdin."""

    addresses: CoordinatorAddresses
    topology: Topology
    publish_interval_s: float
    heartbeat_interval_s: float
    history_len: int
    parent_pid: int
    ready_fd: int  # write end of the startup-reply pipe, inherited by the child
    auth_key: str | None = None  # shared secret of a TCP control plane (stdin is private)
    wave: int = 0  # a restarted coordinator starts at the frontend's last known wave


def run_coordinator_launch(launch: CoordinatorLaunch) -> None:
    ready_conn = Connection(launch.ready_fd, readable=False)
    run_coordinator(
        launch.addresses,
        launch.topology,
        publish_interval_s=launch.publish_interval_s,
        heartbeat_interval_s=launch.heartbeat_interval_s,
        history_len=launch.history_len,
        ready_conn=ready_conn,
        parent_pid=launch.parent_pid,
        auth_key=launch.auth_key,
        wave=launch.wave,
    )
