"""``launch``: start the engine rank(s) and the API server; stop everything on the way out.

Order matters for a clean failure: the HTTP port is bound first (a taken port fails before
any engine loads), then the engines start and handshake, then uvicorn serves. SIGTERM or
Ctrl-C drains (``lifecycle``: new requests 503, those in flight get ``--shutdown-timeout``
seconds, then are aborted), then the app's lifespan shuts the engines down (SIGTERM to
each engine process, join, kill if stuck) and removes the private IPC directory; the
process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable

from tidal.config import EngineConfig, option_specs
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.launchers.base import LauncherUnavailable
from tidal.frontend.launchers.mp import spawn_headless_engines
from tidal.frontend.launchers.registry import launcher_kind
from tidal.launch.api_key import add_api_key_arg, resolve_api_key
from tidal.launch.api_server import bind_socket, run_server
from tidal.launch.args import add_engine_args, add_option_args, build_engine_config, flag_of
from tidal.launch.connections import ServerLimits
from tidal.launch.lifecycle import ShutdownOptions
from tidal.utils.secret_env import SECRET_ENV_VARS


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch", description="serve an MoE model over HTTP (OpenAI API)"
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    add_api_key_arg(p, "require this bearer token on every route")
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="Host header names the server answers to (besides localhost, 127.0.0.1 and "
        "[::1] when --host is loopback); '*' for any. Default: loopback names when bound "
        "to loopback, else any",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="web origins (scheme://host[:port]) whose pages may call the API (CORS); "
        "'*' for any. Default: none, no CORS headers",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the path)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default: %(default)s)",
    )
    add_option_args(p, option_specs(ServerLimits))
    add_option_args(p, option_specs(ShutdownOptions))
    p.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's engine ranks (no API server); they join the frontend at "
        "--data-parallel-address:--data-parallel-rpc-port",
    )
    add_engine_args(p)
    return p


def _open_file_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _default_max_connections() -> int:
    # Half the descriptors: the rest stays for engines, their sockets and pipes, the
    # processes recovery starts, and the connections a flood holds while being refused
    # (ServerLimits.accept_backlog), however many clients connect.
    limit = _open_file_limit()
    return 4096 if limit is None else max(1, min(4096, limit // 2))


def _server_limits(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerLimits:
    """The HTTP limits, or a usage error naming the flag."""
    max_connections = (
        _default_max_connections() if ns.max_connections is None else ns.max_connections
    )
    values = {spec.field.name: getattr(ns, spec.name) for spec in option_specs(ServerLimits)}
    try:
        limits = ServerLimits(**{**values, "max_connections": max_connections})
    except ValueError as e:  # it starts with the option's name
        parser.error(f"{flag_of(str(e).split(' ', 1)[0])}: {e}")
    limit = _open_file_limit()
    if limit is not None and max_connections >= limit:
        parser.error(
            f"--max-connections: {max_connections} would leave no file descriptors for the "
            f"engines and recovery (the open-file limit is {limit}; ulimit -n)"
        )
    return limits


def _check_multi_node(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, config: EngineConfig
) -> None:
    par = config.parallel
    kind = launcher_kind(par.data_parallel_backend)
    if ns.headless and kind.headless_error is not None:
        parser.error(f"--headless: {kind.headless_error}")
    if kind.starts_all_ranks:
        return  # the launcher places the ranks; the frontend picks its own ports
    remote = ns.headless or par.data_parallel_size_local < par.data_parallel_size
    if remote and not ns.data_parallel_rpc_port:
        parser.error(
            "--data-parallel-rpc-port: required when ranks run on other hosts (--headless)"
        )
    if par.data_parallel_start_rank + par.data_parallel_size_local > par.data_parallel_size:
        parser.error(
            "--data-parallel-start-rank: start rank + --data-parallel-size-local exceeds "
            f"--data-parallel-size ({par.data_parallel_size})"
        )


def _split(values: list[str]) -> list[str]:
    """Repeated or comma-separated values of a list flag."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def run_headless(config: EngineConfig) -> int:
    """Start this host's ranks and wait; SIGTERM/SIGINT stops them."""
    par = config.parallel
    address = f"tcp://{par.data_parallel_address}:{par.data_parallel_rpc_port}"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    procs = spawn_headless_engines(config, address)
    print(f"tidal: headless ranks {[p.name for p in procs]} joining {address}", flush=True)
    while not stop.is_set() and all(p.is_alive() for p in procs):
        stop.wait(0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(15)
        if p.is_alive():
            p.kill()
            p.join(2)
        p.close()
    return 0 if stop.is_set() else 1


def _signals_end_the_start() -> Callable[[], None]:
    """Until the server takes SIGTERM and SIGINT over (uvicorn's handlers, which drain),
    either one ends the start: KeyboardInterrupt unwinds the engine being made, which
    stops every process it started. Installed even where SIGINT came in ignored (a
    non-interactive shell's background job), as uvicorn's are: there a stop sent while
    the engine started was lost and the server served on. Returns the call that marks
    serving begun; a signal after it (uvicorn puts these handlers back on its way out)
    is left to the shutdown already under way."""
    serving = threading.Event()

    def end_the_start(_sig: int, _frame: object) -> None:
        if not serving.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, end_the_start)
    signal.signal(signal.SIGINT, end_the_start)
    return serving.set


def serve_main(argv: list[str]) -> int:
    parser = make_parser()
    ns = parser.parse_args(argv)
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port: must be in [0, 65535], got {ns.port}")
    api_key = resolve_api_key(parser, ns)
    limits = _server_limits(parser, ns)
    try:
        shutdown = ShutdownOptions(shutdown_timeout=ns.shutdown_timeout)
    except ValueError as e:
        parser.error(f"--shutdown-timeout: {e}")
    config: EngineConfig = build_engine_config(parser, ns)
    _check_multi_node(parser, ns, config)
    # Read; from here on the keys travel in the config and the app, and no process this
    # one starts (Ray's local cluster included) inherits them.
    for name in SECRET_ENV_VARS:
        os.environ.pop(name, None)
    if ns.headless:
        return run_headless(config)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        parser.error(f"--port: cannot bind {ns.host}:{ns.port}: {e.strerror}")
    name = ns.served_model_name or config.model.model
    print(
        f"tidal: starting {config.parallel.data_parallel_size} engine rank(s) for {name}",
        flush=True,
    )

    serving = _signals_end_the_start()

    def on_serving() -> None:
        serving()
        host, port = sock.getsockname()[:2]
        print(f"tidal: serving on http://{host}:{port}", flush=True)

    try:
        run_server(
            lambda: AsyncLLM(config, served_model_name=name),
            on_serving=on_serving,
            sock=sock,
            api_key=api_key,
            served_model_name=name,
            log_level=ns.log_level,
            allowed_hosts=_split(ns.allowed_hosts),
            allowed_origins=_split(ns.allowed_origins),
            limits=limits,
            shutdown_timeout=shutdown.shutdown_timeout,
        )
    except KeyboardInterrupt:
        pass  # a signal before serving: the engine's start unwound what it had started
    except LauncherUnavailable as e:  # e.g. --ray-address answers nothing
        print(f"launch: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
