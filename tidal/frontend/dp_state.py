"""The frontend's half of data parallelism (pure apart from the clock): which engine gets
a request (the ``Balancer``), the wave to stamp on it (``FrontendWaveState``, the
"Frontend" role of the wave protocol in ``tidal.dp_coordinator.state``), and which
engine holds which request.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from tidal.dp_coordinator.balance import Balancer
from tidal.protocol.messages import DPLoadSnapshot, DPWakeUp, EngineCoreOutputs, EngineCoreRequest
from tidal.protocol.topology import Topology


class FrontendWaveState:
    """A frontend's half of the wave protocol (used by the DP client)."""

    def __init__(self, epoch: int = 0) -> None:
        self.wave = 0
        self.running = False
        self.epoch = epoch  # newest topology epoch seen (own topology or a snapshot)

    def set_topology(self, topology: Topology) -> None:
        """A reconfiguration: believe the engines paused, so the next request wakes them
        (new engines are paused; a lost wake-up would strand a request)."""
        if topology.epoch > self.epoch:
            self.epoch = topology.epoch
            self.running = False

    def on_snapshot(self, snap: DPLoadSnapshot) -> bool:
        """Adopt the snapshot's wave state; False when it is of an older epoch (race 10)."""
        if snap.epoch < self.epoch:
            return False
        self.epoch = snap.epoch
        self.wave, self.running = snap.wave, snap.running
        return True

    def on_send(self, engine_id: int) -> tuple[int, DPWakeUp | None]:
        """Wave to stamp on a request going to engine ``engine_id``, and the wake-up to
        send to the coordinator with it (only the first request while engines look
        paused)."""
        if self.running:
            return self.wave, None
        self.running = True
        return self.wave, DPWakeUp(wave=self.wave, engine_id=engine_id)


class DPFrontendState:
    """Frontend half of data parallelism (pure apart from the clock): which engine gets a
    request, the wave to stamp on it, and which engine holds which request. "rank" below
    is an engine id (the ZMQ identity; equal to the DP rank until a reconfiguration)."""

    def __init__(self, topology: Topology, policy: str = "tidal") -> None:
        self.balancer = Balancer(topology, policy)
        self.wave = FrontendWaveState(topology.epoch)
        self.rank_of: dict[str, int] = {}

    @property
    def topology(self) -> Topology:
        return self.balancer.topology

    def route(
        self, request: EngineCoreRequest, *, exclude: Collection[int] = ()
    ) -> tuple[int, DPWakeUp | None]:
        """Choose the rank, stamp the wave and record the request as sent there (before it
        is sent: its outputs may come back before the sender's next line runs). Returns
        the rank and the wake-up to send *after* the request, or None. ``exclude``:
        engines that must not get it (besides the draining ones)."""
        rank = self.balancer.choose(request.data_parallel_rank, exclude=exclude)
        wave, wake = self.wave.on_send(rank)
        request.current_wave = wave
        self.balancer.on_send(rank, time.monotonic())
        self.rank_of[request.request_id] = rank
        return rank, wake

    def unroute(self, request_id: str, rank: int, wake: DPWakeUp | None) -> None:
        """Undo ``route`` for a request that was never sent: it is no longer in flight
        (to the balancer, a send and a finish that cancel out), and if its wake-up was
        not sent either, the next request must send one."""
        if self.rank_of.get(request_id) == rank:
            self._finished(request_id)
        if wake is not None:
            self.wave.running = False

    def reroute(
        self, request: EngineCoreRequest, *, exclude: Collection[int] = ()
    ) -> tuple[int, DPWakeUp | None]:
        """Route a migrating request (elastic EP) anew: it leaves its old engine's
        in-flight count and goes to one chosen like a new request, never an excluded or
        draining one. Undo with ``unroute`` if it is not sent."""
        self._finished(request.request_id)
        return self.route(request, exclude=exclude)

    def finished(self, request_id: str) -> None:
        """The request ended without an output from its engine (e.g. a migrating request
        whose outputs already finished it)."""
        self._finished(request_id)

    def on_outputs(self, outs: EngineCoreOutputs) -> None:
        for out in outs.outputs:
            if out.finished:
                self._finished(out.request_id)

    def on_abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._finished(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        return by_rank

    def _finished(self, request_id: str) -> int | None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.balancer.on_finish(rank)
        return rank

    def on_snapshot(self, snap: DPLoadSnapshot) -> None:
        self.balancer.on_snapshot(snap, time.monotonic())
        self.wave.on_snapshot(snap)

    def set_topology(self, topology: Topology) -> None:
        """A reconfiguration: route by it from now
        on and drop snapshots of older epochs, and believe the engines paused (the next
        request wakes them). Requests on removed engines stay recorded until they finish
        or are aborted (migration re-routes them)."""
        self.balancer.set_topology(topology)
        self.wave.set_topology(topology)

    @property
    def draining(self) -> frozenset[int]:
        return self.balancer.draining

    def set_draining(self, engine_ids: Collection[int]) -> None:
        """Engines that get no automatically routed request (members of the topology
        only; the others are dropped)."""
        self.balancer.set_draining([e for e in engine_ids if e in self.topology])
