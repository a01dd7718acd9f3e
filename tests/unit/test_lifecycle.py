"""The server's lifecycle alone (tidal/launch/lifecycle.py): admission while draining or
asleep (503 + Retry-After), requests in flight counted to their last byte, a drain that
ends when they finish or aborts them at the timeout, and the readiness answers. The real
SIGTERM path is tests/e2e/test_lifecycle_server.py."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.waiting import wait_until_async
from tidal.launch.lifecycle import RETRY_AFTER_S, AdmissionMiddleware, Lifecycle, Phase


def _app(lifecycle: Lifecycle, release: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        await release.wait()
        return JSONResponse({"ok": True})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app.add_middleware(AdmissionMiddleware, lifecycle=lifecycle)
    return app


async def _drain_case(timeout_s: float, release_first: bool) -> tuple[list[str], int]:
    lifecycle, release = Lifecycle(timeout_s), asyncio.Event()
    await lifecycle.become_ready(None)
    aborted: list[str] = []
    done = asyncio.Event()

    def abort_all(message: str) -> int:
        aborted.append(message)
        release.set()  # the aborted request ends
        return 1

    transport = httpx.ASGITransport(app=_app(lifecycle, release))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = asyncio.create_task(client.post("/v1/completions"))
        assert await wait_until_async(lambda: lifecycle.in_flight == 1, 10)
        lifecycle.start_drain(abort_all, done.set)
        assert not done.is_set()  # the first request still runs
        assert lifecycle.readiness(engine_dead=False) == "draining"
        if release_first:
            # A timeout far away: time for a few requests while the drain waits (a short
            # one could pass during them on a loaded machine).
            refused = await client.post("/v1/completions")
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == str(RETRY_AFTER_S)
            assert refused.json()["error"]["code"] == "server_draining"
            assert (await client.get("/health")).status_code == 200  # other routes answer
            assert not done.is_set()
            release.set()
        await asyncio.wait_for(done.wait(), 30)
        assert (await first).status_code == 200
    return aborted, lifecycle.in_flight


def test_drain_waits_for_the_request_in_flight() -> None:
    aborted, in_flight = asyncio.run(_drain_case(60.0, release_first=True))
    assert aborted == [] and in_flight == 0


def test_drain_aborts_at_the_timeout_naming_it() -> None:
    aborted, in_flight = asyncio.run(_drain_case(0.2, release_first=False))
    assert len(aborted) == 1 and "--shutdown-timeout=0.2s" in aborted[0]
    assert in_flight == 0


def test_readiness_and_sleep_refusal() -> None:
    async def run() -> None:
        lifecycle = Lifecycle()
        assert lifecycle.readiness(engine_dead=False) == "starting"
        calls = 0

        async def warm_up() -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a rank is still recovering")

        await lifecycle.become_ready(warm_up)  # retried until it succeeds
        assert calls == 2 and lifecycle.phase is Phase.READY
        assert lifecycle.readiness(engine_dead=False) is None
        assert lifecycle.readiness(engine_dead=True) == "dead"
        lifecycle.sleeping = True
        assert lifecycle.readiness(engine_dead=False) == "sleeping"
        refusal = lifecycle.refusal()
        assert refusal is not None and refusal.status == 503 and refusal.code == "engine_sleeping"

    asyncio.run(run())
