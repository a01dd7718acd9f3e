"""Operator routes: ``/health``, ``/ping``, ``/version``, ``/metrics`` (prometheus text),
``/stats`` (JSON) and ``/dashboard`` (the static load-balance page).

``/stats`` is the engine's (per-rank load keyed by rank and ``engine_id``, waves, expert
load) plus what the API server knows: ``scaling`` (whether an elastic EP operation runs,
and the records of the last ``SCALING_HISTORY`` operations, oldest first) and ``tokens``
(prompt and generated tokens this server has counted, all ranks together).
"""

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

SCALING_HISTORY = 50  # operation records in /stats


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
        metrics.set_scaling(engine.is_scaling_elastic_ep())
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
            stats = await engine.get_stats()
        except Exception as e:  # noqa: BLE001
            return classify_error(e, engine).response()
        # One place for scaling (AsyncLLM's flat keys, with its whole history, folded in).
        stats.pop("is_scaling_elastic_ep", None)
        stats.pop("scaling_history", None)
        stats["scaling"] = {
            "is_scaling": bool(engine.is_scaling_elastic_ep()),
            "history": list(engine.scaling_history())[-SCALING_HISTORY:],
        }
        stats["tokens"] = {
            "prompt_total": metrics.prompt_tokens_total,
            "generation_total": metrics.generation_tokens_total,
        }
        return JSONResponse(stats)
