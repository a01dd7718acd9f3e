"""OpenAI-compatible HTTP server: builds the FastAPI app around an ``AsyncLLM`` and runs
it under uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``
(``serving``); ``/v1/responses`` (``responses``); ``/tokenize``, ``/detokenize``
(``tokenize_routes``); ``/health``, ``/ping``, ``/version``, ``/metrics`` (prometheus text),
``/stats`` (JSON), ``/dashboard``, ``/ready`` (``admin``); ``/sleep``, ``/wake_up``,
``/is_sleeping`` (``sleep``); ``/scale_elastic_ep`` and
``/is_scaling_elastic_ep`` (``scale_routes``). Every error is OpenAI's error JSON
(``errors``); the server keeps serving after any of them.

Input is checked where it enters, in layers, each stopping what the next cannot handle:
the API key (``auth``), the body's size, encoding, JSON syntax, depth and numbers
(``http_limits``), the request's shape (pydantic), each sampling field (``SamplingParams``'
own table), and what the model and the deployment allow (``InputProcessor.check``, shared
with ``LLM`` and ``AsyncLLM``).

The engine is duck-typed (see ``AsyncLLM``): the server imports no torch and starts no
process, so it can be tested against a fake engine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import APIRouter, FastAPI

import tidal
from tidal.launch.admin import add_admin_routes
from tidal.launch.auth import BearerAuthMiddleware
from tidal.launch.connections import ServerLimits, guarded_protocol
from tidal.launch.errors import add_error_handlers
from tidal.launch.hosts import add_browser_guards
from tidal.launch.http_limits import BodyLimitMiddleware
from tidal.launch.lifecycle import (
    AdmissionMiddleware,
    DrainingServer,
    Lifecycle,
    ShutdownOptions,
)
from tidal.launch.metrics import ServerMetrics
from tidal.launch.responses import add_responses_routes
from tidal.launch.scale_routes import add_scale_routes
from tidal.launch.serving import OpenAIServing, add_openai_routes
from tidal.launch.sleep import add_sleep_routes
from tidal.launch.tokenize_routes import add_tokenize_routes

if TYPE_CHECKING:  # annotations only: the server takes any engine with AsyncLLM's
    # interface and imports no torch (AsyncLLM does), so tests run it on a fake engine.
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


def build_app(
    engine: AsyncLLM,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    metrics: ServerMetrics | None = None,
    shutdown_engine: bool = True,
    routers: Sequence[APIRouter] = (),
    bind_host: str | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    limits: ServerLimits | None = None,
    lifecycle: Lifecycle | None = None,
) -> FastAPI:
    """The FastAPI app. ``metrics`` is registered as the engine's stat logger and scale
    listener; on lifespan shutdown (SIGTERM/SIGINT under uvicorn) ``engine.shutdown()``
    is awaited unless ``shutdown_engine`` is False. ``routers`` (admin, dashboard) are
    included as they are; the API key protects them too. Handlers find the engine and
    metrics on ``request.app.state``. ``bind_host`` (the address the server listens on),
    ``allowed_hosts`` and ``allowed_origins`` set the Host check and CORS (``hosts``);
    an empty ``api_key`` is an error, not "no authentication". ``limits``: the body
    timeout and the stream backlog (the connection limits are ``make_server``'s).
    ``lifecycle``: readiness, admission and drain (``lifecycle``; default: a fresh one)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (None: no API key)")
    if metrics is None:
        model = getattr(getattr(engine, "config", None), "model", None)
        metrics = ServerMetrics(
            model_name=served_model_name or engine.served_model_name,
            max_model_len=getattr(model, "max_model_len", 2048),
        )
    engine.add_stat_logger(metrics)
    engine.add_scale_listener(metrics.record_scale_operation)
    limits = limits if limits is not None else ServerLimits()
    lifecycle = lifecycle if lifecycle is not None else Lifecycle()
    serving = OpenAIServing(
        engine,
        served_model_name or engine.served_model_name,
        max_stream_backlog=limits.max_stream_backlog,
        on_backlog_abort=metrics.stream_backlog_aborts.inc,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = getattr(engine, "start", None)
        if start is not None:
            start()  # heartbeats and rank-death recovery run from startup, not first use
        ready = asyncio.get_running_loop().create_task(
            lifecycle.become_ready(getattr(engine, "warm_up", None))
        )
        try:
            yield
        finally:
            ready.cancel()
            if serving.template_sandbox is not None:
                await serving.template_sandbox.close()
            if shutdown_engine:
                logger.info("shutting down the engine")
                await engine.shutdown()

    app = FastAPI(title="Tidal", version=tidal.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    app.state.lifecycle = lifecycle
    # Innermost: only authenticated, well-formed traffic is admitted and counted.
    app.add_middleware(AdmissionMiddleware, lifecycle=lifecycle)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=serving.limits.max_request_body_bytes,
        timeout_s=limits.body_timeout_s,
    )
    # Outermost: a foreign Host is refused before anything else runs, an oversized body
    # right after (before the API key is even looked at).
    add_browser_guards(
        app,
        bind_host=bind_host,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    )
    add_error_handlers(app)
    add_openai_routes(app, serving)
    add_tokenize_routes(app, serving)
    add_responses_routes(app, serving)
    add_admin_routes(app, serving, metrics)
    add_scale_routes(app, serving)
    add_sleep_routes(app, serving)
    for router in routers:
        app.include_router(router)
    return app


# ---- serving with uvicorn ----------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 picks a free port. Binding before
    the engines start reserves the port and lets the caller learn it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def make_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    timeout_keep_alive: int = 5,
    timeout_graceful_shutdown: float | None = 10.0,
    limits: ServerLimits | None = None,
    on_serving: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve(sockets=[sock])`` to run it on a
    pre-bound socket, set ``server.should_exit = True`` to stop it. SIGTERM/SIGINT drain
    first (``lifecycle.DrainingServer``, with the app's ``Lifecycle``); once stopping,
    open connections get ``timeout_graceful_shutdown`` seconds more. ``limits``: the
    connection cap and the header timeout (``connections``). ``on_serving``: called once
    the server accepts, its signal handlers in place."""
    limits = limits if limits is not None else ServerLimits()
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        backlog=limits.accept_backlog,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=timeout_keep_alive,
        # uvicorn waits with asyncio (a float is fine); its annotation says int.
        timeout_graceful_shutdown=timeout_graceful_shutdown,  # pyright: ignore[reportArgumentType]
    )
    abort_all = getattr(app.state.engine, "abort_all", None) or (lambda _message: 0)
    lifecycle = getattr(app.state, "lifecycle", None) or Lifecycle()
    return DrainingServer(config, lifecycle, abort_all, on_serving)


async def serve(
    engine: AsyncLLM,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    timeout_graceful_shutdown: float | None = 10.0,
    routers: Sequence[APIRouter] = (),
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    limits: ServerLimits | None = None,
    shutdown_timeout: float = ShutdownOptions.shutdown_timeout,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain for up to ``shutdown_timeout`` seconds
    (``lifecycle``); the engine is shut down on the way out. The Host check
    follows the address served: ``sock``'s when given, else ``host``. ``on_serving`` is
    called once the server accepts, with its signal handlers in place.

    A drained shutdown returns normally (the process can exit 0); a second signal is
    uvicorn's own stop, which re-raises it once the previous handlers are restored."""
    app = build_app(
        engine,
        api_key=api_key,
        served_model_name=served_model_name,
        routers=routers,
        bind_host=sock.getsockname()[0] if sock is not None else host,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        limits=limits,
        lifecycle=Lifecycle(shutdown_timeout),
    )
    server = make_server(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        limits=limits,
        on_serving=on_serving,
    )
    await server.serve(sockets=[sock] if sock is not None else None)


def run_server(make_engine: Callable[[], Any], **kwargs: Any) -> None:
    """Blocking entry point. ``make_engine`` (sync or async, no arguments) is called inside
    the server's event loop, since AsyncLLM's queues and sockets belong to that loop.
    ``kwargs`` are ``serve``'s."""

    async def main() -> None:
        engine = make_engine()
        if asyncio.iscoroutine(engine):
            engine = await engine
        await serve(engine, **kwargs)

    asyncio.run(main())
