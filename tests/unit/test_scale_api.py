"""Elastic EP's user-facing surface against a fake engine: ``POST /scale_elastic_ep``,
``GET|POST /is_scaling_elastic_ep``, ``/stats``' scaling history, the scale metrics,
rank deaths (``/health`` degraded, ``/stats``' faults, the rank-death metrics) and
``tidal scale`` (a real subprocess against a real uvicorn server).

``ScalingFakeLLM`` answers ``scale_elastic_ep`` the way ``AsyncLLM`` does: one operation at a
time (409 for another while one runs), a repeated ``operation_id`` returns the first
record, a rolled-back operation's record with status 200 (``failure_status``: or 500; the
server answers 500 either way), ValueError for a size the placement cannot serve. Its
records are real ``OperationRecord.to_dict()``s, and its ``get_stats`` has AsyncLLM's flat
scaling keys, which the server folds into ``scaling``. Its ``fault_status`` answers
``faults`` (``make_faults``: no death by default), as ``AsyncLLM.fault_status`` does.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import sys
from typing import Any

import httpx
import pytest

from tests.unit.test_api_server import (
    FakeAsyncLLM,
    assert_error,
    client_for,
    engine_gauges,
    live_server,
    ok_completion,
    run,
    wait_for,
)
from tidal.config import ParallelConfig
from tidal.frontend.scaling.scale_records import (
    DeathRecord,
    OperationRecord,
    PhaseTiming,
    ScalePhase,
    ScaleTrigger,
    fault_summary,
)
from tidal.launch.admin import SCALING_HISTORY
from tidal.launch.api_server import bind_socket
from tidal.launch.metrics import ServerMetrics
from tidal.launch.scale_routes import MAX_DRAIN_TIMEOUT_S
from tidal.protocol.messages import SchedulerStats

NUM_EXPERTS = 8
BYTES_PER_EXPERT = 1 << 20

_RESULT_PHASES = {
    "succeeded": ScalePhase.SUCCEEDED,
    "rolled_back": ScalePhase.ROLLED_BACK,
    "failed": ScalePhase.FAILED,
}


def make_record(
    operation_id: str,
    sequence: int,
    from_size: int,
    to_size: int,
    *,
    result: str | None = "succeeded",
    started_at: float = 100.0,
    engine_ids: list[int] | None = None,
    cause: str | None = None,
    requests_migrated: int = 0,
    dead: tuple[int, ...] = (),
    trigger: ScaleTrigger = ScaleTrigger.API,
) -> dict[str, Any]:
    """An ``OperationRecord.to_dict()`` of a from -> to operation (unfinished if ``result``
    is None): engines ``from_size..`` join, the last ones leave."""
    ids = engine_ids if engine_ids is not None else list(range(from_size))
    rec = OperationRecord(
        operation_id=operation_id,
        sequence=sequence,
        from_size=from_size,
        to_size=to_size,
        from_epoch=sequence - 1,
        to_epoch=sequence,
        started_at=started_at,
        drain_timeout_s=0.0,
        trigger=trigger,
    )
    next_id = max(ids, default=-1) + 1
    rec.joining = list(range(next_id, next_id + max(0, to_size - from_size)))
    rec.leaving = ids[to_size:] if to_size < from_size else []
    rec.dead = list(dead)
    moved = abs(to_size - from_size) * 2
    rec.experts_moved, rec.bytes_moved = moved, moved * BYTES_PER_EXPERT
    rec.p2p_bytes = rec.bytes_moved
    rec.requests_migrated = requests_migrated
    t = started_at
    for phase, dt in [
        (ScalePhase.PLANNED, 0.01),
        (ScalePhase.STARTING_ENGINES, 1.5),
        (ScalePhase.PREPARING, 2.0),
        (ScalePhase.COMMITTING, 0.2),
        (ScalePhase.FINISHING, 0.3),
    ]:
        rec.phases.append(PhaseTiming(phase, t, t + dt))
        t += dt
    if result is not None:
        rec.phase = _RESULT_PHASES[result]
        rec.finished_at = t
        rec.cause = cause
    else:  # still preparing
        rec.phase = ScalePhase.PREPARING
        rec.phases = [*rec.phases[:2], PhaseTiming(ScalePhase.PREPARING, rec.phases[2].started)]
    return rec.to_dict()


def make_death(
    engine_id: int,
    at: float,
    *,
    epoch: int = 1,
    migrated: int = 0,
    recovered_by: str | None = None,
    recovery_s: float = 2.5,
) -> DeathRecord:
    """A rank death, recovered ``recovery_s`` after ``at`` if ``recovered_by`` names the
    operation."""
    death = DeathRecord(engine_id, epoch, at, f"engine {engine_id} exited with code -9")
    death.requests_migrated = migrated
    if recovered_by is not None:
        death.recovered_by, death.recovered_at = recovered_by, at + recovery_s
    return death


def make_faults(
    deaths: list[DeathRecord] = (),  # type: ignore[assignment]
    *,
    degraded: str | None = None,
    dead: list[int] = (),  # type: ignore[assignment]
    failed_groups: dict[int, str] | None = None,
) -> dict[str, Any]:
    """``AsyncLLM.fault_status()`` without ``serving_engines`` (the fake adds it)."""
    return fault_summary(deaths, dead, failed_groups, degraded)


class ScalingFakeLLM(FakeAsyncLLM):
    """``FakeAsyncLLM`` with elastic EP: ``scale_elastic_ep`` as AsyncLLM answers it.

    ``gate``: when set, an operation waits for it (so a test can see it running);
    ``outcome`` / ``cause``: how the next operation ends."""

    def __init__(self, size: int = 2, *, elastic: bool = True) -> None:
        super().__init__()
        parallel = ParallelConfig(
            data_parallel_size=size, enable_expert_parallel=True, enable_elastic_ep=elastic
        )
        self.config = dataclasses.replace(self.config, parallel=parallel)
        self.engine_ids = list(range(size))
        self.scale_calls: list[tuple] = []
        self.gate: asyncio.Event | None = None
        self.outcome, self.cause = "succeeded", None
        self.failure_status = 200  # AsyncLLM's: the record's result says how it ended
        self.requests_migrated = 0
        self.current: dict | None = None
        self._clock = 100.0
        self.faults = make_faults()  # what fault_status answers

    def fault_status(self) -> dict[str, Any]:
        # A fresh copy each time, as AsyncLLM builds one: the server may not mutate ours.
        live = [e for e in self.engine_ids if e not in self.faults["dead"]]
        return {**copy.deepcopy(self.faults), "serving_engines": 0 if self.dead else len(live)}

    async def get_stats(self) -> dict:
        return {
            "data_parallel_size": len(self.engine_ids),
            "wave": 0,
            "engines_running": False,
            "ranks": [{"rank": r, "engine_id": e} for r, e in enumerate(self.engine_ids)],
            "is_scaling_elastic_ep": self.scaling,
            "scaling_history": list(self.history),
        }

    async def scale_elastic_ep(
        self, new_data_parallel_size: int, drain_timeout: float = 0.0, operation_id: Any = None
    ) -> tuple[int, dict]:
        self.scale_calls.append((new_data_parallel_size, drain_timeout, operation_id))
        if not self.config.parallel.enable_elastic_ep:
            return await super().scale_elastic_ep(new_data_parallel_size)
        for rec in self.history:
            if operation_id is not None and rec["operation_id"] == operation_id:
                return 200, rec
        if self.current is not None:
            if operation_id == self.current["operation_id"]:
                return 200, self.current
            return 409, self.current
        if new_data_parallel_size > NUM_EXPERTS:
            raise ValueError(
                f"new_data_parallel_size={new_data_parallel_size} is above the number of "
                f"experts ({NUM_EXPERTS}): every rank needs at least one expert; the maximum "
                f"is {NUM_EXPERTS}"
            )
        seq = len(self.history) + 1
        op_id = operation_id or f"scale-{seq}"
        size = len(self.engine_ids)
        args = (op_id, seq, size, new_data_parallel_size)
        kw = {"started_at": self._clock, "engine_ids": self.engine_ids}
        self.current = make_record(*args, result=None, **kw)
        self.scaling = True
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.scaling, self.current = False, None
        rec = make_record(
            *args,
            result=self.outcome,
            cause=self.cause,
            requests_migrated=self.requests_migrated,
            **kw,
        )
        self._clock = rec["finished_at"] + 10.0
        self.history.append(rec)
        if self.outcome == "succeeded":
            self.engine_ids = [e for e in self.engine_ids if e not in rec["leaving"]]
            self.engine_ids += rec["joining"]
        for listener in self.scale_listeners:
            listener(rec)
        return (200 if self.outcome == "succeeded" else self.failure_status), rec


def ops_sample(result: str, trigger: str = "api") -> str:
    """The finished-operations counter's sample for one result and trigger."""
    return f'tidal:scale_operations_total{{result="{result}",trigger="{trigger}"}}'


