"""The engine's side of the startup handshake, on a DEALER to the frontend's handshake
ROUTER (the frontend's side is ``tidal.frontend.launchers.proc_manager.EngineProcManager``):

  engine: HELLO(engine id, pid) -> frontend: EngineAddresses (where to connect, its config
          hash, the topology)
  engine: ... connects, loads the model ...
  engine: READY(id, its own config hash, num_blocks) or READY(error=...) on failure.

An engine refuses to start, and says why in READY(error) so the frontend fails with the
same message, when its config hash differs from the frontend's or its id is not in the
topology. A process the frontend did not start as this engine (a stray fork of a
cancelled warm spawn: its pid is not the one the frontend knows) is refused in the answer
and exits without READY: an engine id never runs twice. Over TCP the socket is a CURVE
client; a frontend that refuses our secret is seen on the socket monitor and fails the
handshake at once, not at the timeout.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.distributed.zmq_auth import (
    AuthenticationError,
    CurveKeys,
    raise_if_refused,
    secure_client,
    watch_handshake,
)
from tidal.protocol.errors import EngineStartupError
from tidal.protocol.messages import EngineAddresses, EngineHello, EngineReady, encode

HANDSHAKE_TIMEOUT_S = 60.0


class EngineHandshake:
    """One engine's handshake socket: ``hello`` once, then ``send_ready`` once, ``close``."""

    def __init__(
        self, ctx: zmq.Context, engine_id: int, address: str, curve: CurveKeys | None
    ) -> None:
        self.engine_id = engine_id
        self._sock = ctx.socket(zmq.DEALER)
        # Long enough to deliver a READY(error) sent just before the process gives up.
        self._sock.setsockopt(zmq.LINGER, 1000)
        secure_client(self._sock, curve, address)
        self._monitor = watch_handshake(self._sock) if curve is not None else None
        self._sock.connect(address)

    def hello(self, config: EngineConfig) -> EngineAddresses:
        """HELLO, then the frontend's reply, checked against ``config`` and this engine's
        id. Raises ``EngineStartupError`` (after sending READY(error) where the frontend
        can hear it)."""
        try:
            self._sock.send(encode(EngineHello(self.engine_id, os.getpid(), socket.gethostname())))
            self._await_reply()
        finally:
            self._close_monitor()
        addresses = msgspec.msgpack.decode(self._sock.recv(), type=EngineAddresses)
        if addresses.refused is not None:  # another process is this engine: no READY
            raise EngineStartupError(f"engine {self.engine_id}: {addresses.refused}")
        error = self._refusal(addresses, config.config_hash())
        if error is not None:
            self.send_ready(config.config_hash(), 0, error)
            raise EngineStartupError(error)
        return addresses

    def _refusal(self, addresses: EngineAddresses, mine: str) -> str | None:
        theirs = addresses.parallel_config_hash
        if theirs and theirs != mine:
            return (
                f"engine {self.engine_id}: config mismatch (frontend {theirs}, this engine "
                f"{mine}): every engine must be started with the same model, dtype, "
                "expert-parallel and backend flags"
            )
        top = addresses.topology
        if top is not None and self.engine_id not in top:
            return (
                f"engine {self.engine_id} is not in the deployment (topology epoch "
                f"{top.epoch}, engines {top.engine_ids}): check --data-parallel-size, "
                "--data-parallel-start-rank and --data-parallel-size-local on every host"
            )
        return None

    def send_ready(
        self,
        config_hash: str,
        num_blocks: int,
        error: str | None = None,
        worker_pids: list[int] | None = None,
    ) -> None:
        ready = EngineReady(self.engine_id, config_hash, num_blocks, error, worker_pids or [])
        self._sock.send(encode(ready))

    def close(self, linger_ms: int | None = None) -> None:
        self._close_monitor()
        self._sock.close(linger=linger_ms)

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _await_reply(self) -> None:
        """Wait for the frontend's reply to HELLO; with CURVE, also for a refused
        handshake on the monitor, which means a different secret: fail at once."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._monitor is not None and self._monitor in ready:
                try:
                    raise_if_refused(self._monitor, "the frontend")
                except AuthenticationError as e:
                    raise EngineStartupError(f"engine {self.engine_id}: {e}") from None
            if self._sock in ready:
                return
        raise EngineStartupError(
            f"engine {self.engine_id}: no reply from the frontend within {HANDSHAKE_TIMEOUT_S}s"
        )
