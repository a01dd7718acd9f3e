"""HTTP errors: every failure becomes OpenAI's ``{"error": {message, type, param, code}}``.

400 bad input (or a Host header this server does not answer to), 401 bad API key, 404
unknown model or route, 405 a route called with another method, 408 a body not received
in time or a stream not read (the client's fault, as a 400's), 409 another scaling
operation runs, 413 body too large, 415 a JSON route's body not sent as
``application/json``, 503 dead engine, 500 bug (or a failed scaling operation);
``classify_error`` picks one for any exception a request raised. A request the engine
refused as invalid is a 400, one that failed while running a 500, both with the engine's
message.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.launch import openai_models as P
from tidal.protocol.errors import EngineDeadError, RankUnavailableError, RequestFailedError
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with this HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> P.ErrorResponse:
        # Any other 4xx (405 a wrong method, 422) is the request's fault too.
        fallback = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        kind = _ERROR_TYPES.get(self.status, fallback)
        info = P.ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return P.ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


# Request fields and SamplingParams fields: a ValueError message starting with one of
# these names (``stop_token_ids[2] must ...``, ``messages[0].role ...``) is about it.
_PARAMS = (
    set(P.CompletionRequest.model_fields)
    | set(P.ChatCompletionRequest.model_fields)
    | set(SamplingParams.__struct_fields__)
)
_HEAD = re.compile(r"[A-Za-z_]+")


def _bad_value(exc: ValueError | RequestFailedError) -> APIError:
    msg = str(exc)
    head = _HEAD.match(msg)
    param = head.group() if head is not None and head.group() in _PARAMS else None
    return APIError(400, msg, param=param)


def classify_error(exc: BaseException, engine: Any) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError):  # this request's own error, even if the engine died
        if exc.invalid:
            return _bad_value(exc)
        logger.warning("request %s failed in the engine: %s", exc.request_id, exc.message)
        return APIError(500, exc.message, code="request_failed")
    if isinstance(exc, RankUnavailableError) and not engine.is_dead:
        return APIError(503, str(exc), param="data_parallel_rank", code="rank_unavailable")
    if isinstance(exc, EngineDeadError) or engine.is_dead:
        return APIError(503, f"engine is dead: {exc}", code="engine_dead")
    if isinstance(exc, ValueError):
        return _bad_value(exc)
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first error as "field.path: message", and its top-level field as param."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first['msg']}" if where else first["msg"]), (loc[0] if loc else None)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return APIError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()
