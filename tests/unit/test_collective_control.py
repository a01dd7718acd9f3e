"""Collectives an operation can abort (tidal/distributed/collectives.py), pure: aborts by
epoch, and who waits on peers."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.groups import GroupFailure, StatelessGroup


def test_an_abort_ends_the_epochs_below_it_only():
    c = CollectiveControl()
    assert c.aborted(0) is None
    c.abort(2, "recovery r replaces them")
    assert c.aborted(0) == c.aborted(1) == "recovery r replaces them"
    assert c.aborted(2) is None and c.aborted(3) is None  # the recovery's own groups
    assert c.aborted(None) is None  # groups without an epoch are never aborted


def test_an_older_abort_never_undoes_a_newer_one():
    c = CollectiveControl()
    c.abort(3, "new")
    c.abort(1, "stale")  # a late PREPARE of an older operation
    assert c.aborted(2) == "new"


def test_waiting_is_per_thread():
    c = CollectiveControl()
    me = threading.get_ident()
    seen: dict[str, bool] = {}
    inside, leave = threading.Event(), threading.Event()

    def helper() -> None:  # e.g. a standby barrier on an elastic helper thread
        with c.waiting():
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=helper)
    t.start()
    assert inside.wait(60)
    seen["busy loop, helper waiting"] = c.is_waiting(me)
    seen["helper"] = c.is_waiting(t.ident)
    with c.waiting(), c.waiting():  # nested: still waiting until the outer one ends
        seen["busy loop waiting"] = c.is_waiting(me)
    leave.set()
    t.join(60)
    seen["after"] = c.is_waiting(me) or c.is_waiting(t.ident)
    assert seen == {
        "busy loop, helper waiting": False,
        "helper": True,
        "busy loop waiting": True,
        "after": False,
    }


class _Work:
    """A gloo ``Work`` whose operation ends (``ok`` or failed) just after a wait's slice
    ran out: the race between the slice's timeout and ``is_completed``."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.slices = 0

    def wait(self, timeout: object = None) -> bool:
        if timeout is not None:
            self.slices += 1
            raise RuntimeError("Operation timed out!")
        if not self.ok:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return self.slices >= 1


def _abortable_group() -> StatelessGroup:
    return StatelessGroup(
        rank=0, world_size=2, backend_name="gloo", backend=None, process_group=None,
        store=None, owns_store=False, prefix="ep", control=CollectiveControl(), epoch=1,
    )  # fmt: skip


def test_an_operation_that_ends_as_its_slice_times_out_is_not_a_failure():
    _abortable_group()._wait(_Work(ok=True))  # returns: the collective succeeded
    with pytest.raises(GroupFailure, match="Connection closed by peer"):
        _abortable_group()._wait(_Work(ok=False))


# ------------------------------------------------- device (NCCL) collectives, on CPU


class _DeviceWork:
    """An NCCL ``Work``: ``wait`` returns at once (the device waits), ``is_completed``
    says whether the device finished it."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


class _Mark:
    """The CUDA event recorded before a collective: whether the device reached it."""

    def __init__(self) -> None:
        self.reached = False

    def __call__(self) -> bool:
        return self.reached


def test_a_device_collective_is_a_wait_on_peers_once_the_device_reached_it():
    c = CollectiveControl()
    me = threading.get_ident()
    first, second = (_Mark(), _DeviceWork()), (_Mark(), _DeviceWork())
    c.enqueued(1, *first)
    c.enqueued(1, *second)
    assert not c.is_waiting(me)  # the rank's own work still runs before it
    first[0].reached = True
    assert c.is_waiting(me)  # the device is in it: held by a peer
    second[0].reached = True  # (only the oldest one not completed tells where it is)
    first[1].done = True
    assert c.is_waiting(me)  # now in the second one
    second[1].done = True
    assert not c.is_waiting(me)  # every collective completed: back to its own work


def test_a_destroyed_groups_device_collectives_say_nothing_more():
    c = CollectiveControl()
    mark, work = _Mark(), _DeviceWork()
    mark.reached = True
    c.enqueued(7, mark, work)
    assert c.is_waiting(threading.get_ident())
    c.drop(7)  # never completes (its peer died); the recovery replaced the group
    assert not c.is_waiting(threading.get_ident())


def test_a_failing_device_probe_never_raises_in_the_heartbeat():
    c = CollectiveControl()

    class Broken(_DeviceWork):
        def is_completed(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    c.enqueued(1, _Mark(), Broken())
    assert not c.is_waiting(threading.get_ident())


class _DeviceBackend:
    def __init__(self) -> None:
        self.works: list[_DeviceWork] = []

    def allreduce(self, tensors, opts) -> _DeviceWork:
        self.works.append(_DeviceWork())
        return self.works[-1]

    def shutdown(self) -> None:
        pass


def test_an_nccl_groups_collective_marks_the_busy_loop_waiting_on_peers(monkeypatch):
    """The NCCL branch of ``StatelessGroup`` (no GPU here: a fake backend and a fake CUDA
    event). A rank whose device waits in an EP all-reduce for a hung peer must say so in
    its heartbeats, like a gloo rank blocked in the same all-reduce, or the stall
    watchdog would kill every rank instead of the hung one."""
    import tidal.distributed.groups as groups

    marks: list[_Mark] = []

    def mark() -> _Mark:
        marks.append(_Mark())
        return marks[-1]

    monkeypatch.setattr(groups, "_device_mark", mark, raising=False)
    control, backend = CollectiveControl(), _DeviceBackend()
    group = StatelessGroup(
        rank=0, world_size=2, backend_name="nccl", backend=backend, process_group=None,
        store=None, owns_store=False, prefix="ep", control=control, epoch=1,
    )  # fmt: skip
    me = threading.get_ident()
    group.all_reduce(torch.ones(4))  # returns at once: the device runs it
    assert not group.abortable and len(marks) == 1
    assert not control.is_waiting(me)  # the device has not reached it yet
    marks[0].reached = True
    assert control.is_waiting(me)  # reached; the hung peer never joins
    backend.works[0].done = True
    assert not control.is_waiting(me)
    group.all_reduce(torch.ones(4))
    marks[1].reached = True
    assert control.is_waiting(me)
    group.destroy()  # a recovery replaces it: the abandoned collective says nothing more
    assert not control.is_waiting(me)
    control.abort(2, "recovery")
    with pytest.raises(GroupFailure, match="recovery"):  # as gloo: no collective on it now
        StatelessGroup(
            rank=0, world_size=2, backend_name="nccl", backend=backend, process_group=None,
            store=None, owns_store=False, prefix="ep", control=control, epoch=1,
        ).all_reduce(torch.ones(4))  # fmt: skip
