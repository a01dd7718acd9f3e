"""Free TCP ports for the stores and sockets a deployment binds."""

from __future__ import annotations

import socket


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS may hand it out again: use it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Prefix of a deployment's private ipc:// socket directory (mkdtemp, mode 0700). Engines
# left behind by a SIGKILLed launcher remove only a directory with this prefix.
IPC_DIR_PREFIX = "tidal-"
