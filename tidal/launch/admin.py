"""Operator routes: ``/health``, ``/ping``, ``/version``, ``/metrics`` (prometheus text),
``/stats`` (JSON) and ``/dashboard`` (the static load-balance page)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import tidal
from tidal.launch.dashboard import dashboard_html
from tidal.launch.errors import classify_error
from tidal.launch.metrics import CONTENT_TYPE, ServerMetrics
from tidal.launch.serving import OpenAIServing

logger = logging.getLogger(__name__)


def add_admin_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    engine = serving.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        serving.check_alive()
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": tidal.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if getattr(engine, "has_expert_load", False) and not engine.is_dead:
            try:
                metrics.record_expert_load(await engine.get_expert_load())
            except Exception:  # noqa: BLE001 - metrics must render even if a rank is busy
                logger.warning("expert load unavailable for /metrics", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        # Public (see PUBLIC_PAGES): the page asks for the API key and never caches.
        return Response(
            dashboard_html(), media_type="text/html", headers={"Cache-Control": "no-store"}
        )

    @app.get("/stats")
    async def stats() -> JSONResponse:
        serving.check_alive()
        try:
            return JSONResponse(await engine.get_stats())
        except Exception as e:  # noqa: BLE001
            return classify_error(e, engine).response()
