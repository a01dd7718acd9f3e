"""Authentication of the DP control plane over TCP (multi-node): ZMQ CURVE from a shared
secret.

Threat: with ``--headless`` / ``--data-parallel-address`` the frontend's ROUTER/PULL and
handshake sockets and the DP coordinator's sockets listen on TCP. Unauthenticated, anyone
who can reach those ports could register as an engine, feed the frontend forged outputs
(``engine_dead``), or stall the DP waves. Local deployments use ``ipc://`` sockets in a
0700 directory instead and need none of this.

Scheme: every host is given the same secret (``--data-parallel-auth-key`` or the
``TIDAL_DP_AUTH_KEY`` environment variable, read only by the CLI; it travels inside the
frozen config to the processes a host starts). From it each process derives, with a slow
KDF (PBKDF2-SHA256, so a captured handshake does not make guessing a weak secret cheap),
two Curve25519 keypairs: one *server* pair for every socket that binds, one *client* pair
for every socket that connects.

- A binding socket is a CURVE server; its process runs a ZAP handler that admits only the
  client public key. A peer without the secret cannot complete the handshake (it cannot
  encrypt to the server key it does not know, nor prove the client key), so not one of
  its messages reaches the application.
- A connecting socket is a CURVE client. A handshake that fails (wrong secret on either
  side) shows up in the socket's monitor as ``EVENT_HANDSHAKE_FAILED_*``: engines watch
  for it during startup and fail fast with a message naming the flag.
- Traffic is also encrypted, so the secret itself never crosses the network.

Not covered: the TCPStore (torch rendezvous on ``--data-parallel-master-port``) and the
gloo/NCCL connections of the process groups have no authentication of their own. Run
multi-node deployments on a private network, or firewall those ports to the cluster's
hosts.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

_KDF_SALT = b"tidal/dp-control-plane/curve/v1"
_KDF_ITERATIONS = 200_000
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class AuthenticationError(RuntimeError):
    """A peer refused our CURVE handshake: the shared secret differs."""


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The deployment's two keypairs, z85-encoded as pyzmq's socket options want them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print secret keys
        return "CurveKeys(...)"


@functools.lru_cache(maxsize=4)
def curve_keys(secret: str | None) -> CurveKeys | None:
    """The keypairs derived from ``secret`` (None: no authentication). Deterministic, so
    every host that has the secret derives the same ones; cached, since the KDF is slow
    on purpose. (Its length is checked with the rest of the config: ``EngineArgs``.)"""
    if secret is None:
        return None
    if not secret:
        raise ValueError("data_parallel_auth_key must not be empty")
    if not zmq.has("curve"):
        raise RuntimeError(
            "data_parallel_auth_key needs libzmq built with CURVE (libsodium); this pyzmq has none"
        )
    seed = hashlib.pbkdf2_hmac(
        "sha256", secret.encode(), _KDF_SALT, _KDF_ITERATIONS, dklen=64
    )  # any 32 bytes are a Curve25519 secret key (the curve clamps them)
    server_secret, client_secret = z85.encode(seed[:32]), z85.encode(seed[32:])
    return CurveKeys(
        zmq.curve_public(server_secret),
        server_secret,
        zmq.curve_public(client_secret),
        client_secret,
    )


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def secure_server(sock: zmq.Socket, keys: CurveKeys | None, address: str) -> None:
    """Make ``sock`` a CURVE server before it binds ``address`` (tcp only)."""
    if keys is None or not _is_tcp(address):
        return
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public


def secure_client(sock: zmq.Socket, keys: CurveKeys | None, address: str) -> None:
    """Make ``sock`` a CURVE client before it connects to ``address`` (tcp only)."""
    if keys is None or not _is_tcp(address):
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _ClientKeyOnly:
    """ZAP credentials check: only the deployment's client key gets in."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.client_public)
        if not ok:
            logger.warning("DP control plane: refused a peer with an unknown CURVE key")
        return ok


def start_authenticator(
    ctx: zmq.Context, keys: CurveKeys | None
) -> zmq.auth.thread.ThreadAuthenticator | None:
    """Run the ZAP handler for ``ctx``'s CURVE servers (None when ``keys`` is None). Start
    it before binding; ``stop()`` it before the context is terminated."""
    if keys is None:
        return None
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _ClientKeyOnly(keys.client_public))
    return auth


def watch_handshake(sock: zmq.Socket) -> zmq.Socket:
    """A monitor socket on ``sock`` for ``raise_if_refused`` (close it with
    ``sock.disable_monitor()`` then ``close()``)."""
    return sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def raise_if_refused(monitor: zmq.Socket, what: str) -> bool:
    """Drain ``monitor``; raise ``AuthenticationError`` on a failed handshake. Returns
    whether a handshake succeeded."""
    ok = False
    while monitor.poll(0):
        event = recv_monitor_message(monitor)["event"]
        if event & _HANDSHAKE_FAILED:
            raise AuthenticationError(
                f"{what} refused the CURVE handshake: the shared secret differs. Give every "
                "host the same --data-parallel-auth-key (or TIDAL_DP_AUTH_KEY)"
            )
        ok = ok or event == zmq.EVENT_HANDSHAKE_SUCCEEDED
    return ok
