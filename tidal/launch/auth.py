"""API-key authentication: a pure ASGI middleware in front of every route."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from tidal.launch.errors import APIError

# Static pages, served without the API key: they hold no data and ask the user for the
# key, which their own fetches then send as a header (a key in the URL would end up in
# history, logs and Referer headers).
PUBLIC_PAGES = frozenset({"/dashboard"})


class BearerAuthMiddleware:
    """Pure ASGI middleware: every HTTP route needs ``Authorization: Bearer <api_key>``,
    except GET/HEAD of the static ``PUBLIC_PAGES``.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect
    cancellation pass through untouched.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or self._public(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key", code="invalid_api_key")
        await err.response()(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return secrets.compare_digest(value, self.expected)
        return False

    @staticmethod
    def _public(scope: dict) -> bool:
        return scope["method"] in ("GET", "HEAD") and scope["path"] in PUBLIC_PAGES
