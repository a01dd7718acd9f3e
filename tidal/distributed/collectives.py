"""Collectives an operation can abort (docs/architecture.md#faults), and whether a rank waits on its peers.

A rank blocked in a collective with a peer that froze (SIGSTOP, a paused VM) waits until
gloo's own timeout -- minutes -- unless something ends the wait. A ``CollectiveControl``
is shared by the serving groups of one engine: the busy loop's collectives wait in short
slices and, between two slices, ask it whether their epoch was aborted; the engine's
input thread aborts every epoch below a recovery's when that recovery's PREPARE arrives
(the groups it replaces are unusable by definition), so the blocked collective raises
``GroupFailure`` within a slice instead of minutes later.

It also tells whether a given thread (the busy loop's) is *waiting on its peers* right
now: the step-progress watchdog (``--engine-stall-timeout``) must not take a rank that
waits for a stuck peer for the stuck one. (Helper threads wait in standby barriers for a
long time; that says nothing about the busy loop.) Two kinds of wait, one answer:

- a host wait (gloo): the thread is inside the collective's ``wait`` (``waiting``);
- a device wait (NCCL): the call returns at once and the *device* waits; the thread
  blocks later, in whatever reads a result back. Each such collective is recorded
  (``enqueued``) with a probe that says whether the device has reached it (everything
  ordered before it on the stream is done). The oldest collective of the thread not yet
  completed is where the device is: reached, it waits on the peers; not reached, the
  rank's own work runs (or hangs) before it, which is no wait on the peers.

Thread-safety: ``abort`` and the queries run on any thread (input, output, busy loop);
``waiting`` is entered and left by the thread that runs the collective.

Races:
1. The abort arrives while no collective runs: the next collective of an aborted epoch
   fails before it starts waiting, so a rank never enters a collective on groups a
   recovery already replaced.
2. The abort arrives after the collective completed: nothing to end; the busy loop's next
   collective on those groups fails (1), or the groups are gone already.
3. A standby group of the new epoch is never aborted by it: only epochs *below* the
   recovery's are.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

# A device collective the control tracks: (its group's key, whether the device reached
# it, its ``Work``).
_DeviceWait = tuple[int, Callable[[], bool], Any]


class CollectiveControl:
    """Abort flags by epoch, and the current wait, for one engine's serving groups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted_below = -1  # epochs < this are aborted
        self._cause: str | None = None
        self._waiting: dict[int, int] = {}  # thread ident -> collectives waiting there
        self._device: dict[int, deque[_DeviceWait]] = {}  # thread ident -> oldest first

    def abort(self, below_epoch: int, cause: str) -> None:
        """Every collective of a group of an epoch below ``below_epoch`` fails now (and any
        later one on such a group fails at once)."""
        with self._lock:
            if below_epoch > self._aborted_below:
                self._aborted_below = below_epoch
                self._cause = cause

    def aborted(self, epoch: int | None) -> str | None:
        """Why collectives of ``epoch`` must end, or None. Groups without an epoch (tests,
        transfer groups) are never aborted."""
        if epoch is None:
            return None
        with self._lock:
            return self._cause if epoch < self._aborted_below else None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective's wait for its peers, on the thread that runs it."""
        me = threading.get_ident()
        with self._lock:
            self._waiting[me] = self._waiting.get(me, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                n = self._waiting.pop(me) - 1
                if n:
                    self._waiting[me] = n

    def enqueued(self, group_key: int, reached: Callable[[], bool], work: Any) -> None:
        """A device collective this thread enqueued on group ``group_key``: ``reached()``
        whether the device got to it, ``work.is_completed()`` whether it ended."""
        me = threading.get_ident()
        with self._lock:
            self._device.setdefault(me, deque()).append((group_key, reached, work))
            self._prune(me)

    def drop(self, group_key: int) -> None:
        """Group ``group_key`` is destroyed: its collectives, abandoned, say nothing any
        more (one a dead peer held would never complete)."""
        with self._lock:
            for thread_id, waits in list(self._device.items()):
                kept = deque(w for w in waits if w[0] != group_key)
                if kept:
                    self._device[thread_id] = kept
                else:
                    del self._device[thread_id]

    def is_waiting(self, thread_id: int) -> bool:
        """Whether thread ``thread_id`` waits on its peers now: in a collective's wait, or
        behind a device collective the device reached and its peers have not."""
        with self._lock:
            if thread_id in self._waiting:
                return True
            self._prune(thread_id)
            waits = self._device.get(thread_id)
            return bool(waits) and _probe(waits[0][1])

    def _prune(self, thread_id: int) -> None:
        """Forget the thread's oldest device collectives that completed (lock held)."""
        waits = self._device.get(thread_id)
        while waits and _probe(waits[0][2].is_completed, failed=True):
            waits.popleft()
        if waits is not None and not waits:
            del self._device[thread_id]


def _probe(query: Callable[[], bool], failed: bool = False) -> bool:
    """``query()``; ``failed`` if it raises (a device error: the collective is over, and
    the busy loop's own failure will tell the rest)."""
    try:
        return bool(query())
    except Exception:  # noqa: BLE001 - called from the heartbeat thread: never raise
        return failed
