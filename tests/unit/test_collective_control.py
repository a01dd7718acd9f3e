"""Collectives an operation can abort (tidal/distributed/collectives.py), pure: aborts by
epoch, and who waits on peers."""

from __future__ import annotations

import threading

from tidal.distributed.collectives import CollectiveControl


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
    """A gloo work whose first slice runs out ("Operation timed out!") just before it
    completes: with ``ok`` it succeeded, else it failed (every later wait raises)."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.waits = 0

    def wait(self, timeout=None) -> None:
        self.waits += 1
        if self.waits == 1 or not self.ok:
            raise RuntimeError("Operation timed out!" if self.waits == 1 else "peer gone")

    def is_completed(self) -> bool:
        return True


def _abortable_group():
    from tidal.distributed.groups import GroupFailure, StatelessGroup

    g = StatelessGroup.__new__(StatelessGroup)  # only what _wait reads
    g._control, g.epoch, g.prefix, g._failure = CollectiveControl(), 0, "ep", GroupFailure
    return g


def test_a_collective_that_completes_as_its_slice_runs_out_succeeds():
    import pytest

    from tidal.distributed.groups import GroupFailure

    late = _Work(ok=True)
    _abortable_group()._wait(late)  # no GroupFailure: it completed
    assert late.waits == 2
    with pytest.raises(GroupFailure, match="peer gone"):
        _abortable_group()._wait(_Work(ok=False))