def metric(text: str, line_start: str) -> float:
    """The value of the sample whose line starts with ``line_start``."""
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start!r} in\n{text}")


# ---- POST /scale_elastic_ep ----------------------------------------------------------------


@run
async def test_scale_up_answers_the_record_and_feeds_stats_and_metrics():
    engine = ScalingFakeLLM(2)
    engine.requests_migrated = 3
    async with client_for(engine) as c:
        for e in (0, 1):  # engines report load before the operation
            c.app.state.metrics.record_scheduler_stats(e, SchedulerStats(num_running_reqs=1))
        body = {"new_data_parallel_size": 3, "drain_timeout": 5, "operation_id": "grow-1"}
        r = await c.post("/scale_elastic_ep", json=body)
        assert r.status_code == 200, r.text
        rec = r.json()
        assert engine.scale_calls == [(3, 5.0, "grow-1")]
        assert rec == engine.history[-1]
        assert (rec["from_size"], rec["to_size"], rec["result"]) == (2, 3, "succeeded")
        assert rec["joining"] == [2] and rec["bytes_moved"] == 2 * BYTES_PER_EXPERT
        assert set(rec["phase_durations_s"]) == {
            "planned",
            "starting_engines",
            "preparing",
            "committing",
            "finishing",
        }

        stats = (await c.get("/stats")).json()
        assert stats["scaling"] == {"is_scaling": False, "history": [rec]}
        assert "scaling_history" not in stats and "is_scaling_elastic_ep" not in stats
        assert [x["engine_id"] for x in stats["ranks"]] == [0, 1, 2]
        assert (await c.get("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": False}

        text = (await c.get("/metrics")).text
        assert metric(text, ops_sample("succeeded")) == 1
        assert metric(text, 'tidal:scale_duration_seconds_count{result="succeeded"}') == 1
        assert metric(text, 'tidal:scale_duration_seconds_sum{result="succeeded"}') == (
            pytest.approx(rec["duration_s"])
        )
        for phase, seconds in rec["phase_durations_s"].items():
            sample = f'tidal:scale_phase_seconds_sum{{phase="{phase}"}}'
            assert metric(text, sample) == pytest.approx(seconds)
        assert metric(text, "tidal:scale_bytes_moved_total") == 2 * BYTES_PER_EXPERT
        assert metric(text, "tidal:scale_experts_moved_total") == 2
        assert metric(text, "tidal:scale_requests_migrated_total") == 3
        assert metric(text, "tidal:scale_in_progress") == 0
        # Nothing left: the engines survive, their series stay.
        assert 'tidal:num_requests_running{engine="1"}' in text

        # The same operation id: the first record, nothing started, nothing counted twice.
        r = await c.post("/scale_elastic_ep", json={**body, "new_data_parallel_size": 5})
        assert r.status_code == 200 and r.json() == rec
        assert len(engine.history) == 1
        text = (await c.get("/metrics")).text
        assert metric(text, ops_sample("succeeded")) == 1
        await ok_completion(c)  # serving goes on


@run
async def test_scale_down_forgets_the_leaving_engines_series():
    engine = ScalingFakeLLM(3)
    async with client_for(engine) as c:
        metrics: ServerMetrics = c.app.state.metrics
        for e in (0, 1, 2):
            metrics.record_scheduler_stats(e, SchedulerStats(num_running_reqs=e))
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
        assert r.status_code == 200, r.text
        assert r.json()["leaving"] == [2] and r.json()["operation_id"] == "scale-1"
        assert engine.scale_calls == [(2, 0.0, None)]
        text = (await c.get("/metrics")).text
        assert engine_gauges(text, "2") == [] and engine_gauges(text, "1") != []
        assert 'tidal:num_requests_running{engine="1"}' in text
        # A late stats message from the removed engine does not bring it back.
        metrics.record_scheduler_stats(2, SchedulerStats(num_running_reqs=9))
        assert engine_gauges((await c.get("/metrics")).text, "2") == []
        stats = (await c.get("/stats")).json()
        assert [x["engine_id"] for x in stats["ranks"]] == [0, 1]


@run
async def test_conflict_while_an_operation_runs_then_idle_again():
    engine = ScalingFakeLLM(2)
    engine.gate = asyncio.Event()
    async with client_for(engine) as c:
        first = asyncio.ensure_future(
            c.post("/scale_elastic_ep", json={"new_data_parallel_size": 4, "operation_id": "a"})
        )
        await wait_for(lambda: engine.scaling)
        for method in ("GET", "POST"):
            r = await c.request(method, "/is_scaling_elastic_ep")
            assert r.json() == {"is_scaling_elastic_ep": True}
        assert (await c.get("/stats")).json()["scaling"]["is_scaling"] is True
        assert metric((await c.get("/metrics")).text, "tidal:scale_in_progress") == 1

        # The same id again: the running operation's record, at once.
        r = await c.post(
            "/scale_elastic_ep", json={"new_data_parallel_size": 4, "operation_id": "a"}
        )
        assert r.status_code == 200 and r.json()["result"] is None
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 1})
        err = assert_error(r, 409, None)
        assert (err["type"], err["code"]) == ("conflict_error", "scaling_in_progress")
        assert "a (2 -> 4" in err["message"]
        running = r.json()["operation"]
        assert running["operation_id"] == "a" and running["result"] is None
        await ok_completion(c)  # requests are never refused because of scaling

        engine.gate.set()
        r = await first
        assert r.status_code == 200 and r.json()["to_size"] == 4
        assert (await c.post("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": False}
        # The next operation works.
        engine.gate = None
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
        assert r.status_code == 200 and r.json()["leaving"] == [2, 3]


@pytest.mark.parametrize("engine_status", [200, 500])
@run
async def test_rolled_back_operation_is_a_500_with_its_cause_and_record(engine_status):
    engine = ScalingFakeLLM(2)
    engine.failure_status = engine_status
    engine.outcome, engine.cause = "rolled_back", "engine 2 did not start within 120 s"
    async with client_for(engine) as c:
        metrics: ServerMetrics = c.app.state.metrics
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        err = assert_error(r, 500, None)
        assert (err["type"], err["code"]) == ("server_error", "scale_rolled_back")
        assert "scale-1 (2 -> 3) rolled back: engine 2 did not start" in err["message"]
        rec = r.json()["operation"]
        assert (rec["result"], rec["cause"]) == ("rolled_back", engine.cause)
        assert (await c.get("/stats")).json()["scaling"]["history"] == [rec]
        # The stopped joiner's series (if it reported) goes; the survivors' stay.
        metrics.record_scheduler_stats(0, SchedulerStats())
        metrics.record_scheduler_stats(2, SchedulerStats())
        text = (await c.get("/metrics")).text
        assert metric(text, ops_sample("rolled_back")) == 1
        assert metric(text, "tidal:scale_bytes_moved_total") == 0  # nothing committed
        assert engine_gauges(text, "2") == [] and engine_gauges(text, "0") != []
        # Its id repeated: the same outcome again.
        r = await c.post(
            "/scale_elastic_ep", json={"new_data_parallel_size": 3, "operation_id": "scale-1"}
        )
        assert r.status_code == 500 and r.json()["operation"] == rec
        engine.outcome, engine.cause = "succeeded", None
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert r.status_code == 200 and r.json()["joining"] == [2]


BAD_BODIES = [
    ({}, "new_data_parallel_size"),
    ({"new_data_parallel_size": None}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 0}, "new_data_parallel_size"),
    ({"new_data_parallel_size": -2}, "new_data_parallel_size"),
    ({"new_data_parallel_size": "2"}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 2.0}, "new_data_parallel_size"),
    ({"new_data_parallel_size": True}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 2**70}, "new_data_parallel_size"),
    ({"new_data_parallel_size": 2, "drain_timeout": -1}, "drain_timeout"),
    ({"new_data_parallel_size": 2, "drain_timeout": "5"}, "drain_timeout"),
    ({"new_data_parallel_size": 2, "drain_timeout": False}, "drain_timeout"),
    ({"new_data_parallel_size": 2, "drain_timeout": 1e300}, "drain_timeout"),
    ({"new_data_parallel_size": 2, "drain_timeout": MAX_DRAIN_TIMEOUT_S + 1}, "drain_timeout"),
    ({"new_data_parallel_size": 2, "operation_id": ""}, "operation_id"),
    ({"new_data_parallel_size": 2, "operation_id": "x" * 257}, "operation_id"),
    ({"new_data_parallel_size": 2, "operation_id": 7}, "operation_id"),
    ({"new_data_parallel_size": 2, "new_size": 3}, "new_size"),
    ({"new_data_parallel_size": 2, "drain-timeout": 3}, "drain-timeout"),
    ([2], None),
    ("2", None),
    (b"{not json", None),
    (b'{"new_data_parallel_size": 2, "drain_timeout": NaN}', None),
    (b'{"new_data_parallel_size": 2, "drain_timeout": 1e999}', "drain_timeout"),
    (b"", None),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
