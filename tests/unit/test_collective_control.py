"""Collectives an operation can abort (tidal/distributed/collectives.py), pure: aborts by
epoch, and who waits on peers."""

from __future__ import annotations

import threading

import pytest

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
