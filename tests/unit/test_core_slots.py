"""Core groups of a host's CPU ranks (tidal/distributed/core_slots.py): the policy, the
split, handing groups out and back, NUMA order, and a real pinned process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tidal.distributed.core_slots import (
    CoreSlots,
    host_cores,
    parse_affinity,
    parse_cpu_list,
    plan_groups,
)


def test_auto_pins_several_ranks_with_a_core_per_worker():
    assert plan_groups("auto", [0, 1], 2, 1) == [(0,), (1,)]
    assert plan_groups("auto", list(range(8)), 2, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan_groups("auto", list(range(4)), 2, 2) == [(0, 1), (2, 3)]
    # The split's remainder is in no group: the frontend runs there.
    assert plan_groups("auto", list(range(5)), 2, 1) == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("cores", "ranks", "tp"),
    [
        ([0, 1], 1, 1),  # one worker: it shares every core with its frontend
        ([0, 1], 1, 2),  # one rank of two TP workers: they share every core too
        ([0, 1], 3, 1),  # fewer cores than workers
        ([0, 1, 2], 2, 2),
        ([0, 1], 0, 1),  # a host with no local rank (Ray, a frontend-only host)
    ],
)
def test_auto_leaves_unpinned(cores, ranks, tp):
    assert plan_groups("auto", cores, ranks, tp) is None


def test_off_never_pins():
    assert plan_groups("off", list(range(16)), 4, 1) is None


def test_explicit_groups():
    assert parse_affinity("0-3|8,9") == [(0, 1, 2, 3), (8, 9)]
    assert plan_groups("0-1|2-3", list(range(4)), 2, 1) == [(0, 1), (2, 3)]
    # More groups than ranks: the extra ones serve ranks a scale-up adds.
    assert plan_groups("0|1|2", list(range(4)), 2, 1) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="not usable"):
        plan_groups("0|7", [0, 1], 2, 1)
    with pytest.raises(ValueError, match="1 core group"):
        plan_groups("0-1", [0, 1], 2, 1)


@pytest.mark.parametrize("bad", ["", "on", "0-", "3-1", "a|b", "0||1", "-1", "0-99999999", "0-2|2"])
def test_bad_affinity_is_refused(bad):
    with pytest.raises(ValueError, match="cpu_affinity|overlap"):
        parse_affinity(bad)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_slots_hand_out_and_take_back():
    slots = CoreSlots([(0,), (1,)])
    assert slots.acquire(10) == (0,)
    assert slots.acquire(10) == (0,)  # a rank's group is fixed for its life
    assert slots.acquire(11) == (1,)
    assert slots.acquire(12) == ()  # all taken (a scale-up past the launch): unpinned
    assert slots.release(10) == (0,)
    assert slots.release(10) == ()
    assert slots.acquire(13) == (0,)  # the freed group serves the next rank


def test_host_cores_go_node_by_node(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    # A fake topology: the last usable core alone on node 0, the others on node 1.
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text(f"{usable[-1]}\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text(",".join(map(str, usable[:-1])) + "\n")
    assert host_cores(str(tmp_path)) == [usable[-1], *usable[:-1]]
    assert host_cores(str(tmp_path / "none")) == usable


def test_pin_process_pins_every_thread():
    core = sorted(os.sched_getaffinity(0))[-1]
    code = textwrap.dedent(
        f"""
        import os, threading
        from tidal.distributed.core_slots import pin_process
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        pin_process([{core}])
        after = threading.Thread(target=stop.wait)
        after.start()
        masks = {{int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}}
        stop.set()
        print(len(masks), sorted(set(map(tuple, map(sorted, masks.values())))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) >= 3  # the main thread, one started before, one after
    assert out[1].strip() == f"[({core},)]"