@run
async def test_bad_bodies_are_400_before_the_engine(body, param):
    engine = ScalingFakeLLM(2)
    async with client_for(engine) as c:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await c.post(
            "/scale_elastic_ep", content=content, headers={"content-type": "application/json"}
        )
        err = assert_error(r, 400, param)
        assert err["type"] == "invalid_request_error"
        assert engine.scale_calls == []
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert r.status_code == 200, r.text


@run
async def test_sizes_the_engine_refuses_are_400_naming_the_limit():
    engine = ScalingFakeLLM(2)
    async with client_for(engine) as c:
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": NUM_EXPERTS + 1})
        err = assert_error(r, 400, "new_data_parallel_size")
        assert err["code"] == "invalid_scale_request"
        assert f"the maximum is {NUM_EXPERTS}" in err["message"]
        assert engine.history == [] and not engine.scaling


@run
async def test_elastic_ep_off_is_400_naming_the_flag():
    engine = ScalingFakeLLM(2, elastic=False)
    async with client_for(engine) as c:
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        err = assert_error(r, 400, None)
        assert "--enable-elastic-ep" in err["message"] and err["code"] == "elastic_ep_disabled"
        assert engine.scale_calls == []
        assert (await c.get("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": False}
        assert (await c.get("/stats")).json()["scaling"] == {"is_scaling": False, "history": []}
    # The base fake (ParallelConfig's default: off) too.
    async with client_for(FakeAsyncLLM()) as c:
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert "--enable-elastic-ep" in assert_error(r, 400, None)["message"]


@run
async def test_dead_engine_is_503():
    engine = ScalingFakeLLM(2)
    engine.dead = True
    async with client_for(engine) as c:
        r = await c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert assert_error(r, 503)["code"] == "engine_dead"
        assert engine.scale_calls == []


@run
async def test_api_key_protects_the_scale_routes():
    engine = ScalingFakeLLM(2)
    async with client_for(engine, api_key="sekret") as c:
        body = {"new_data_parallel_size": 3}
        assert_error(await c.post("/scale_elastic_ep", json=body), 401)
        r = await c.post("/scale_elastic_ep", json=body, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)
        for method in ("GET", "POST"):
            assert_error(await c.request(method, "/is_scaling_elastic_ep"), 401)
        assert engine.scale_calls == []
        c.headers["Authorization"] = "Bearer sekret"
        assert (await c.post("/scale_elastic_ep", json=body)).status_code == 200
        assert (await c.get("/is_scaling_elastic_ep")).status_code == 200


@pytest.mark.slow  # starts a server: the fast tier stays under 2 minutes
@run
async def test_operation_outlives_a_cancelled_request():
    engine = ScalingFakeLLM(2)
    engine.gate = asyncio.Event()
    async with live_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        req = asyncio.ensure_future(c.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}))
        await wait_for(lambda: engine.scaling)
        req.cancel()  # the client hangs up
        await asyncio.sleep(0.2)
        assert engine.scaling  # the operation goes on
        engine.gate.set()
        await wait_for(lambda: len(engine.history) == 1)
        assert engine.history[0]["result"] == "succeeded"
        stats = (await c.get("/stats")).json()
        assert stats["scaling"]["history"][0]["operation_id"] == "scale-1"


