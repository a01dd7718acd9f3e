"""Operator routes: ``/health``, ``/ping``, ``/version``, ``/metrics`` (prometheus text),
``/stats`` (JSON), ``/dashboard`` (the static load-balance page) and ``/ready``.

``/health`` (liveness) is 200 ``{"status": "ok"}``; 200 ``{"status": "draining"}`` after
SIGTERM (docs/operations.md#lifecycle: alive, finishing its requests); 200
``{"status": "degraded", "detail": why, "serving_engines": n}`` while the deployment
serves below full health (a rank died and its recovery runs,
docs/architecture.md#faults): it still answers, so a load balancer keeps it; 503 when
nothing can serve (the engine client is dead, or no live member is left).
``/ready`` (readiness) is 200 ``{"status": "ready"}`` once every rank served its first
step, else 503 with why not: ``starting``, ``draining``, ``sleeping`` or ``dead``.

``/stats`` is the engine's (per-rank load keyed by rank and ``engine_id``, waves, expert
load) plus what the API server knows: ``scaling`` (whether an elastic EP operation runs,
and the records of the last ``SCALING_HISTORY`` operations, oldest first), ``faults``
(``AsyncLLM.fault_status()``: rank deaths and their recoveries; null for an engine that
has none) and ``tokens`` (prompt and generated tokens this server has counted, all ranks
together).
"""

from __future__ import annotations

import logging
import typing
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import tidal
from tidal.launch.dashboard import dashboard_html
from tidal.launch.errors import APIError, classify_error
from tidal.launch.lifecycle import Lifecycle, Phase
from tidal.launch.metrics import CONTENT_TYPE, ServerMetrics
from tidal.launch.serving import OpenAIServing

logger = logging.getLogger(__name__)

SCALING_HISTORY = 50  # operation records in /stats


def add_admin_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    engine = serving.engine
    lifecycle: Lifecycle = app.state.lifecycle

    @app.get("/health")
    async def health() -> JSONResponse:
        serving.check_alive()
        if lifecycle.phase is Phase.DRAINING:
            return JSONResponse({"status": "draining"})
        faults = fault_status(engine)
        if faults is None or faults.get("degraded") is None:
            return JSONResponse({"status": "ok"})
        detail, live = faults["degraded"], faults.get("serving_engines")
        if live == 0:  # every member dead: the client fails next; nothing serves meanwhile
            raise APIError(503, f"no engine can serve: {detail}", code="engine_dead")
        return JSONResponse({"status": "degraded", "detail": detail, "serving_engines": live})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        why = lifecycle.readiness(engine.is_dead)
        if why is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": why}, status_code=503)

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
                load = await engine.get_expert_load()
                metrics.record_expert_load(load)
                metrics.record_engine_expert_load(await engine.get_engine_expert_load(load))
            except Exception:  # noqa: BLE001 - metrics must render even if a rank is busy
                logger.warning("expert load unavailable for /metrics", exc_info=True)
        config = getattr(engine, "config", None)
        has_kernels = callable(getattr(engine, "get_cpu_kernels", None))
        if has_kernels and getattr(config, "device", None) == "cpu" and not engine.is_dead:
            try:
                metrics.record_cpu_kernels(await engine.get_cpu_kernels())
            except Exception:  # noqa: BLE001 - as above
                logger.warning("kernel choices unavailable for /metrics", exc_info=True)
        metrics.set_scaling(engine.is_scaling_elastic_ep())
        processes = getattr(engine, "processes", None)
        if callable(processes):
            info = typing.cast(dict[int, dict[str, Any]], processes())
            metrics.record_processes(engine.config.parallel.tensor_parallel_size, info)
        faults = fault_status(engine)
        if faults is not None:
            metrics.record_faults(faults)
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
        stats["faults"] = fault_status(engine)
        stats["tokens"] = {
            "prompt_total": metrics.prompt_tokens_total,
            "generation_total": metrics.generation_tokens_total,
        }
        return JSONResponse(stats)


def fault_status(engine: Any) -> dict[str, Any] | None:
    """``AsyncLLM.fault_status()`` (rank deaths, docs/architecture.md#faults), or None for an engine
    that does not report them (a test double, a non-elastic stand-in)."""
    status = getattr(engine, "fault_status", None)
    if not callable(status):
        return None
    return typing.cast(dict[str, Any], status())
