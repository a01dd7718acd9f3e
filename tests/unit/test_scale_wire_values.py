"""The scale enums' wire values: ``ScalePhase``, ``ScaleTrigger`` and ``ScaleOutcome`` are
``StrEnum``s whose values are the strings the JSON (``/scale_elastic_ep``, ``/stats``), the
dashboard and the metrics' labels carry. Renaming a member must not change what a client
or a dashboard reads, so the values are pinned here, and so is the JSON of a record."""

from __future__ import annotations

import json

from tests.unit.test_scale_controller import all_report, ctl, one, rep
from tidal.frontend.scaling.scale_events import EngineExited, RecordResult
from tidal.frontend.scaling.scale_records import (
    OperationRecord,
    PhaseTiming,
    ScaleOutcome,
    ScalePhase,
    ScaleRequest,
    ScaleTrigger,
)
from tidal.launch.metrics import ServerMetrics
from tidal.protocol.elastic import ScaleEvent


def test_enum_values_are_the_old_wire_strings():
    assert {p.name: p.value for p in ScalePhase} == {
        "PLANNED": "planned",
        "STARTING_ENGINES": "starting_engines",
        "PREPARING": "preparing",
        "COMMITTING": "committing",
        "FINISHING": "finishing",
        "SUCCEEDED": "succeeded",
        "ROLLED_BACK": "rolled_back",
        "FAILED": "failed",
    }
    assert {t.name: t.value for t in ScaleTrigger} == {
        "API": "api",
        "RECOVERY": "recovery",
        "RESTORE": "restore",
        "REBUILD": "rebuild",
    }
    assert {o.name: o.value for o in ScaleOutcome} == {
        "COMMITTED": "committed",
        "ROLLED_BACK": "rolled_back",
    }
    # str() and f-strings (the records' warnings and causes) read the same.
    assert (
        str(ScalePhase.STARTING_ENGINES) == f"{ScalePhase.STARTING_ENGINES}" == "starting_engines"
    )


def test_record_json_is_byte_for_byte_the_old_one():
    rec = OperationRecord(
        operation_id="recover-1",
        sequence=3,
        from_size=3,
        to_size=2,
        from_epoch=2,
        to_epoch=3,
        started_at=10.0,
        phase=ScalePhase.FAILED,
        dead=[1],
        trigger=ScaleTrigger.RECOVERY,
        finished_at=12.5,
        phases=[PhaseTiming(ScalePhase.PREPARING, 10.0, 11.0)],
        resolution=ScaleOutcome.ROLLED_BACK,
    )
    d = rec.to_dict()
    # Plain strings, not enum members: any JSON encoder writes the same bytes.
    for key in ("phase", "result", "trigger", "resolution"):
        assert type(d[key]) is str, key
    assert all(type(k) is str for k in d["phase_durations_s"])
    assert json.dumps(d, sort_keys=True) == (
        '{"bytes_moved": 0, "bytes_received": 0, "cause": null, "dead": [1], '
        '"disk_bytes": 0, "drain_timeout_s": 0.0, "duration_s": 2.5, "experts_moved": 0, '
        '"finished_at": 12.5, "from_epoch": 2, "from_size": 3, "joining": [], "leaving": [], '
        '"min_bytes": 0, "operation_id": "recover-1", "p2p_bytes": 0, '
        '"phase": "failed", "phase_durations_s": {"preparing": 1.0}, '
        '"requests_migrated": 0, "resolution": "rolled_back", "result": "failed", '
        '"started_at": 10.0, "to_epoch": 3, "to_size": 2, "trigger": "recovery", '
        '"warnings": []}'
    )


def test_a_controller_record_reaches_the_metrics_with_the_old_labels():
    """The record a real operation ends with, through the metrics listener."""
    c = ctl(2)
    c.request_scale(ScaleRequest(1, operation_id="down"), 1.0)
    all_report(c, [0, 1], ScaleEvent.PREPARED, 2.0)
    out = c.handle(rep(c, 0, ScaleEvent.COMMITTED, step=1), 3.0)
    out += c.handle(rep(c, 1, ScaleEvent.COMMITTED, step=1), 3.0)
    out += c.handle(EngineExited(1, "left"), 4.0)
    record = one(out, RecordResult).record.to_dict()
    assert (record["result"], record["trigger"]) == ("succeeded", "api")
    m = ServerMetrics()
    m.record_scale_operation(record)
    text = m.render().decode()
    assert 'tidal:scale_operations_total{result="succeeded",trigger="api"} 1.0' in text
    assert 'tidal:scale_phase_seconds_count{phase="preparing"} 1.0' in text