# ---- /stats -------------------------------------------------------------------------------


@run
async def test_stats_keeps_the_last_operations_and_token_totals():
    engine = ScalingFakeLLM(2)
    engine.history = [
        make_record(f"op-{i}", i + 1, 2, 3 if i % 2 == 0 else 2, started_at=10.0 * i)
        for i in range(SCALING_HISTORY + 10)
    ]
    async with client_for(engine) as c:
        await ok_completion(c)
        stats = (await c.get("/stats")).json()
        history = stats["scaling"]["history"]
        assert len(history) == SCALING_HISTORY
        assert history == engine.history[-SCALING_HISTORY:]
        assert stats["tokens"] == {"prompt_total": 2, "generation_total": 2}


# ---- metrics ------------------------------------------------------------------------------


def test_metrics_scale_listener():
    m = ServerMetrics()
    for e in range(4):
        m.record_scheduler_stats(e, SchedulerStats(num_running_reqs=1))
    down = make_record("d", 1, 4, 2, requests_migrated=5)
    assert down["leaving"] == [2, 3]
    m.record_scale_operation(down)
    m.record_scale_operation(down)  # reported twice: counted once
    failed = make_record("f", 2, 2, 3, result="failed", cause="outcome unknown")
    m.record_scale_operation(failed)
    dead = make_record("x", 3, 2, 2, dead=(1,), trigger=ScaleTrigger.RECOVERY)  # after a rank death
    m.record_scale_operation(dead)
    text = m.render().decode()
    assert metric(text, ops_sample("succeeded")) == 1
    assert metric(text, ops_sample("succeeded", "recovery")) == 1
    assert metric(text, ops_sample("failed")) == 1
    assert metric(text, "tidal:scale_requests_migrated_total") == 5
    assert metric(text, "tidal:scale_bytes_moved_total") == 4 * BYTES_PER_EXPERT
    assert metric(text, 'tidal:scale_phase_seconds_count{phase="preparing"}') == 3
    assert metric(text, 'tidal:scale_duration_seconds_bucket{le="5.0",result="succeeded"}') == 2
    # The leaving engines and the dead one are gone, the rest stay.
    engines = {e for e in range(4) if engine_gauges(text, str(e))}
    assert engines == {0}
    # A FAILED operation whose outcome was learnt later: its leaving engines go then.
    m.record_scheduler_stats(5, SchedulerStats())
    late = make_record("f2", 4, 6, 5, engine_ids=[0, 4, 5, 6, 7, 8], result="failed")
    m.record_scale_operation(late)
    m.record_scale_operation({**late, "resolution": "committed", "leaving": [5]})
    text = m.render().decode()
    assert engine_gauges(text, "5") == []
    assert metric(text, ops_sample("failed")) == 2


