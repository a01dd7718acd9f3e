"""vLLM's sleep mode routes (docs/operations.md#sleep-mode): ``POST /sleep?level=1|2``
frees the KV cache on every rank (level 2: and the weights), ``POST /wake_up`` makes it
again (level 2: reloads the weights from the checkpoint first), ``GET /is_sleeping``
answers ``{"is_sleeping": bool}``. While asleep, generation requests get 503 with
``Retry-After`` (``lifecycle.AdmissionMiddleware``) and ``/ready`` says ``sleeping``.

Sleep needs an idle server: with generation requests in flight it is a 409 (retry when
they finished). The routes run one at a time, so a sleep and a wake-up never interleave.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from tidal.launch.errors import APIError, classify_error
from tidal.launch.lifecycle import Lifecycle, Phase
from tidal.launch.serving import OpenAIServing


def add_sleep_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.engine
    lifecycle: Lifecycle = app.state.lifecycle
    lock = asyncio.Lock()

    @app.post("/sleep")
    async def sleep(level: int = Query(1)) -> JSONResponse:
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
        serving.check_alive()
        async with lock:
            if lifecycle.phase is Phase.DRAINING:
                raise APIError(503, "the server is shutting down", code="server_draining")
            if lifecycle.in_flight:
                raise APIError(
                    409,
                    f"{lifecycle.in_flight} request(s) in flight; sleep when they finished",
                    code="requests_in_flight",
                )
            lifecycle.sleeping = True  # admits nothing from here on
            try:
                freed = await engine.sleep(level)
            except Exception as e:  # noqa: BLE001 - awake as before, the error answered
                if not await _asleep(engine):
                    lifecycle.sleeping = False
                err = classify_error(e, engine)
                if err.status == 500:  # a request reached an engine first: retryable
                    err = APIError(409, f"cannot sleep now: {e}", code="requests_in_flight")
                raise err from e
        return JSONResponse({"is_sleeping": True, "level": level, "freed_bytes": freed})

    @app.post("/wake_up")
    async def wake_up() -> JSONResponse:
        serving.check_alive()
        async with lock:
            try:
                await engine.wake_up()
            except Exception as e:  # noqa: BLE001 - still asleep: the error answered
                raise classify_error(e, engine) from e
            lifecycle.sleeping = False
        return JSONResponse({"is_sleeping": False})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": lifecycle.sleeping})


async def _asleep(engine: object) -> bool:
    # Some rank may have slept before another refused: then the deployment is asleep
    # until /wake_up (which wakes those that slept).
    try:
        return bool(await engine.is_sleeping())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - unknown: keep refusing until /wake_up
        return True
