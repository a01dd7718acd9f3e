"""The engine client's router (``tidal.frontend.router.Router``) without sockets: which
engine a request goes to, pinned ranks, and where a wake-up goes for each state of the
coordinator (docs/architecture.md#faults)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.liveness import WakeRoute
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.errors import EngineDeadError, RankUnavailableError
from tidal.protocol.messages import (
    DPWakeUp,
    EngineCoreRequest,
    EngineCoreRequestType,
    StartDPWave,
)
from tidal.protocol.topology import Topology
from tidal.sampling_params import SamplingParams


class FakeTransport(EngineTransport):
    """What the router sends, recorded; engines in ``unreachable`` have no route."""

    def __init__(self) -> None:  # no sockets
        self.dead_reason = None
        self.frames: list[tuple[int, EngineCoreRequestType, bytes]] = []
        self.upstream: list[bytes] = []
        self.unreachable: set[int] = set()

    def send(self, engine: int, req_type: EngineCoreRequestType, payload: bytes) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if engine in self.unreachable:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self.frames.append((engine, req_type, payload))

    def send_upstream(self, frame: bytes) -> None:
        self.upstream.append(frame)

    def sent(self, req_type: EngineCoreRequestType) -> list[tuple[int, bytes]]:
        return [(e, p) for e, t, p in self.frames if t is req_type]


def req(rid: str, rank: int | None = None) -> EngineCoreRequest:
    r = EngineCoreRequest(rid, [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2)
    r.data_parallel_rank = rank
    return r


def dp_router(size: int, route: WakeRoute = WakeRoute.COORDINATOR) -> tuple[Router, FakeTransport]:
    t = FakeTransport()
    topo = Topology.initial(size)
    return Router(t, topo, DPFrontendState(topo), RequestBook(), lambda: route), t


def test_without_dp_every_request_goes_to_the_one_engine_and_no_wave_is_stamped():
    t = FakeTransport()
    r = Router(t, Topology.initial(1), None, None)
    for i in range(3):
        r.add_request(req(f"r{i}", rank=0))
    assert [e for e, _ in t.sent(EngineCoreRequestType.ADD)] == [0, 0, 0]
    assert t.upstream == [] and r.check_pinned_rank(0)
    r.abort(["r0", "r1"])
    ((engine, payload),) = t.sent(EngineCoreRequestType.ABORT)
    assert engine == 0 and msgspec.msgpack.decode(payload) == ["r0", "r1"]


def test_the_first_request_of_a_paused_deployment_wakes_it_once():
    r, t = dp_router(2)
    r.add_request(req("a"))
    r.add_request(req("b"))
    wakes = [msgspec.msgpack.decode(f, type=DPWakeUp) for f in t.upstream]
    assert len(wakes) == 1 and wakes[0].engine_id == t.sent(EngineCoreRequestType.ADD)[0][0]
    assert t.sent(EngineCoreRequestType.START_DP_WAVE) == []  # the coordinator's part
    assert {e for e, _ in t.sent(EngineCoreRequestType.ADD)} == {0, 1}  # balanced


@pytest.mark.parametrize(
    "route, upstream, direct",
    [
        (WakeRoute.COORDINATOR, True, False),
        (WakeRoute.COORDINATOR_AND_DIRECT, True, True),
        (WakeRoute.DIRECT, False, True),
    ],
)
def test_a_wake_up_goes_where_the_coordinator_state_says(route, upstream, direct):
    r, t = dp_router(3, route)
    r.send_wakeup(DPWakeUp(wave=4, engine_id=1))
    assert bool(t.upstream) is upstream
    starts = t.sent(EngineCoreRequestType.START_DP_WAVE)
    if direct:
        # Every other member, what the coordinator would broadcast.
        assert [e for e, _ in starts] == [0, 2]
        assert msgspec.msgpack.decode(starts[0][1], type=StartDPWave).wave == 4
    else:
        assert starts == []


def test_direct_wake_ups_skip_an_engine_with_no_route():
    r, t = dp_router(3, WakeRoute.DIRECT)
    t.unreachable = {2}
    r.send_wakeup(DPWakeUp(wave=0, engine_id=0))
    assert [e for e, _ in t.sent(EngineCoreRequestType.START_DP_WAVE)] == [1]


def test_pinned_ranks_gone_draining_and_out_of_range():
    r, t = dp_router(3)
    r.gone.add(1)
    with pytest.raises(RankUnavailableError, match="data_parallel_rank 1"):
        r.check_pinned_rank(1)
    r.exclude([2])
    assert not r.check_pinned_rank(2)  # leaving: the balancer chooses instead
    assert r.check_pinned_rank(0) and r.check_pinned_rank(None)
    assert r.check_pinned_rank(7)  # outside the topology: the balancer's to refuse
    r.restore([2])
    assert r.check_pinned_rank(2)
    assert r.live_engine_ids() == [0, 2]


def test_a_failed_send_leaves_no_trace_and_a_failed_client_sends_nothing():
    r, t = dp_router(2)
    t.unreachable = {0, 1}
    with pytest.raises(RuntimeError):  # nobody reachable: the balancer has no engine left
        r.add_request(req("lost"))
    assert r.dp is not None and "lost" not in r.dp.rank_of
    assert r._book is not None and "lost" not in r._book
    t.unreachable = set()
    t.dead_reason = "engine 0 exited"
    with pytest.raises(EngineDeadError):
        r.add_request(req("late"))
    assert r.dp.wave.running is False  # its wake-up was never sent: the next one sends it


def test_set_topology_without_dp_is_refused():
    r = Router(FakeTransport(), Topology.initial(1), None, None)
    with pytest.raises(RuntimeError, match="DP machinery"):
        r.set_topology(Topology.initial(2))
