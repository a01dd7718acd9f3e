"""Free TCP ports and listening sockets for the stores and sockets a deployment binds.

Every TCP socket a deployment listens on is bound to one address: loopback on a single
host, ``--data-parallel-address`` (or, on another host, this host's address on the route
to it) across hosts, never every interface.
"""

from __future__ import annotations

import contextlib
import random
import socket


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host`` only (its first address), not on every
    interface: what the TCPStore servers listen on (``serve_store``)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def local_address_towards(host: str) -> str | None:
    """This machine's address on the route to ``host`` (the one its packets to ``host``
    would leave from; ``host`` itself when it is one of ours), or None when there is no
    route. A UDP "connect" only looks the route up: nothing is sent."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except OSError:
        return None


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS may hand it out again: use it soon).

    Chosen outside the kernel's ephemeral range where it can be: a port from that range
    may be taken, before the caller binds it, as the local end of any outgoing connection
    on the machine (each TCPStore client and gloo pair makes some), which made a rank's
    store bind fail with EADDRINUSE now and then. Ports below the range are taken only by
    explicit binds. Random, so that processes picking at once rarely pick alike."""
    low, high = _ephemeral_range()
    below, above = range(_FIRST_PICKED_PORT, low), range(high + 1, 65536)
    pool = below if len(below) >= _MIN_POOL else above
    if len(pool) >= _MIN_POOL:  # else too few to pick from at random: the kernel picks
        rng = random.SystemRandom()
        for _ in range(64):
            with contextlib.suppress(OSError):  # taken
                return _bind_and_release(host, rng.choice(pool))
    return _bind_and_release(host, 0)


# Below this are the ports of well-known and commonly configured services.
_FIRST_PICKED_PORT = 10000
_MIN_POOL = 1024


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ends of outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bind_and_release(host: str, port: int) -> int:
    """Bind ``host:port`` (0: a port the kernel picks) and let it go: the port. OSError
    when it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return int(s.getsockname()[1])


# Prefix of a deployment's private ipc:// socket directory (mkdtemp, mode 0700). Engines
# left behind by a SIGKILLed launcher remove only a directory with this prefix.
IPC_DIR_PREFIX = "tidal-"
