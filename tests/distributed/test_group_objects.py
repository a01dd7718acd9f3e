"""``StatelessGroup.all_gather_object``: msgspec msgpack between ranks, never pickle.

Real processes, gloo over TCP on 127.0.0.1.
"""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest

from tidal.distributed.groups import StatelessGroup
from tidal.distributed.ports import get_open_port


class Load(msgspec.Struct):
    rank: int
    per_expert: list[int]


class _RunsCode:
    """Unpickling this writes the marker file: proof that a peer's bytes ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _gather_rank(rank: int, world: int, port: int, marker: str) -> dict:
    g = StatelessGroup.create(
        host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=120
    )
    try:
        plain = g.all_gather_object({"rank": rank, "load": {0: [rank, 1], 1: []}})
        typed = g.all_gather_object(Load(rank, [rank] * 3), type=Load)
        # A rank sends what a pickle-based gather would execute on its peers.
        raw = g.all_gather_object(pickle.dumps(_RunsCode(marker)))
        # A peer's data that does not match the expected type is refused, not trusted.
        bad = g.all_gather_object({"rank": "not an int"} if rank == 0 else {"rank": rank})
        with pytest.raises(msgspec.ValidationError):
            g.all_gather_object(
                {"rank": "x", "per_expert": []} if rank == 0 else Load(rank, []), type=Load
            )
        with pytest.raises(TypeError):  # not msgspec-encodable: refused before any collective
            g.all_gather_object(object())
        g.barrier()  # every rank survived the above and is still in step
    finally:
        g.destroy()
    return {"plain": plain, "typed": typed, "raw": raw, "bad": bad}


def test_all_gather_object_is_msgpack_not_pickle(run_ranks, tmp_path):
    marker = str(tmp_path / "unpickled")
    results = run_ranks(_gather_rank, 2, get_open_port(), marker, timeout_s=120)
    for res in results:
        assert res["plain"] == [
            {"rank": q, "load": {0: [q, 1], 1: []}} for q in range(2)
        ]  # int keys survive msgpack
        assert res["typed"] == [Load(q, [q] * 3) for q in range(2)]
        assert all(isinstance(b, bytes) for b in res["raw"])  # data, never objects
        assert res["bad"] == [{"rank": "not an int"}, {"rank": 1}]
    assert not os.path.exists(marker)