# ---- rank deaths (docs/architecture.md#faults) ------------------------------------------------------------

DEGRADED = "engines [1] dead; recovering"


@run
async def test_health_is_ok_degraded_or_503():
    engine = ScalingFakeLLM(3)
    async with client_for(engine) as c:
        for path in ("/health", "/ping"):
            r = await c.get(path)
            assert (r.status_code, r.json()) == (200, {"status": "ok"})
        # A rank died and its recovery runs: the others serve, so 200 (a load balancer
        # keeps the server), with why and how many engines serve.
        engine.faults = make_faults([make_death(1, 200.0, migrated=2)], degraded=DEGRADED, dead=[1])
        for path in ("/health", "/ping"):
            r = await c.get(path)
            assert r.status_code == 200, r.text
            assert r.json() == {"status": "degraded", "detail": DEGRADED, "serving_engines": 2}
        await ok_completion(c)
        # No live member left (the client fails next): nothing can serve.
        engine.faults["dead"] = [0, 1, 2]
        err = assert_error(await c.get("/health"), 503)
        assert err["code"] == "engine_dead" and DEGRADED in err["message"]
        # The engine client dead: 503 as ever, whatever the faults say.
        engine.faults["dead"], engine.dead = [1], True
        assert assert_error(await c.get("/health"), 503)["code"] == "engine_dead"
        # Recovered: ok again (the death stays on record).
        engine.dead = False
        engine.faults = make_faults([make_death(1, 200.0, recovered_by="recovery-1")])
        assert (await c.get("/health")).json() == {"status": "ok"}
    # An engine without fault_status (the base fake): ok, as before.
    async with client_for(FakeAsyncLLM()) as c:
        assert (await c.get("/health")).json() == {"status": "ok"}


