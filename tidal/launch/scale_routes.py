"""Elastic EP routes (docs/architecture.md#elastic-api), vLLM's paths and fields:

- ``POST /scale_elastic_ep {"new_data_parallel_size": N, "drain_timeout": s,
  "operation_id": str}`` runs one operation and answers when it has ended: 200 with its
  record (``OperationRecord.to_dict``; also for a repeated ``operation_id``, which returns
  the first operation's record, still running or not), 409 while another operation runs,
  500 when it rolled back or failed (``result``; ``cause`` says why), 400 for a body or a
  size that cannot be served (or elastic EP off).
- ``GET|POST /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool}``.

Errors are the server's OpenAI error JSON; a 409 or 500 also carries the record of the
operation in the way (409) or of the one that failed (500) as ``"operation"``. The API
key (``auth``) protects both routes like every other.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from tidal.frontend.scaling.scale_records import ScalePhase
from tidal.launch.errors import APIError, classify_error
from tidal.launch.http_limits import read_json

if TYPE_CHECKING:
    from tidal.launch.serving import OpenAIServing

# A drain longer than a day is a typo, and unbounded timeouts overflow the timers and
# thread waits that carry them.
MAX_DRAIN_TIMEOUT_S = 86400.0
MAX_OPERATION_ID_CHARS = 256
FLAG = "--enable-elastic-ep"


class ScaleElasticEPRequest(BaseModel):
    """The body of ``POST /scale_elastic_ep``; strict: unknown fields, strings for numbers
    and booleans for either are refused (a scale request is not worth guessing at)."""

    model_config = ConfigDict(extra="forbid")

    new_data_parallel_size: StrictInt = Field(ge=1)
    # null means unset, as everywhere in this API.
    drain_timeout: float | None = Field(
        default=0.0, ge=0, le=MAX_DRAIN_TIMEOUT_S, allow_inf_nan=False, strict=True
    )
    operation_id: StrictStr | None = Field(
        default=None, min_length=1, max_length=MAX_OPERATION_ID_CHARS
    )


_FIELDS = frozenset(ScaleElasticEPRequest.model_fields)
_FAILED = frozenset({ScalePhase.ROLLED_BACK, ScalePhase.FAILED})  # OperationRecord results
_HEAD = re.compile(r"[A-Za-z_]+")


def _refused(exc: ValueError) -> APIError:
    """The engine's refusal (a size the placement cannot serve, ...) as a 400 naming the
    field its message starts with."""
    msg = str(exc)
    head = _HEAD.match(msg)
    param = head.group() if head is not None and head.group() in _FIELDS else None
    return APIError(400, msg, param=param, code="invalid_scale_request")


def _failed_response(status: int, record: dict[str, Any]) -> JSONResponse:
    """A 409 (another operation runs) or 500 (this one rolled back or failed): the error
    JSON, with the operation's record."""
    op = record.get("operation_id")
    sizes = f"{record.get('from_size')} -> {record.get('to_size')}"
    if status == 409:
        err = APIError(
            409,
            f"another scaling operation is running: {op} ({sizes}, phase "
            f"{record.get('phase')}); retry once /is_scaling_elastic_ep is false",
            code="scaling_in_progress",
        )
    else:
        result = str(record.get("result") or ScalePhase.FAILED)
        cause = record.get("cause") or "no cause reported"
        err = APIError(
            status,
            f"scaling operation {op} ({sizes}) {result.replace('_', ' ')}: {cause}",
            code=f"scale_{result}",
        )
    body = err.body().model_dump()
    body["operation"] = record
    return JSONResponse(body, status_code=status)


def add_scale_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.engine
    # Operations whose request went away: kept referenced until they end (see below).
    running: set[asyncio.Task] = set()

    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request) -> Response:
        try:
            req = await read_json(request, ScaleElasticEPRequest)
            serving.check_alive()
            if not engine.config.parallel.enable_elastic_ep:
                raise APIError(
                    400,
                    f"elastic EP is not enabled on this server: start it with {FLAG}",
                    code="elastic_ep_disabled",
                )
            # The operation outlives this request if it must: cancelling a half-done
            # reconfiguration because a client hung up (or a proxy timed out) would only
            # turn it into a rollback. It is recorded either way (/stats, the listener).
            task = asyncio.ensure_future(
                engine.scale_elastic_ep(
                    req.new_data_parallel_size,
                    drain_timeout=req.drain_timeout or 0.0,
                    operation_id=req.operation_id,
                )
            )
            running.add(task)
            task.add_done_callback(running.discard)
            status, record = await asyncio.shield(task)
        except ValueError as e:  # APIError is no ValueError: it is answered as it is
            return _refused(e).response()
        except Exception as e:  # noqa: BLE001 - every failure becomes the error JSON
            return classify_error(e, engine).response()
        if status == 200 and record.get("result") in _FAILED:
            status = 500  # the operation ended, without the new size: not a success
        if status == 200:
            return JSONResponse(record)
        return _failed_response(status, record)

    @app.api_route("/is_scaling_elastic_ep", methods=["GET", "POST"])
    async def is_scaling_elastic_ep() -> JSONResponse:
        return JSONResponse({"is_scaling_elastic_ep": bool(engine.is_scaling_elastic_ep())})
