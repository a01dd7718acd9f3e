"""A frontend with headless ranks joined over loopback TCP, for the distributed tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from tidal.config import EngineConfig
from tidal.distributed.ports import get_open_port
from tidal.frontend.launchers.mp import spawn_headless_engines

F = TypeVar("F")


def stop_processes(procs: list[Any]) -> None:
    """Terminate (kill after 30 s), join and close engine processes."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
        p.close()


def start_with_headless(
    config_for: Callable[[int], EngineConfig],
    frontend: Callable[[EngineConfig], F],
    local: int,
    attempts: int = 3,
) -> tuple[F, list[Any]]:
    """``config_for(rpc_port)``'s ranks from ``local`` on started headless, then the
    frontend (ranks below ``local``), joined over TCP. The RPC port must be chosen before
    the frontend binds it: retried if another process took it in between."""
    for attempt in range(attempts):
        rpc = get_open_port()
        config = config_for(rpc)
        size = config.parallel.data_parallel_size
        headless = spawn_headless_engines(
            config.with_parallel(
                data_parallel_start_rank=local, data_parallel_size_local=size - local
            ),
            f"tcp://127.0.0.1:{rpc}",
        )
        try:
            return frontend(config), headless
        except zmq.ZMQError as e:
            stop_processes(headless)
            if e.errno != zmq.EADDRINUSE or attempt + 1 == attempts:
                raise
        except BaseException:
            stop_processes(headless)
            raise
    raise AssertionError("unreachable")
