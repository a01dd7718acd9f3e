"""Slow and hostile HTTP clients: what one connection may hold, and for how long.

uvicorn alone accepts every connection and waits forever for a request that never
arrives, so idle or trickling connections could take every file descriptor the process
has, and then recovery could not even spawn a replacement engine. ``ServerLimits`` bounds
them, in three places:

- the connection protocol (``guarded_protocol``, uvicorn's h11 protocol with two checks):
  a connection past ``max_connections`` is answered 503 and closed at once, before its
  request is read; a request line and headers that do not arrive within
  ``header_timeout_s`` get 408 and the connection is closed;
- the ASGI layer (``http_limits.BodyLimitMiddleware``): a body that does not arrive
  within ``body_timeout_s`` gets 408 (the HTTP parser cannot tell a slow body from a
  large one, the app can);
- the streams (``serving``): a client that does not read its stream has at most
  ``max_stream_backlog`` outputs queued for it; past that its requests are aborted in
  the engine and its connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Any

import h11
from msgspec import Meta
from uvicorn.protocols.http.h11_impl import H11Protocol

from tidal.config import check_options, option

logger = logging.getLogger(__name__)

# The ASGI scope extension under which the protocol offers a way to drop the connection
# at once: closing waits for the client to read what is buffered, which a client that
# does not read never does.
ABORT_CONNECTION = "tidal.abort_connection"


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP client may hold: ``launch`` flags generated from these declarations
    (tidal/config.py's ``option``), each range checked when it is made."""

    # ``launch``'s default (None) is half the open-file limit (``spawn._server_limits``).
    max_connections: Annotated[int, Meta(ge=1)] = option(
        1024,
        arg_default=None,
        help="most open HTTP connections; one past it is answered 503 and closed before "
        "its request is read (default: half the open-file limit, at most 4096, so "
        "clients can never take the descriptors engines and recovery need)",
    )
    header_timeout_s: Annotated[float, Meta(gt=0)] = option(
        30.0,
        arg="http_header_timeout",
        help="seconds a connection's request line and headers may take; else 408 and the "
        "connection is closed",
    )
    body_timeout_s: Annotated[float, Meta(gt=0)] = option(
        60.0,
        arg="http_body_timeout",
        help="seconds a request body may take after its headers; else 408 and the "
        "connection is closed",
    )
    max_stream_backlog: Annotated[int, Meta(ge=1)] = option(
        256,
        help="outputs a streaming response may have queued, per engine request, for a "
        "client that does not read them; past it the request is aborted in the engine "
        "and the connection dropped",
    )

    @property
    def accept_backlog(self) -> int:
        """The listen backlog, which is also how many connections asyncio accepts in one
        go: each holds a descriptor until it is refused and closed, so a flood may hold
        about twice this many past ``max_connections``; kept to a quarter of it."""
        return max(16, min(2048, self.max_connections // 4))

    def __post_init__(self) -> None:
        # Each message starts with the option's name (NaN and inf are no limit at all).
        check_options(self)


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


_REFUSED = _raw_response(503, "Service Unavailable", "too many connections (--max-connections)")
_HEADER_TIMEOUT = _raw_response(
    408, "Request Timeout", "request headers not received in time (--http-header-timeout)"
)
# Refusals come in floods; one log line per interval says enough.
_LOG_EVERY_S = 10.0


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection cap, the header timeout and the
    ``ABORT_CONNECTION`` scope extension; pass it as uvicorn's ``http``."""

    class GuardedH11Protocol(H11Protocol):
        _refused = 0
        _last_log = 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # This connection is already counted.
            if len(self.connections) > limits.max_connections:
                self._refuse()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # Part of a request line or headers: they must be complete in time (a
                # keep-alive connection's idle wait before it is uvicorn's own timeout).
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not None and self.cycle is not cycle:
                # A new request: its task starts after this returns, so it sees the key.
                extensions: Any = self.cycle.scope.setdefault("extensions", {})
                extensions[ABORT_CONNECTION] = self.transport.abort

        def _refuse(self) -> None:
            cls = type(self)
            cls._refused += 1
            now = time.monotonic()
            if now - cls._last_log >= _LOG_EVERY_S:
                cls._last_log = now
                logger.warning(
                    "refusing connections past --max-connections %d (%d refused so far)",
                    limits.max_connections,
                    cls._refused,
                )
            self.transport.write(_REFUSED)
            self.transport.close()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(
                    limits.header_timeout_s, self._header_timeout
                )

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            logger.info(
                "closing a connection from %s: no complete request headers in %g s "
                "(--http-header-timeout)",
                self.client,
                limits.header_timeout_s,
            )
            self.transport.write(_HEADER_TIMEOUT)
            self.transport.close()

    return GuardedH11Protocol
