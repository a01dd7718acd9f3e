"""Topology: stable engine ids, ranks as positions, epochs, the id allocator, the wire."""

from __future__ import annotations

import ast
import pathlib

import msgspec
import pytest

from tidal.protocol import topology as topology_module
from tidal.protocol.messages import (
    DPLoadSnapshot,
    DPSetTopology,
    DPWakeUp,
    FrontendToCoordinator,
    encode,
)
from tidal.protocol.topology import MAX_ENGINE_ID, Topology


def test_launch_topology_is_id_equals_rank():
    t = Topology.initial(4)
    assert (t.epoch, t.engine_ids, t.size, t.next_engine_id) == (0, [0, 1, 2, 3], 4, 4)
    assert [t.rank_of(e) for e in t.engine_ids] == [0, 1, 2, 3]
    assert [t.engine_at(r) for r in range(4)] == [0, 1, 2, 3]
    assert 3 in t and 4 not in t
    with pytest.raises(ValueError):
        Topology.initial(0)


def test_remove_from_the_middle_shifts_ranks_not_ids():
    t = Topology.initial(4).without([1])
    assert (t.epoch, t.engine_ids) == (1, [0, 2, 3])
    assert t.rank_of(2) == 1 and t.engine_at(2) == 3
    with pytest.raises(KeyError, match="engine 1 is not in topology epoch 1"):
        t.rank_of(1)
    with pytest.raises(ValueError, match=r"valid ranks are 0\.\.2"):
        t.engine_at(3)
    with pytest.raises(ValueError, match="not in"):
        t.without([1])


def test_new_engines_get_fresh_ids_never_reused():
    t = Topology.initial(3).without([2])  # the highest id leaves ...
    assert t.next_engine_id == 3
    t2 = t.grown(2)  # ... and is not handed out again
    assert (t2.epoch, t2.engine_ids, t2.next_engine_id) == (2, [0, 1, 3, 4], 5)
    with pytest.raises(ValueError, match="never reused"):
        t2.with_engines([0, 1, 2])
    assert t2.with_engines([4, 0]).engine_ids == [4, 0]  # any order, any subset
    assert t2.with_engines([0, 9]).next_engine_id == 10  # explicit fresh ids are fine


def test_rolled_back_ids_are_retired():
    t = Topology.initial(2)
    ids = t.new_engine_ids(2)
    assert ids == [2, 3] and t.next_engine_id == 2  # pure: nothing marked yet
    retired = t.retire_ids(ids)  # the scale-up failed after its engines started
    assert (retired.epoch, retired.engine_ids, retired.next_engine_id) == (0, [0, 1], 4)
    assert retired.same_members(t)
    assert retired.grown(1).engine_ids == [0, 1, 4]
    with pytest.raises(ValueError, match="never reused"):
        retired.with_engines([0, 1, 2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epoch": -1, "engine_ids": [0]}, "epoch"),
        ({"epoch": 0, "engine_ids": []}, "at least one engine"),
        ({"epoch": 0, "engine_ids": [0, 0]}, "unique"),
        ({"epoch": 0, "engine_ids": [-1]}, "engine ids"),
        ({"epoch": 0, "engine_ids": [MAX_ENGINE_ID + 1]}, "engine ids"),
        ({"epoch": 0, "engine_ids": [True]}, "engine ids"),
        ({"epoch": 0, "engine_ids": [0, 1], "placement": [[0, 1]]}, "rows"),
        ({"epoch": 0, "engine_ids": [0, 1], "placement": [[0, 1], [2]]}, "same number"),
        ({"epoch": 0, "engine_ids": [0], "placement": [[1, 1]]}, "twice"),
    ],
)
def test_invalid_topologies_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_next_id_is_at_least_past_every_member():
    assert Topology(3, [5, 0]).next_engine_id == 6
    assert Topology(3, [5, 0], next_id=9).next_engine_id == 9


def test_placement_and_store_are_per_epoch():
    t = Topology.initial(2, placement=[[0, 1], [2, 3]], store_address="10.0.0.1:5000")
    assert t.placement == [[0, 1], [2, 3]]
    nxt = t.grown(1)
    assert nxt.placement is None and nxt.store_address is None  # describe the old groups
    again = t.with_engines(t.engine_ids, placement=[[2, 3], [0, 1]])  # EPLB-style move
    assert again.epoch == 1 and again.placement == [[2, 3], [0, 1]]


def test_wire_round_trip_and_validation_on_decode():
    t = Topology.initial(3, placement=[[0], [1], [2]]).without([0])
    t = Topology(t.epoch, t.engine_ids, t.next_id, [[1], [2]], "h:1")
    dec = msgspec.msgpack.Decoder(FrontendToCoordinator)
    msg = dec.decode(encode(DPSetTopology(t)))
    assert isinstance(msg, DPSetTopology) and msg.topology == t
    assert dec.decode(encode(DPWakeUp(wave=3, engine_id=7))) == DPWakeUp(3, 7)
    bad = encode(DPSetTopology(Topology(0, [0, 1]))).replace(b"\x00\x01", b"\x01\x01")
    with pytest.raises(msgspec.ValidationError, match="unique"):
        dec.decode(bad)
    snap = DPLoadSnapshot(1, 0.5, 2, [0, 3], 4, True, [[1, 2], [3, 4]], [0.1, 0.2])
    assert msgspec.msgpack.decode(encode(snap), type=DPLoadSnapshot) == snap


def test_protocol_module_imports_nothing_of_tidal():
    """Bottom layer (docs/architecture.md#layers): msgspec and the standard library only."""
    tree = ast.parse(pathlib.Path(topology_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "tidal" not in imported and imported <= {"__future__", "collections", "msgspec"}
