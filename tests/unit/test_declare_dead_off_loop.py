"""Ranks declared dead are killed off the event loop (``LivenessMonitor.declare_dead``): a
launcher's kill may wait (a Ray rank's actor on a lost node answers nothing), and the loop
must keep running meanwhile -- it reads the survivors' heartbeats and sends them the
frontend's, or they would exit, taking the frontend for dead.

Five ranks of a lost node are declared dead at once while every kill is stuck; the loop
keeps ticking, and the exits reach the scale driver's hook at once. The same with Ray's
handle (``RayEngine.kill``: it must not wait for its actor's answer either)."""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest

from tests.waiting import wait_until, wait_until_async
from tidal.frontend.launchers.proc_manager import EngineProcManager
from tidal.frontend.liveness_monitor import LivenessMonitor, ScaleHooks
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.topology import Topology

RANKS = list(range(5))
STUCK_S = 30.0  # a stuck kill's own bound: the test releases it long before


class _Probe:
    """Counts kills in progress; each blocks until ``release`` (the lost node's)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.entered = 0
        self.returned = 0

    def block(self) -> None:
        with self.lock:
            self.entered += 1
        self.release.wait(STUCK_S)
        with self.lock:
            self.returned += 1

    def all_stuck(self) -> bool:
        with self.lock:
            return self.entered == len(RANKS) and self.returned == 0


class _StuckHandle:
    """A started rank whose kill waits (a launcher's handle on a lost node)."""

    def __init__(self, engine_id: int, probe: _Probe) -> None:
        self.name, self.pid, self._probe = f"EngineCore_DP{engine_id}", 1000 + engine_id, probe

    def is_alive(self) -> bool:
        return True

    def kill(self) -> None:
        self._probe.block()


def _manager(handles: dict) -> EngineProcManager:
    m = EngineProcManager.__new__(EngineProcManager)  # only what kill() uses: no processes
    m._lock = threading.Lock()
    m.procs = dict(handles)
    return m


def _client(manager: EngineProcManager, exits: list[int]) -> LivenessMonitor:
    """The client's liveness monitor over a fake process manager, no sockets; its exits
    go to a scale driver's hook (the deployment recovers)."""
    router = Router(object.__new__(EngineTransport), Topology.initial(len(RANKS)), None, None)
    m = LivenessMonitor(
        router,
        manager,
        None,
        stall_s=0.0,
        fail=lambda reason: pytest.fail(f"the client failed: {reason}"),
        fail_calls_to=lambda e, reason: None,
    )
    m.hooks = ScaleHooks(
        on_report=lambda r: None,
        owns_engine=lambda e: True,
        on_exit=lambda e, code, cause: exits.append(e),
    )
    return m


def _declare_all_while_kills_hang(client: LivenessMonitor, probe: _Probe) -> None:
    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.get_running_loop().create_task(ticker())
        try:
            await asyncio.sleep(0)
            for e in RANKS:  # one liveness round: the node's ranks found together
                client.declare_dead(e, "no heartbeat for 10.0s")
            before = ticks
            # Every kill in progress at once, and the loop runs meanwhile.
            assert await wait_until_async(lambda: probe.all_stuck() and ticks > before + 3, 20)
        finally:
            probe.release.set()
            task.cancel()

    asyncio.run(main())


def test_declared_dead_ranks_are_killed_off_the_loop():
    probe = _Probe()
    exits: list[int] = []
    client = _client(_manager({e: _StuckHandle(e, probe) for e in RANKS}), exits)
    try:
        _declare_all_while_kills_hang(client, probe)
        assert exits == RANKS  # handled as exits at once, not after the kills
        assert client.router.gone == set(RANKS)
    finally:
        probe.release.set()
        assert wait_until(lambda: probe.returned == probe.entered, 30)


def test_ray_engine_kill_does_not_wait_for_its_actor(monkeypatch):
    pytest.importorskip("ray")
    from tidal.frontend.launchers import ray as ray_launcher

    probe = _Probe()
    signals: list[bool] = []

    class _Call:
        def __init__(self, record: bool = False) -> None:
            self._record = record

        def remote(self, *args):
            if self._record:
                signals.append(args[0])
            return object()

    # The actors of a lost node: the SIGKILL is sent, its answer never comes.
    actor = SimpleNamespace(wait_exit=_Call(), signal=_Call(record=True))
    monkeypatch.setattr(ray_launcher.ray, "get", lambda ref, timeout=None: probe.block())
    monkeypatch.setattr(ray_launcher.ray, "kill", lambda actor, no_restart=True: None)
    handles = {
        e: ray_launcher.RayEngine(f"EngineCore_DP{e}", ray_launcher._Slot(None, actor), 1000 + e)
        for e in RANKS
    }
    exits: list[int] = []
    client = _client(_manager(handles), exits)
    try:
        _declare_all_while_kills_hang(client, probe)
        assert signals == [True] * len(RANKS)  # every engine was sent its SIGKILL
        assert exits == RANKS
    finally:
        probe.release.set()
        assert wait_until(lambda: probe.returned == probe.entered, 30)
        for h in handles.values():
            h._exited(None)
            os.close(h._r)
