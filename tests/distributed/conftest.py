"""Helpers for tests that run real processes talking over real TCP on 127.0.0.1.

The ``run_ranks`` fixture is ``spawn_ranks(fn, world_size, *args, timeout_s=...)``: it runs ``fn(rank, world_size, *args)`` in
``world_size`` fresh 'spawn' processes at once and returns their results in rank order.
``fn`` must be a module-level function of the test module (it is pickled by reference)
and its arguments and result must be picklable. If any rank raises, the remote traceback
is re-raised here; if the ranks do not all finish within ``timeout_s``, every process is
killed and the test fails with the ranks still running. No process outlives the call.

The ``run_ranks_on_ports`` fixture is the same with TCP ports for the ranks' stores:
``fn(rank, world_size, port, *args)`` (``ports``, a list, when ``num_ports > 1``). A port
picked here can be taken by another process before rank 0 binds it; when a rank fails
because its address is in use, every rank is stopped and the run starts again on fresh
ports.

The workers are a ``ProcessPoolExecutor`` because its entry point is importable from the
standard library: a helper function defined here would be pickled as ``conftest.<name>``,
which is ambiguous when several test folders each have a conftest.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tidal.distributed.ports import get_open_port


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank."""
    pool = cf.ProcessPoolExecutor(
        max_workers=world_size,
        mp_context=mp.get_context("spawn"),
        initializer=torch.set_num_threads,  # 2 shared cores: no intra-op thread pools
        initargs=(1,),
    )
    ok = False
    try:
        futures = [pool.submit(fn, rank, world_size, *args) for rank in range(world_size)]
        results = _collect(futures, time.monotonic() + timeout_s, timeout_s)
        ok = True
        return results
    finally:
        if not ok:
            _kill_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)


def spawn_ranks_on_ports(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    num_ports: int = 1,
    timeout_s: float = 60.0,
    attempts: int = 3,
) -> list[Any]:
    """``spawn_ranks(fn, world_size, port(s), *args)``, again on new ports after a conflict."""
    for attempt in range(attempts):
        ports = [get_open_port() for _ in range(num_ports)]
        try:
            return spawn_ranks(
                fn, world_size, ports[0] if num_ports == 1 else ports, *args, timeout_s=timeout_s
            )
        except AssertionError as e:
            if attempt + 1 == attempts or not _port_conflict(e):
                raise
    raise AssertionError("unreachable")


def _port_conflict(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text


def _collect(futures: list[cf.Future], deadline: float, timeout_s: float) -> list[Any]:
    pending = set(futures)
    while pending:
        done, pending = cf.wait(
            pending, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_EXCEPTION
        )
        for f in done:
            if f.exception() is not None:
                rank = futures.index(f)
                raise AssertionError(f"rank {rank} failed: {f.exception()!r}") from f.exception()
        if pending and time.monotonic() >= deadline:
            still = sorted(futures.index(f) for f in pending)
            raise AssertionError(f"ranks {still} did not finish within {timeout_s} s")
    return [f.result() for f in futures]


def _kill_workers(pool: cf.ProcessPoolExecutor) -> None:
    # No public API kills a pool's workers before Python 3.14; _processes is stable since 3.2.
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        if proc.is_alive():
            proc.kill()
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.join(timeout=5)


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """``spawn_ranks`` as a fixture: test modules cannot reliably ``import conftest``."""
    return spawn_ranks


@pytest.fixture
def run_ranks_on_ports() -> Callable[..., list[Any]]:
    """``spawn_ranks_on_ports`` as a fixture."""
    return spawn_ranks_on_ports