@run
async def test_stats_reports_faults():
    engine = ScalingFakeLLM(3)
    async with client_for(engine) as c:
        stats = (await c.get("/stats")).json()
        assert stats["faults"] == {**make_faults(), "serving_engines": 3}
        assert stats["scaling"] == {"is_scaling": False, "history": []}
        deaths = [
            make_death(1, 200.0, migrated=4, recovered_by="recovery-1", recovery_s=1.5),
            make_death(2, 250.0, epoch=2, migrated=1),
        ]
        failed = {0: "all_reduce failed: peer 2 gone"}
        degraded = "engines [2] dead; recovering"
        engine.faults = make_faults(deaths, degraded=degraded, dead=[2], failed_groups=failed)
        faults = (await c.get("/stats")).json()["faults"]
        # JSON: the failed groups' engine ids become string keys.
        assert faults == {
            **make_faults(deaths, degraded=degraded, dead=[2]),
            "failed_groups": {"0": failed[0]},
            "serving_engines": 2,
        }
        assert (faults["rank_deaths"], faults["recovered"], faults["recovery_s_last"]) == (
            2,
            1,
            1.5,
        )
    async with client_for(FakeAsyncLLM()) as c:  # no fault_status: null
        assert (await c.get("/stats")).json()["faults"] is None


