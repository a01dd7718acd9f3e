"""``ScaleSlot``: what the engine's busy loop holds for elastic EP (docs/architecture.md#elastic-protocol).

It owns at most one active ``ElasticEPScalingState`` (``tidal.elastic.state``, whose
docstring has the commit consensus and its races), queues the inputs for it, and keeps a
PREPARE that arrives before the previous operation ended until that one is done.

Busy-loop contract (what the wiring must do)
--------------------------------------------
- Step 1: ``ScalePrepare`` / ``ScaleCommit`` / ``ScaleAbort`` go to ``slot.deliver`` (so
  do the helper's ``JobDone`` / ``JobFailed``). An ADD while ``accepts_new_requests`` is
  False is not scheduled: deliver ``HandedBack((its id,))``.
- Step 2: ``slot.progress(now, num_unfinished=scheduler.num_unfinished)``; run the actions
  in order before anything else touches the groups. After ``HandBackRequests``, deliver
  ``HandedBack`` (the ids, maybe none): the state stays ``active`` until it has reported
  them. After the commit actions, deliver ``CommitApplied()``.
- Step 5: put ``slot.consensus_value`` into the DP all-reduce, reduced with MIN and MAX;
  OR ``slot.holds_wave`` into ``has_unfinished``; deliver ``Consensus(step, min, max)``
  for the *first* ``progress`` after that all-reduce (before any further all-reduce). A
  failed collective on the current group: deliver ``OldGroupFailed``.
- Do not block past ``next_deadline()`` while the state is active.
"""

from __future__ import annotations

from tidal.elastic.scale_events import Action, Input, ScalingPhase
from tidal.elastic.state import ElasticEPScalingState
from tidal.protocol.elastic import ScaleAbort, ScaleCommit, ScalePrepare


class ScaleSlot:
    """What the busy loop holds: at most one active ``ElasticEPScalingState``, the inputs
    queued for it, and a PREPARE that waits for the previous operation to end.

    Why a PREPARE can find the previous state still active: the frontend starts the next
    operation as soon as the previous one ended for *it*, so the previous ABORT and the
    next PREPARE can reach this engine in the same input drain (in that order: one FIFO
    socket). The queued ABORT must be applied first; then the new state starts. A state
    that stays active anyway (owing a hand-back report, say) keeps the PREPARE waiting
    until it is done -- it never drops it, which would leave the frontend waiting for a
    PREPARED that cannot come. The epoch the engine serves is tracked here, so each new
    state can refuse a stale PREPARE.
    """

    def __init__(self, engine_id: int, current_epoch: int | None) -> None:
        self.engine_id = engine_id
        self.current_epoch = current_epoch  # None: a joiner that has not committed yet
        self.state: ElasticEPScalingState | None = None
        self.dropped_inputs = 0  # for no state (late messages of a finished operation)
        self._queue: list[Input] = []
        self._pending: ScalePrepare | None = None
        self._pending_queue: list[Input] = []

    @property
    def active(self) -> bool:
        return (self.state is not None and self.state.active) or self._pending is not None

    @property
    def has_inputs(self) -> bool:
        """Something waits for the next ``progress`` (queued inputs or a PREPARE)."""
        return bool(self._queue) or self._pending is not None

    @property
    def accepts_new_requests(self) -> bool:
        return self.state is None or self.state.accepts_new_requests

    @property
    def consensus_value(self) -> int:
        s = self.state
        return s.consensus_value if s is not None and s.active else 0

    @property
    def holds_wave(self) -> bool:
        s = self.state
        return s is not None and s.active and s.holds_wave

    def next_deadline(self) -> float | None:
        s = self.state
        return s.next_deadline() if s is not None and s.active else None

    def deliver(self, msg: ScalePrepare | Input) -> None:
        """Queue a message from the frontend, a helper job or the busy loop itself.
        COMMIT / ABORT of the waiting PREPARE's operation wait with it (an ABORT can
        follow its PREPARE before the previous state is done); everything else is the
        current state's."""
        if isinstance(msg, ScalePrepare):
            if self._pending is None or msg.sequence > self._pending.sequence:
                self._pending = msg  # a newer operation supersedes a waiting one
                self._pending_queue = []
        elif (
            isinstance(msg, ScaleCommit | ScaleAbort)
            and self._pending is not None
            and msg.operation_id == self._pending.operation_id
        ):
            self._pending_queue.append(msg)
        else:
            self._queue.append(msg)

    def progress(self, now: float, *, num_unfinished: int = 0) -> list[Action]:
        """Step 2 of the busy loop: the queued inputs to the current state, then a waiting
        PREPARE (with its own queued inputs) if the current state is done."""
        out: list[Action] = []
        queued, self._queue = self._queue, []
        s = self.state
        if s is not None and s.active:
            out += s.progress(now, queued, num_unfinished=num_unfinished)
            if s.phase in (ScalingPhase.DONE, ScalingPhase.SERVING):
                self.current_epoch = s.epoch
            elif s.phase is ScalingPhase.LEAVING:
                self.current_epoch = None
        else:
            self.dropped_inputs += len(queued)
        if self._pending is not None and (self.state is None or not self.state.active):
            prepare, self._pending = self._pending, None
            inputs, self._pending_queue = self._pending_queue, []
            try:
                self.state = ElasticEPScalingState(
                    self.engine_id, prepare, current_epoch=self.current_epoch
                )
            except ValueError:  # not a participant: a misdirected message, not fatal
                self.dropped_inputs += 1 + len(inputs)
                return out
            out += self.state.progress(now, inputs, num_unfinished=num_unfinished)
        return out
