"""Raw TCP clients for the HTTP server's tests: connections that send a request by hand,
read nothing, or read to the end, as slow and hostile clients do."""

from __future__ import annotations

import contextlib
import socket


def raw_connection(port: int, rcvbuf: int | None = None, timeout_s: float = 60.0) -> socket.socket:
    """A connection to ``127.0.0.1:port``; ``rcvbuf`` (bytes) shrinks its receive window
    (set before connect, where the window is agreed), so a server's sends back up fast."""
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout_s)
    s.connect(("127.0.0.1", port))
    return s


def read_to_eof(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            data += chunk
    return data