def test_metrics_count_each_death_and_recovery_once():
    m = ServerMetrics()

    def scrape(faults: dict[str, Any], serving: int = 2) -> str:
        m.record_faults({**faults, "serving_engines": serving})
        return m.render().decode()

    def values(text: str) -> tuple[float, ...]:
        return tuple(
            metric(text, "tidal:" + name)
            for name in (
                "rank_deaths_total",
                "rank_recoveries_total",
                "rank_death_requests_migrated_total",
                "rank_recovery_seconds_count",
                "deployment_degraded",
                "serving_engines",
            )
        )

    assert values(scrape(make_faults(), 3)) == (0, 0, 0, 0, 0, 3)
    faults = make_faults([make_death(1, 200.0, migrated=2)], degraded=DEGRADED, dead=[1])
    for _ in range(3):  # scraped again and again: counted once
        assert values(scrape(faults)) == (1, 0, 2, 0, 1, 2)
    # More of its requests resumed elsewhere, then its recovery committed.
    first = make_death(1, 200.0, migrated=5, recovered_by="recovery-1", recovery_s=3.0)
    for _ in range(3):
        text = scrape(make_faults([first]))
        assert values(text) == (1, 1, 5, 1, 0, 2)
        assert metric(text, "tidal:rank_recovery_seconds_sum") == 3.0
        assert metric(text, 'tidal:rank_recovery_seconds_bucket{le="2.5"}') == 0
        assert metric(text, 'tidal:rank_recovery_seconds_bucket{le="5.0"}') == 1
    # The list is bounded: a second death comes as the first falls off the front.
    second = make_death(4, 300.0, epoch=2, migrated=1)
    for _ in range(3):
        assert values(scrape(make_faults([second], degraded=DEGRADED, dead=[4]))) == (
            2,
            1,
            6,
            1,
            1,
            2,
        )
    # Both listed (a status read before the trim, scraped late): nothing counted twice.
    assert values(scrape(make_faults([first, second]))) == (2, 1, 6, 1, 0, 2)
    # The engine client dead: nothing serves.
    assert values(scrape(make_faults([first, second]), serving=0))[-1] == 0


@run
async def test_metrics_route_reads_faults_and_labels_operations_by_trigger():
    engine = ScalingFakeLLM(3)
    async with client_for(engine) as c:
        engine.faults = make_faults([make_death(2, 200.0, migrated=3)], degraded=DEGRADED, dead=[2])
        for _ in range(2):  # every scrape reads the faults; each death counts once
            text = (await c.get("/metrics")).text
            assert metric(text, "tidal:rank_deaths_total") == 1
            assert metric(text, "tidal:rank_death_requests_migrated_total") == 3
            assert metric(text, "tidal:deployment_degraded") == 1
            assert metric(text, "tidal:serving_engines") == 2
        # The automatic recovery removes engine 2 (reported to the scale listeners, as the
        # driver does), then "restore" brings the size back.
        recovery = make_record("recovery-1", 1, 3, 2, dead=(2,), trigger=ScaleTrigger.RECOVERY)
        restore = make_record("restore-2", 2, 2, 3, engine_ids=[0, 1], trigger=ScaleTrigger.RESTORE)
        for rec in (recovery, restore):
            for listener in engine.scale_listeners:
                listener(rec)
        engine.engine_ids = [0, 1, *restore["joining"]]
        engine.faults = make_faults([make_death(2, 200.0, migrated=3, recovered_by="recovery-1")])
        text = (await c.get("/metrics")).text
        assert metric(text, ops_sample("succeeded", "recovery")) == 1
        assert metric(text, ops_sample("succeeded", "restore")) == 1
        assert ops_sample("succeeded") not in text  # no caller asked for any
        assert metric(text, "tidal:rank_recoveries_total") == 1
        assert metric(text, "tidal:rank_recovery_seconds_count") == 1
        assert metric(text, "tidal:deployment_degraded") == 0
        assert metric(text, "tidal:serving_engines") == 3
        engine.dead = True  # the metrics still render; nothing serves
        text = (await c.get("/metrics")).text
        assert metric(text, "tidal:serving_engines") == 0
        assert metric(text, "tidal:rank_deaths_total") == 1


