"""Device slots per host (tidal/distributed/device_slots.py), on a fake device count: ranks
of TP N take N free slots and give them back; elastic cycles never stack ranks on busy
devices (what ``engine_id % device_count`` did)."""

from __future__ import annotations

import pytest

from tidal.distributed.device_slots import DeviceSlots, NoFreeDevices, visible_devices


def test_ranks_take_free_slots_and_give_them_back():
    slots = DeviceSlots(8)
    assert slots.acquire(0, 2) == (0, 1)
    assert slots.acquire(1, 2) == (2, 3)
    assert slots.acquire(2, 4) == (4, 5, 6, 7)
    with pytest.raises(NoFreeDevices, match="engine 3 needs 2 device.*only 0 of this host's 8"):
        slots.acquire(3, 2)
    assert slots.release(1) == (2, 3)
    assert slots.release(1) == ()  # idempotent
    assert slots.acquire(3, 2) == (2, 3)  # the freed pair, not engine_id % 8
    assert slots.free == []


def test_elastic_cycles_never_reuse_a_busy_device():
    """Scale 2 -> 3 -> 2 ten times with TP=1 on 4 devices: engine ids grow (never reused),
    every live rank has its own device, and exactly the live ranks hold devices."""
    slots = DeviceSlots(4)
    live = {0: slots.acquire(0, 1), 1: slots.acquire(1, 1)}
    next_id = 2
    for _ in range(10):
        live[next_id] = slots.acquire(next_id, 1)  # the joiner
        devices = [d for held in live.values() for d in held]
        assert len(devices) == len(set(devices)) == 3
        leaving = max(live)
        slots.release(leaving)
        del live[leaving]
        next_id += 1
        assert sorted(d for held in live.values() for d in held) == sorted(
            set(range(4)) - set(slots.free)
        )
    # engine_id % 4 would have put engine 11 on device 3 whatever held it; here it is free.
    assert slots.free == [2, 3]


def test_adjacent_slots_first_then_any():
    slots = DeviceSlots(6)
    for owner in range(6):
        slots.acquire(owner, 1)
    for owner in (1, 3, 4):
        slots.release(owner)
    assert slots.acquire(9, 2) == (3, 4)  # the adjacent pair, though 1 is lower
    slots.release(9)
    slots.release(2)
    assert slots.acquire(10, 3) == (1, 2, 3)


def test_bad_requests():
    slots = DeviceSlots(2)
    slots.acquire(0, 1)
    with pytest.raises(ValueError, match="already holds"):
        slots.acquire(0, 1)
    with pytest.raises(ValueError, match="at least one"):
        slots.acquire(1, 0)
    assert DeviceSlots(0).free == []
    with pytest.raises(NoFreeDevices):
        DeviceSlots(0).acquire(0, 1)


def test_visible_devices_index_the_parents_list():
    assert visible_devices((0, 1), {}) == "0,1"
    assert visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "4,6, 7"}) == "6"
    assert visible_devices((0, 2), {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"}) == "GPU-a,GPU-c"
    with pytest.raises(ValueError, match="outside"):
        visible_devices((3,), {"CUDA_VISIBLE_DEVICES": "0,1"})
