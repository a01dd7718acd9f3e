"""Request bodies, checked before any route reads them: their size (``BodyLimitMiddleware``,
before the body is read), their media type (``read_json``: only ``application/json``), encoding,
JSON syntax, the route's own size limits on the raw JSON (``precheck``), nesting depth and
every number in them (``decode_json_body``), then their shape against the route's pydantic
model (``parse_request``). Each check stops what the next one cannot handle.

Why the media type: a web page can POST ``text/plain`` (or a form) to any address without
a CORS preflight, so a JSON route that parsed any body could be driven by every page the
operator opens. ``application/json`` needs a preflight, which this server never answers
unless ``--allowed-origins`` lists the page's origin.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from tidal.launch.errors import APIError, validation_message
from tidal.sampling_params import INT64_MAX, INT64_MIN


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"request body is larger than {limit} bytes (the server's --max-request-body-bytes)",
            code="request_too_large",
        )


class BodyTimeout(APIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"request body not received within {timeout_s:g} s (the server's --http-body-timeout)",
            code="request_timeout",
        )

    def response(self) -> JSONResponse:
        resp = super().response()
        # The rest of the body may still trickle in: drop the connection rather than
        # read it to the end.
        resp.headers["connection"] = "close"
        return resp


class BodyLimitMiddleware:
    """Pure ASGI middleware: a body over ``max_bytes`` gets 413 without being read, one
    that does not arrive within ``timeout_s`` (None: no limit) gets 408.

    A Content-Length over the limit is refused before the app runs; a chunked body is
    counted as it streams and refused at the first chunk past the limit, so nothing over
    the limit is ever buffered. uvicorn discards the rest of a refused body itself (the
    response carries a Content-Length and keeps the connection), so the client reads the
    413 instead of a reset. The time counts from the request's headers to its body's last
    byte, so a body sent a byte at a time cannot hold a connection for long."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0
        body_done = False
        loop = asyncio.get_running_loop()
        timeout_s = self.timeout_s
        deadline = None if timeout_s is None else loop.time() + timeout_s

        async def limited_receive() -> dict:
            nonlocal seen, body_done
            if body_done or deadline is None:
                message = await receive()  # after the body: a disconnect, whenever it comes
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise BodyTimeout(timeout_s or 0.0) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # an APIError: handlers answer it as is
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses these before we see them
    return None


# OpenAI requests nest fewer than ten levels (tools' JSON schemas included); anything much
# deeper only exercises recursion in the parser, pydantic and the chat template.
MAX_JSON_DEPTH = 64


Precheck = Callable[[Any], None]


def decode_json_body(body: bytes, precheck: Precheck | None = None) -> Any:
    """The request body as JSON, or APIError 400 saying what is wrong with it: not UTF-8,
    not JSON (NaN and Infinity included: not JSON, and not a number any field takes),
    refused by ``precheck`` (the route's cheap size limits, given the decoded JSON as it
    is; a ValueError it raises is a 400 naming its field), nested deeper than
    ``MAX_JSON_DEPTH``, a number no field can hold (an int outside int64, a float that
    overflows to infinity), or a string or key with a lone surrogate (``"\\ud800"``: JSON
    lets it through, but it is not text: tokenizers refuse it and no response could
    echo it). Checked for every field of every route at once, before any field's own
    checks."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # the C parser's own depth guard (about 1000 levels)
        raise APIError(400, _TOO_DEEP) from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if precheck is not None:
        precheck(data)  # before the walk below: it visits every item of a huge list
    _check_json_values(data)
    return data


_TOO_DEEP = f"JSON body is nested deeper than {MAX_JSON_DEPTH} levels"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _check_json_values(data: Any) -> None:
    """Depth, numbers and strings, iteratively (a recursive walk would itself hit the
    recursion limit); the error names the path of the value, like pydantic's errors do."""
    if not isinstance(data, (dict, list)):
        _check_scalar(data, ())
        return
    stack: list[tuple[dict | list, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise APIError(400, _TOO_DEEP, param=_top(path))
        for key, v in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(key, str):
                _check_text(key, (*path, key), "key")
            if isinstance(v, (dict, list)):
                stack.append((v, (*path, key)))
            else:
                _check_scalar(v, (*path, key))


def _check_scalar(v: Any, path: tuple[str | int, ...]) -> None:
    if isinstance(v, str):
        _check_text(v, path, "string")
        return
    if isinstance(v, bool):
        return
    if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:
        problem = f"{v} is out of range (integers must fit in 64 bits)"
    elif isinstance(v, float) and not math.isfinite(v):
        problem = "number is too large"
    else:
        return
    raise APIError(400, f"{_where(path)}: {problem}", param=_top(path))


def _check_text(s: str, path: tuple[str | int, ...], what: str) -> None:
    if s.isascii():  # the common case, without a copy
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(s[e.start])
        raise APIError(
            400,
            f"{_where(path)}: {what} holds a lone surrogate (U+{code:04X} at index {e.start}), "
            "which is not valid Unicode text",
            param=_top(path),
        ) from None


def _printable(key: str | int) -> str:
    # A key may itself be the bad text: escape it, or the error could not be sent either.
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(map(_printable, path)) or "body"


def _top(path: tuple[str | int, ...]) -> str | None:
    return _printable(path[0]) if path and isinstance(path[0], str) else None


def parse_request(body: bytes, model: type[BaseModel], precheck: Precheck | None = None) -> Any:
    """Body bytes -> request model, or APIError 400 (runs in a worker thread)."""
    data = decode_json_body(body, precheck)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(400, msg, param=param) from None


class UnsupportedMediaType(APIError):
    def __init__(self, got: str | None) -> None:
        super().__init__(
            415,
            "request body must be JSON: send Content-Type: application/json, got "
            + (repr(got) if got else "no Content-Type"),
            code="unsupported_media_type",
        )


def check_json_content_type(content_type: str | None) -> None:
    """``application/json``, with no parameter but an optional UTF-8 charset (JSON is
    UTF-8, RFC 8259), or APIError 415."""
    media, *params = (content_type or "").split(";")
    if media.strip().lower() != "application/json":
        raise UnsupportedMediaType(content_type)
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() != "charset" or value.strip().strip('"').lower() != "utf-8":
            raise UnsupportedMediaType(content_type)


async def read_json(
    request: Request, model: type[BaseModel], precheck: Precheck | None = None
) -> Any:
    """A JSON route's body as ``model``: 415 unless it is ``application/json`` (checked
    before a byte of it is read), then ``parse_request`` off the event loop."""
    check_json_content_type(request.headers.get("content-type"))
    body = await request.body()  # bounded by BodyLimitMiddleware
    return await asyncio.to_thread(parse_request, body, model, precheck)
