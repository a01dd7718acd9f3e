"""The engine client's parts without sockets or processes, over a fake transport: the
router (which engine a request goes to, pinned ranks, where a wake-up goes for each state
of the coordinator), the migrator (requests moved off an engine, and what it delivers
itself) and the liveness monitor's decisions on an exit (the scale driver's, or the
client's failure)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from tidal.frontend.dp_state import DPFrontendState
from tidal.frontend.liveness import WakeRoute
from tidal.frontend.liveness_monitor import LivenessMonitor, ScaleHooks
from tidal.frontend.migrator import Migrator
from tidal.frontend.request_book import RequestBook
from tidal.frontend.router import Router
from tidal.frontend.transport import EngineTransport
from tidal.protocol.elastic import ScaleEvent, ScaleReport
from tidal.protocol.errors import EngineDeadError, RankUnavailableError
from tidal.protocol.messages import (
    DPWakeUp,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
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


# ------------------------------------------------------------------ the migrator


def migrator(size: int) -> tuple[Migrator, Router, FakeTransport, list[EngineCoreOutputs]]:
    r, t = dp_router(size)
    delivered: list[EngineCoreOutputs] = []
    assert r._book is not None
    return Migrator(r._book, r, delivered.append), r, t, delivered


def test_migration_resumes_on_a_live_engine_and_finishes_what_already_ended():
    m, r, t, delivered = migrator(3)
    r.exclude([1, 2])
    for rid in ("a", "b"):
        r.add_request(req(rid))  # both on engine 0
    done = EngineCoreOutputs(
        engine_id=0,
        outputs=[EngineCoreOutput("a", [9]), EngineCoreOutput("b", [2], finish_reason=None)],
    )
    m.accept(done)  # "b" produced EOS: its outputs already end it
    r.restore([1, 2])
    t.frames.clear()
    assert m.migrate(0) == 2
    ((target, payload),) = t.sent(EngineCoreRequestType.ADD)
    moved = msgspec.msgpack.decode(payload, type=EngineCoreRequest)
    assert target in (1, 2) and moved.request_id == "a"
    assert moved.prompt_token_ids == [5, 6, 7, 9]  # prompt + outputs so far
    ((finish,),) = [d.outputs for d in delivered]
    assert finish.request_id == "b" and finish.finish_reason is FinishReason.STOP
    assert m.book is not None and m.book.owner("a") == target and "b" not in m.book
    # The old owner is no longer heard for "a"; the new one is.
    late = EngineCoreOutputs(engine_id=0, outputs=[EngineCoreOutput("a", [7])])
    m.accept(late)
    assert late.outputs == []


def test_a_request_with_nowhere_to_go_gets_an_error_finish_and_is_not_counted():
    m, r, t, delivered = migrator(1)  # its only engine is the one it leaves
    r.add_request(req("a"))
    t.frames.clear()
    assert m.migrate(0) == 0
    assert t.sent(EngineCoreRequestType.ADD) == []
    ((failed,),) = [d.outputs for d in delivered]
    assert failed.request_id == "a" and failed.finish_reason is FinishReason.ERROR
    assert r.dp is not None and "a" not in r.dp.rank_of


def test_a_target_gone_as_well_keeps_the_request_in_its_name():
    m, r, t, delivered = migrator(2)
    r.add_request(req("a", rank=0))
    t.unreachable = {1}
    assert m.migrate(0) == 1  # counted: the target's death moves it again
    assert m.book is not None and m.book.owner("a") == 1 and delivered == []


def test_without_a_book_nothing_migrates_and_every_output_passes():
    t = FakeTransport()
    r = Router(t, Topology.initial(1), None, None)
    m = Migrator(None, r, lambda outs: None)
    outs = EngineCoreOutputs(engine_id=3, outputs=[EngineCoreOutput("x", [1])])
    m.accept(outs)
    m.forget(["x"])
    assert m.migrate(0) == 0 and len(outs.outputs) == 1


# ------------------------------------------------------------------ the liveness monitor


class Exits:
    """What a monitor decided: the client's failures, failed calls, the driver's exits."""

    def __init__(self, owned: set[int] | None) -> None:
        self.failed: list[str] = []
        self.calls_failed: list[tuple[int, str]] = []
        self.driver: list[tuple[int, int | None, str | None]] = []
        self.owned = owned

    def monitor(self, size: int = 3) -> LivenessMonitor:
        r, _ = dp_router(size)
        m = LivenessMonitor(
            r,
            None,  # no processes: nothing here kills
            None,
            stall_s=0.0,
            fail=self.failed.append,
            fail_calls_to=lambda e, reason: self.calls_failed.append((e, reason)),
        )
        if self.owned is not None:
            owned = self.owned
            m.hooks = ScaleHooks(
                on_report=lambda rep: None,
                owns_engine=lambda e: e in owned,
                on_exit=lambda e, code, cause: self.driver.append((e, code, cause)),
            )
        return m


def test_an_exit_without_a_scale_driver_fails_the_client():
    x = Exits(owned=None)
    m = x.monitor()
    m.handle_exit(1, -9)
    assert x.failed == ["engine 1 exited unexpectedly (exit code -9)"]
    assert x.driver == [] and m.router.gone == set()


def test_an_exit_the_driver_owns_is_its_event_once_and_fails_only_that_engines_calls():
    x = Exits(owned={1})
    m = x.monitor()
    m.liveness.heard(1, 0.0)
    m.handle_exit(1, None, "no heartbeat for 10.0s")
    m.handle_exit(1, -9)  # its sentinel too: reported once
    assert x.failed == [] and x.driver == [(1, None, "no heartbeat for 10.0s")]
    assert x.calls_failed == [(1, "no heartbeat for 10.0s")]
    assert m.router.gone == {1} and m.router.live_engine_ids() == [0, 2]
    assert m.liveness.silent_for(1, 5.0) is None  # no longer judged
    m.handle_exit(2, 0)  # not the driver's: the client fails
    assert x.failed == ["engine 2 exited unexpectedly (exit code 0)"]


def test_an_exit_before_the_loop_runs_marks_the_client_dead():
    x = Exits(owned={0, 1, 2})
    m = x.monitor()
    m.on_engine_exit(2, 1)  # the process monitor's thread, before start()
    assert m.transport.dead_reason == "engine 2 exited unexpectedly (exit code 1)"
    assert x.driver == []


def test_a_group_failure_makes_silences_suspect():
    m = Exits(owned=None).monitor()
    m.liveness.expect([0, 1], 0.0)
    report = ScaleReport("op", 0, 0, ScaleEvent.GROUP_FAILED)
    m.heard(EngineCoreOutputs(engine_id=0, scale_report=report), 1.0)
    limit = m.liveness.suspect_silence_s
    assert m.liveness.silence_limit(1.5) == limit < m.liveness.silence_s