# ---- tidal scale --------------------------------------------------------------------------


async def tidal_scale(*args: str, api_key_env: str | None = None) -> tuple[int, str, str]:
    """``tidal scale ARGS``; ``TIDAL_API_KEY`` is ``api_key_env`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_API_KEY"}
    if api_key_env is not None:
        env["TIDAL_API_KEY"] = api_key_env
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tidal.launch.cli",
        "scale",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@run
async def test_tidal_scale_cli_against_a_live_server():
    engine = ScalingFakeLLM(2)
    async with live_server(engine, api_key="k") as url:
        auth = ["--url", url, "--api-key", "k"]
        rc, out, err = await tidal_scale("--to", "3", *auth, "--operation-id", "cli-1")
        assert rc == 0, err
        rec = json.loads(out)
        assert (rec["operation_id"], rec["from_size"], rec["to_size"]) == ("cli-1", 2, 3)
        assert engine.scale_calls == [(3, 0.0, "cli-1")]

        rc, out, err = await tidal_scale("--to", "2", *auth, "--drain-timeout", "1.5")
        assert rc == 0, err
        assert json.loads(out)["leaving"] == [2] and engine.scale_calls[-1] == (2, 1.5, None)

        # The server's refusals: exit 1 with its message.
        rc, out, err = await tidal_scale("--to", "99", *auth)
        assert rc == 1 and "HTTP 400" in err and f"the maximum is {NUM_EXPERTS}" in err
        rc, out, err = await tidal_scale("--to", "3", "--url", url)
        assert rc == 1 and "HTTP 401" in err and "API key" in err
        # $TIDAL_API_KEY is the default of --api-key (the flag wins over it).
        rc, out, err = await tidal_scale("--to", "99", "--url", url, api_key_env="k")
        assert rc == 1 and "HTTP 400" in err and f"the maximum is {NUM_EXPERTS}" in err
        rc, out, err = await tidal_scale("--to", "99", *auth, api_key_env="bad")
        assert rc == 1 and "HTTP 400" in err
        rc, out, err = await tidal_scale("--to", "99", "--url", url, api_key_env="bad")
        assert rc == 1 and "HTTP 401" in err
        rc, out, err = await tidal_scale("--to", "3", "--url", url, "--api-key", "bad")
        assert rc == 1 and "HTTP 401" in err

        engine.outcome, engine.cause = "rolled_back", "transfer timed out"
        rc, out, err = await tidal_scale("--to", "3", *auth)
        assert rc == 1 and "HTTP 500" in err and "transfer timed out" in err
        assert json.loads(out)["result"] == "rolled_back"  # the record, on stdout

        engine.outcome, engine.cause = "succeeded", None
        engine.gate = asyncio.Event()
        running = asyncio.ensure_future(tidal_scale("--to", "4", *auth, "--operation-id", "slow"))
        await wait_for(lambda: engine.scaling)
        rc, out, err = await tidal_scale("--to", "1", *auth)
        assert rc == 1 and "HTTP 409" in err and "slow" in err
        assert json.loads(out)["operation_id"] == "slow"
        engine.gate.set()
        rc, out, err = await running
        assert rc == 0 and json.loads(out)["to_size"] == 4


BAD_FLAGS = [
    (["--to", "0"], "--to"),
    (["--to", "two"], "--to"),
    ([], "--to"),
    (["--to", "2", "--drain-timeout", "-1"], "--drain-timeout"),
    (["--to", "2", "--drain-timeout", "nan"], "--drain-timeout"),
    (["--to", "2", "--operation-id", ""], "--operation-id"),
    (["--to", "2", "--url", "ftp://host:1"], "--url"),
    (["--to", "2", "--url", "localhost:8000"], "--url"),
    (["--to", "2", "--timeout", "0"], "--timeout"),
]


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@pytest.mark.parametrize("args,flag", BAD_FLAGS)
@run
async def test_tidal_scale_flag_errors_name_the_flag(args, flag):
    rc, out, err = await tidal_scale(*args)
    assert rc == 2 and flag in err and out == "", err


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@run
async def test_tidal_scale_unreachable_server():
    sock = bind_socket("127.0.0.1", 0)  # bound, never listening: connection refused
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        rc, out, err = await tidal_scale("--to", "2", "--url", url)
    finally:
        sock.close()
    assert rc == 1 and "cannot reach" in err and out == ""
