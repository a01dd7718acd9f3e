"""``launch``: start the engine rank(s) and the API server; stop everything on the way out.

Order matters for a clean failure: the HTTP port is bound first (a taken port fails before
any engine loads), then the engines start and handshake, then uvicorn serves. SIGTERM or
Ctrl-C makes uvicorn drain, the app's lifespan shuts the engines down (SIGTERM to each
engine process, join, kill if stuck) and removes the private IPC directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tidal.config import EngineConfig
from tidal.launch.cli import add_engine_args, build_engine_config


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch", description="serve an MoE model over HTTP (OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TIDAL_API_KEY"), help="require this bearer token")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the path)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    return p


def serve_main(argv: list[str]) -> int:
    parser = make_parser()
    ns = parser.parse_args(argv)
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port: must be in [0, 65535], got {ns.port}")
    config: EngineConfig = build_engine_config(parser, ns)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tidal.launch.api_server import bind_socket, run_server

    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        parser.error(f"--port: cannot bind {ns.host}:{ns.port}: {e.strerror}")
    name = ns.served_model_name or config.model.model
    print(f"tidal: starting {config.parallel.data_parallel_size} engine rank(s) for {name}", flush=True)

    def make_engine():
        from tidal.frontend.async_llm import AsyncLLM

        engine = AsyncLLM(config, served_model_name=name)
        host, port = sock.getsockname()[:2]
        print(f"tidal: serving on http://{host}:{port}", flush=True)
        return engine

    try:
        run_server(
            make_engine,
            sock=sock,
            api_key=ns.api_key,
            served_model_name=name,
            log_level=ns.log_level,
        )
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
