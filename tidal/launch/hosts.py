"""Browsers kept out: the ``Host`` header a server answers to, and CORS only on request.

A web page the operator opens can reach a server on their machine or network; what the
browser lets it do there is bounded by three rules, each enforced here or beside it:

- DNS rebinding: the page's own host name is made to resolve to 127.0.0.1, so its
  requests are same-origin to the browser and it may read the answers (``/stats``,
  completions). They still carry the page's host name in ``Host``. A server bound to
  loopback therefore answers only ``Host`` headers that name loopback (``localhost``,
  ``127.0.0.1``, ``[::1]``, with or without the port), plus what ``--allowed-hosts`` lists;
  bound to another address it answers any ``Host`` unless ``--allowed-hosts`` is given
  (a proxy in front, or clients on the network, use names the server cannot know).
- Cross-site requests without a preflight (``text/plain``, forms): refused by the JSON
  routes' media type check (``http_limits.read_json``, 415).
- Cross-site reads: no CORS header at all unless ``--allowed-origins`` names origins
  (``*`` for any), so a page of another origin can neither read an answer nor pass the
  preflight that ``application/json`` and ``Authorization`` need.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from tidal.launch.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether a bind address or host name is this machine's loopback only."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str | None:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``),
    lower-cased; None when it is malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        rest = header[end + 1 :]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return header[1:end]
    name, sep, port = header.rpartition(":")
    if not sep:
        return header or None
    if not port.isdigit() or not name or ":" in name:
        return None
    return name


def allowed_host_names(
    bind_host: str | None, allowed_hosts: Iterable[str] = ()
) -> frozenset[str] | None:
    """The host names this server answers to, or None for any: ``allowed_hosts`` (host
    names, port-less; ``*`` allows any), plus the loopback names when it is bound to
    loopback; None when it is bound elsewhere and ``allowed_hosts`` is empty."""
    names = {h.strip().strip("[]").lower() for h in allowed_hosts if h.strip()}
    if "*" in names:
        return None
    if bind_host is not None and is_loopback(bind_host):
        names |= LOOPBACK_NAMES | {bind_host.strip().strip("[]").lower()}
    return frozenset(names) if names else None


class HostCheckMiddleware:
    """Pure ASGI middleware: a ``Host`` header outside ``allowed`` gets 400 before any
    route (or the API key check) runs. A request without ``Host`` (HTTP/1.0) passes: a
    browser always sends one."""

    def __init__(self, app: Any, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            header = _header(scope, b"host")
            if header is not None and host_name(header) not in self.allowed:
                err = APIError(
                    400,
                    f"this server does not answer to Host {header!r}: allowed are "
                    f"{', '.join(sorted(self.allowed))} (start it with --allowed-hosts to "
                    "add names)",
                    code="invalid_host",
                )
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def add_browser_guards(
    app: FastAPI,
    *,
    bind_host: str | None,
    allowed_hosts: Iterable[str] = (),
    allowed_origins: Iterable[str] = (),
) -> None:
    """CORS for ``allowed_origins`` only, then the Host check (added last: outermost, so a
    foreign Host is refused before anything else runs). Call after the other middleware."""
    origins = [o.strip() for o in allowed_origins if o.strip()]
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    allowed = allowed_host_names(bind_host, allowed_hosts)
    if allowed is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed)
