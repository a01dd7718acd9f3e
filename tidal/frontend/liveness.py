"""Which engines are dead without having exited, and whether the DP coordinator is
(docs/architecture.md#faults), pure: fed with what the client hears and the time, it
returns verdicts; the client's liveness monitor (``liveness_monitor``) kills what they
declare and recovers as for a death. ``Liveness`` judges the engines, ``CoordinatorWatch``
the coordinator (below).

Two findings:

- ``SILENT``: no frame for ``silence_s`` -- a frozen process (SIGSTOP, a paused VM, heavy
  swap), a lost host. Local engines too: a frozen process keeps its sentinel. Every live
  engine sends at least every ``HEARTBEAT_INTERVAL_S`` (its output thread, whatever its
  busy loop does). After a GROUP_FAILED (``suspect``) the limit is ``suspect_silence_s``
  for a while: a collective broke, so a death is likely.
- ``STALLED``: the heartbeats say the busy loop has been inside one iteration for
  ``stall_s``, not waiting on its peers (a GPU hang, a deadlock): the step-progress
  watchdog. A rank waiting in a collective for a stuck peer is not stuck itself. Any frame
  that is not a heartbeat came from a busy loop that moved on.

Rules (``check``):

1. An engine is judged only once heard from (``heard``) or announced (``expect``: the
   launch members, ready when the client starts): a local engine still importing says
   nothing yet and is not silent.
2. A round in which the caller's own loop stalled (``loop_stalled``) judges nothing: the
   frames may be waiting unread, so the silences measured are not the engines'.
3. Deaths found together are declared together, and only engines past their own limit
   are: the ranks of a lost host stop at one instant, but their last frames, and so the
   rounds in which they cross the limit, differ by up to a heartbeat interval. So when
   one watched engine crosses its limit while others have been silent for longer than
   that limit less ``sweep_margin_s`` (at least ``min_sweep_s``), its verdict waits
   until each of those either speaks (it lives: not declared) or crosses the limit too
   -- at most ``sweep_margin_s``. One verdict list, one recovery, and a live engine
   merely starved for a second or two is never killed with the dead: its next
   heartbeat answers for it.
4. An engine is declared once; ``forget`` stops watching it (gone, or no longer ours).
5. The shorter limit after a GROUP_FAILED never declares every engine still watched
   (at ``--dp 2``, the survivor of its peer's death): a starved survivor is told from a
   lost deployment by the full ``silence_s`` only.

Races:
- A frame that arrives just after a verdict is too late: the engine is being killed.
- The stall clock starts at the first heartbeat that shows the iteration busy, on our
  clock: heartbeats read late (our loop busy) make it start late, never early, so a stall
  is never declared before ``stall_s`` of the engine's own time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from tidal.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    EngineProgress,
)

# The coordinator publishes a snapshot at least this often (its heartbeat), so a frontend
# can tell a frozen one from a quiet one.
COORDINATOR_HEARTBEAT_S = 1.0
# A coordinator that published nothing (not even its heartbeat) this long is frozen: it
# is killed and restarted. Meanwhile, past two of its heartbeats, wake-ups also go
# straight to the engines (``WakeRoute.COORDINATOR_AND_DIRECT``).
COORDINATOR_TIMEOUT_S = 4 * COORDINATOR_HEARTBEAT_S
# After a restart the coordinator's sockets reconnect in the background: wake-ups go
# straight to the engines too for this long.
COORDINATOR_RECONNECT_S = 2.0


@enum.unique
class Finding(enum.Enum):
    SILENT = enum.auto()
    STALLED = enum.auto()


@dataclass(frozen=True)
class Verdict:
    engine_id: int
    finding: Finding
    cause: str


class Liveness:
    def __init__(
        self,
        *,
        silence_s: float = HEARTBEAT_TIMEOUT_S,
        suspect_silence_s: float = 4 * HEARTBEAT_INTERVAL_S,
        suspect_for_s: float = HEARTBEAT_TIMEOUT_S,
        sweep_margin_s: float = 2 * HEARTBEAT_INTERVAL_S,
        min_sweep_s: float = 2.5 * HEARTBEAT_INTERVAL_S,
        stall_s: float = 0.0,
    ) -> None:
        """``stall_s``: 0 turns the watchdog off."""
        self.silence_s = silence_s
        self.suspect_silence_s = suspect_silence_s
        self.suspect_for_s = suspect_for_s
        self.sweep_margin_s = sweep_margin_s
        self.min_sweep_s = min_sweep_s
        self.stall_s = stall_s
        self._last: dict[int, float] = {}  # engine -> when we last heard from it
        self._busy: dict[int, tuple[int, float]] = {}  # engine -> (iteration, busy since)
        self._declared: set[int] = set()
        self._suspect_until = float("-inf")
        self._holding_since: float | None = None  # a verdict waits for others (rule 3)

    # ------------------------------------------------------------------ inputs

    def expect(self, engine_ids: Iterable[int], now: float) -> None:
        """Judge these from now on, as if heard now (engines known to be up)."""
        for e in engine_ids:
            self._last.setdefault(e, now)

    def heard(self, engine_id: int, now: float, progress: EngineProgress | None = None) -> None:
        """A frame from ``engine_id``; ``progress``: a heartbeat's (None: any other frame,
        which the busy loop sent, so it is not stuck)."""
        self._last[engine_id] = now
        if progress is None or not progress.busy or progress.waiting_on_peers:
            self._busy.pop(engine_id, None)
            return
        seen = self._busy.get(engine_id)
        if seen is None or seen[0] != progress.iterations:
            self._busy[engine_id] = (progress.iterations, now)

    def suspect(self, now: float) -> None:
        """A GROUP_FAILED came in: a member probably died; shorter silences for a while."""
        self._suspect_until = now + self.suspect_for_s

    def forget(self, engine_id: int) -> None:
        self._last.pop(engine_id, None)
        self._busy.pop(engine_id, None)
        self._declared.discard(engine_id)

    # ------------------------------------------------------------------ decisions

    def silence_limit(self, now: float) -> float:
        return self.suspect_silence_s if now < self._suspect_until else self.silence_s

    def silent_for(self, engine_id: int, now: float) -> float | None:
        last = self._last.get(engine_id)
        return None if last is None else now - last

    def check(
        self, now: float, watched: Iterable[int], *, loop_stalled: bool = False
    ) -> list[Verdict]:
        """The engines among ``watched`` to declare dead now (each once), silent ones
        first, in engine id order."""
        if loop_stalled:
            return []
        candidates = sorted(e for e in set(watched) if e in self._last and e not in self._declared)
        silences = {e: now - self._last[e] for e in candidates}
        limit = self.silence_limit(now)
        past = [e for e in candidates if silences[e] > limit]
        if past and len(past) == len(candidates) and limit < self.silence_s:
            limit = self.silence_s  # rule 5: it would leave no engine at all
            past = [e for e in candidates if silences[e] > limit]
        out: list[Verdict] = []
        if not past:
            self._holding_since = None
        else:
            sweep = max(limit - self.sweep_margin_s, self.min_sweep_s)
            closing = any(sweep < s <= limit for s in silences.values())
            if self._holding_since is None:
                self._holding_since = now
            if not closing or now - self._holding_since >= self.sweep_margin_s:
                self._holding_since = None
                out = [
                    Verdict(e, Finding.SILENT, f"no heartbeat for {silences[e]:.1f}s") for e in past
                ]
        if self.stall_s > 0:
            silent = set(past)  # held ones included: silence, not a stall, is their finding
            for e in candidates:
                busy = self._busy.get(e)
                if e in silent or busy is None or now - busy[1] <= self.stall_s:
                    continue
                out.append(
                    Verdict(
                        e,
                        Finding.STALLED,
                        f"busy loop stuck in iteration {busy[0]} for {now - busy[1]:.1f}s "
                        f"(--engine-stall-timeout {self.stall_s:g}s)",
                    )
                )
        self._declared.update(v.engine_id for v in out)
        return out


@enum.unique
class WakeRoute(enum.Enum):
    """Where a DP wake-up goes (docs/architecture.md#faults)."""

    COORDINATOR = enum.auto()  # it starts the other ranks
    # Also START_DP_WAVE straight to every other member: the coordinator was just
    # restarted (its sockets may not have reconnected) or has been silent a while.
    COORDINATOR_AND_DIRECT = enum.auto()
    DIRECT = enum.auto()  # the coordinator is down: only the frontend can wake them


@enum.unique
class CoordinatorAction(enum.Enum):
    NONE = enum.auto()
    RESTART = enum.auto()  # it died: start a new one (one restart at a time)
    KILL = enum.auto()  # it is frozen: kill it, and a later round restarts it


class CoordinatorWatch:
    """The DP coordinator judged by its snapshots, pure (the caller gives the time and
    whether its process is alive). State: when it was last heard, whether a restart is
    under way, until when wake-ups also go straight to the engines."""

    def __init__(self, now: float, *, timeout_s: float = COORDINATOR_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.heard_at = now
        self.restarting = False
        self._direct_until = float("-inf")

    def heard(self, now: float) -> None:
        """A snapshot (or the heartbeat one) arrived."""
        self.heard_at = now

    def check(self, now: float, alive: bool, *, loop_stalled: bool = False) -> CoordinatorAction:
        """What to do now. A dead one is restarted (``RESTART`` marks the restart under
        way until ``restarted`` / ``restart_failed``); one silent past ``timeout_s`` is
        killed -- unless the caller's own loop stalled, when its snapshots may wait
        unread."""
        if self.restarting:
            return CoordinatorAction.NONE
        if not alive:
            self.restarting = True
            return CoordinatorAction.RESTART
        if now - self.heard_at > self.timeout_s and not loop_stalled:
            return CoordinatorAction.KILL
        return CoordinatorAction.NONE

    def restarted(self, now: float) -> None:
        """A new coordinator runs: heard now; wake engines directly for a while too."""
        self.restarting = False
        self.heard_at = now
        self._direct_until = now + COORDINATOR_RECONNECT_S

    def restart_failed(self) -> None:
        self.restarting = False

    def wake_route(self, now: float, alive: bool) -> WakeRoute:
        """Where a wake-up goes now: past two heartbeats of silence (it may be frozen),
        or just after a restart, the frontend also plays the coordinator's part."""
        if not alive:
            return WakeRoute.DIRECT
        silent = now - self.heard_at > 2 * COORDINATOR_HEARTBEAT_S
        if silent or now < self._direct_until:
            return WakeRoute.COORDINATOR_AND_DIRECT
        return WakeRoute.COORDINATOR
