"""DP coordinator state and the wave protocol (pure: no sockets, no clocks).

Waves
=====
While a *wave* runs, every DP rank steps -- dummy batches when it has no work -- so the
EP collectives of all ranks stay matched; every 32 steps the ranks all-reduce "does anyone
have unfinished work?". When nobody has, wave ``w`` ends: rank 0 sends
``EngineCoreOutputs(wave_complete=w)``, every rank pauses and sets ``current_wave = w + 1``.
A rank that runs while another is paused blocks in the collectives until the other joins,
so the protocol's one job is: **whenever any rank starts, every rank starts.**

Actors and their rules (W = the coordinator's wave, R = its ``running`` flag):

Frontend (``FrontendWaveState``): stamps each request with the wave of its last snapshot.
  If it believes the engines are paused it also sends ``DPWakeUp(wave, engine)`` once and
  then believes them running (until a snapshot says otherwise).

Engine (``EngineWaveState``, applied by DPEngineCoreProc's busy loop):
  * request stamped ``rw`` while paused at ``cw``:
      ``rw >= cw``: adopt ``max(rw, cw)`` and run. The frontend either sent a wake-up, or
        saw R=True for that wave, so a START_DP_WAVE for it is already on its way.
      ``rw < cw``: the frontend has not yet seen wave ``rw`` end, so nobody will wake the
        others: run and send ``start_wave=cw`` to the coordinator.
  * request while running: just add it (it joins the running wave).
  * ``StartDPWave(w, exclude)``: ignore if ``exclude`` is this rank (it started on its
    own); ignore if ``w < cw`` -- it crossed a wave end (see race 2); else adopt ``w`` and run.
  * wave end (all-reduce says idle): ``cw = w + 1``, pause; rank 0 sends ``wave_complete=w``.

Coordinator (``CoordinatorState.handle``):
  * ``DPWakeUp(w, e)``: if R, ignore (duplicate). Else set R and broadcast START(W,
    exclude=e) -- or exclude nobody if ``w < W`` (the wake-up is stale; rank e is paused
    at W and will start on the stale request anyway, an extra START is harmless).
    ``w > W`` cannot happen with one coordinator; it is adopted defensively.
  * ``start_wave=w`` from rank e: ``w > W`` -> W = w, R, START(w, exclude=e);
    ``w == W`` and not R -> R, START(W, exclude=e); otherwise ignore (duplicate or stale).
  * ``wave_complete=w``: ``w >= W`` -> W = w + 1, not R; ``w < W`` -> ignore (stale).
  * resize: R = False (see "when in doubt" below).

Races (and why the rules above are safe; tests/unit/test_coordinator_state.py model-checks
all three roles under random interleavings)
------------------------------------------------------------------------------------------
1. Stale wake-up / start_wave. A frontend saw (W, paused); before its wake-up arrives,
   another frontend woke wave W and it completed: the coordinator is at (W+1, paused).
   The request stamped W reaches a rank paused at W+1, which starts and sends
   ``start_wave=W+1``. The stale wake-up *starts wave W+1* (exclude nobody) rather than
   being dropped, because a rank is (or will be) running; the rank's ``start_wave=W+1``
   then finds R set and is ignored -- exactly one START either way round.
   A ``start_wave=w`` with ``w < W`` is dropped: the coordinator has seen
   ``wave_complete(w)``, which required that rank to take part in wave w, so its work
   was served and it is not stranded.
2. START_DP_WAVE crossing a wave end. A rank can receive START(w) after wave w already
   ended for it (it started on a request, the others on an earlier copy of START, and
   the wave finished before this copy was read). Engines drop START with ``w <
   current_wave``; accepting it would make one rank run alone, i.e. deadlock.
3. wave_complete racing a start for the next wave. Rank 0's ``wave_complete=w`` and
   rank e's ``start_wave=w+1`` come over different connections, in either order. In
   order: complete -> (w+1, paused), then start -> running, START(w+1, exclude=e).
   Reversed: start (``w+1 > W``) -> adopt w+1, running, START; then the late
   ``wave_complete=w`` is below W and is ignored (clearing R would be safe, see below,
   but would invite redundant wake-ups and an empty extra wave).
4. Duplicate notifications. Several frontends (or a frontend and an engine) may report
   the same wave; only the first broadcasts, the rest find R already set.
5. A wake-up arriving while R is set is ignored even if wave W has in fact just ended
   (its ``wave_complete`` in flight): the request it announces either joins wave W
   (running, or about to be started by the START already sent) or reaches a rank
   already at W+1, where it is stale and case 1 applies.

When in doubt, R = False: a wrong "paused" costs one redundant START (an empty wave of
32 dummy steps), a wrong "running" lets a request start one rank alone, with nobody
waking the rest. So resize clears R.

Publishing: load changes are published at most every ``publish_interval_s``; a change of
wave, running flag or size (and a new frontend subscribing) is published at once, since a
stale wave state costs a round trip; an unchanged state is republished every
``heartbeat_interval_s`` so frontends can tell the coordinator is alive.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from tidal.engine_core.messages import (
    CoordinatorReady,
    DPCoordinatorStats,
    DPLoadSnapshot,
    DPRankStats,
    DPResize,
    DPWakeUp,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
)

# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class PublishSnapshot:
    """Send ``snapshot`` to every frontend."""

    snapshot: DPLoadSnapshot


@dataclass(frozen=True)
class BroadcastStartWave:
    """Send START_DP_WAVE(wave, exclude_engine) to every engine."""

    wave: int
    exclude_engine: int | None

    def message(self) -> StartDPWave:
        return StartDPWave(wave=self.wave, exclude_engine_index=self.exclude_engine)


Action = PublishSnapshot | BroadcastStartWave
CoordinatorInput = EngineCoreOutputs | DPWakeUp | DPResize


# ------------------------------------------------------------------------- coordinator


class _Rank:
    """Last reported load of one rank plus its history ring buffer."""

    __slots__ = ("waiting", "running", "kv_usage", "requests_total", "dead", "history")

    def __init__(self, history_len: int) -> None:
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.requests_total = 0
        self.dead = False
        self.history: collections.deque[tuple[float, int, int]] = collections.deque(
            maxlen=history_len
        )

    def update(self, s: SchedulerStats) -> bool:
        """Apply one stats report; True when anything a frontend uses changed."""
        new = (s.num_waiting_reqs, s.num_running_reqs, s.kv_cache_usage)
        changed = new != (self.waiting, self.running, self.kv_usage)
        self.waiting, self.running, self.kv_usage = new
        # Cumulative counter: never let a restarted/reordered report move it backwards.
        self.requests_total = max(self.requests_total, s.num_requests_total)
        return changed


class CoordinatorState:
    """Per-rank load, the wave number and running flag, and when to publish them.

    Feed it with ``handle(msg, now)`` and ``tick(now)``; both return the actions due now.
    ``next_deadline()`` says when ``tick`` will next have something to do.
    """

    def __init__(
        self,
        num_engines: int,
        history_len: int = 600,
        publish_interval_s: float = 0.1,
        heartbeat_interval_s: float = 3.0,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.history_len = history_len
        self.publish_interval_s = publish_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ranks = [_Rank(history_len) for _ in range(num_engines)]
        self.wave = 0
        self.running = False
        self.waves_completed = 0
        self.start_wave_broadcasts = 0
        self.ignored_messages = 0  # from ranks outside the current size
        self._seq = 0
        self._last_publish = -math.inf
        self._changed = True  # first tick publishes
        self._urgent = False

    # ------------------------------------------------------------------ public API

    @property
    def num_engines(self) -> int:
        return len(self._ranks)

    def handle(self, msg: CoordinatorInput, now: float) -> list[Action]:
        """Apply one message from an engine or a frontend."""
        if isinstance(msg, EngineCoreOutputs):
            actions = self._on_engine(msg)
        elif isinstance(msg, DPWakeUp):
            actions = self._on_wake_up(msg.wave, msg.engine_index)
        elif isinstance(msg, DPResize):
            self.resize(msg.num_engines)
            actions = []
        else:
            raise TypeError(f"CoordinatorState cannot handle {type(msg).__name__}")
        return actions + self.tick(now)

    def tick(self, now: float) -> list[Action]:
        """Publish if due: urgent change, rate-limited load change, or heartbeat."""
        since = now - self._last_publish
        due = (
            self._urgent
            or (self._changed and since >= self.publish_interval_s)
            or since >= self.heartbeat_interval_s
        )
        return [self._publish(now)] if due else []

    def next_deadline(self) -> float:
        """Time at which ``tick`` next publishes if nothing else happens."""
        if self._urgent:
            return -math.inf
        if self._changed:
            return self._last_publish + self.publish_interval_s
        return self._last_publish + self.heartbeat_interval_s

    def request_publish(self) -> None:
        """Publish at the next tick regardless of the rate limit (a frontend subscribed)."""
        self._urgent = True

    def resize(self, new_num_engines: int) -> None:
        """Elastic scaling: keep ranks ``< new_num_engines``, add fresh ones."""
        if new_num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {new_num_engines}")
        n = self.num_engines
        if new_num_engines < n:
            del self._ranks[new_num_engines:]
        else:
            self._ranks.extend(_Rank(self.history_len) for _ in range(new_num_engines - n))
        # New ranks are paused and old ones may be mid-commit: "paused" is the safe belief.
        self.running = False
        self._urgent = True

    def snapshot(self, now: float) -> DPLoadSnapshot:
        """The published struct (``seq`` is that of the latest publication)."""
        return DPLoadSnapshot(
            seq=self._seq,
            timestamp=now,
            wave=self.wave,
            running=self.running,
            counts=[[r.waiting, r.running] for r in self._ranks],
            kv_usage=[r.kv_usage for r in self._ranks],
        )

    def ready_message(self) -> CoordinatorReady:
        return CoordinatorReady(num_engines=self.num_engines, wave=self.wave, running=self.running)

    def full_stats(self, now: float) -> DPCoordinatorStats:
        return DPCoordinatorStats(
            timestamp=now,
            num_engines=self.num_engines,
            wave=self.wave,
            running=self.running,
            waves_completed=self.waves_completed,
            start_wave_broadcasts=self.start_wave_broadcasts,
            ranks=[
                DPRankStats(
                    rank=i,
                    waiting=r.waiting,
                    running=r.running,
                    kv_usage=r.kv_usage,
                    requests_total=r.requests_total,
                    dead=r.dead,
                    history=list(r.history),
                )
                for i, r in enumerate(self._ranks)
            ],
        )

    # ------------------------------------------------------------------ internals

    def _publish(self, now: float) -> PublishSnapshot:
        self._seq += 1
        self._last_publish = now
        self._changed = self._urgent = False
        for r in self._ranks:
            r.history.append((now, r.waiting, r.running))
        return PublishSnapshot(self.snapshot(now))

    def _on_engine(self, out: EngineCoreOutputs) -> list[Action]:
        e = out.engine_index
        if not 0 <= e < self.num_engines:
            self.ignored_messages += 1  # a rank removed by a resize, still draining
            return []
        rank = self._ranks[e]
        if out.scheduler_stats is not None and rank.update(out.scheduler_stats):
            self._changed = True
        if out.engine_dead and not rank.dead:
            rank.dead = True
            self._urgent = True
        if out.wave_complete is not None:
            self._on_wave_complete(out.wave_complete)
        if out.start_wave is not None:
            return self._on_start_wave(out.start_wave, e)
        return []

    def _on_wave_complete(self, wave: int) -> None:
        if wave < self.wave:
            return  # race 3: a start for a later wave overtook this report
        self.wave = wave + 1
        self.running = False
        self.waves_completed += 1
        self._urgent = True

    def _on_start_wave(self, wave: int, engine: int) -> list[Action]:
        if wave > self.wave:
            self.wave = wave  # race 3: wave_complete(wave - 1) still in flight
        elif wave < self.wave or self.running:
            return []  # stale (race 1) or duplicate (race 4)
        return [self._start(engine)]

    def _on_wake_up(self, wave: int, engine: int) -> list[Action]:
        if self.running:
            return []  # duplicate (race 4) or wave just ended (race 5)
        if wave > self.wave:
            self.wave = wave  # cannot happen with one coordinator; adopt rather than stall
        exclude = engine if wave == self.wave else None  # stale: wake everyone (race 1)
        return [self._start(exclude)]

    def _start(self, exclude: int | None) -> BroadcastStartWave:
        self.running = True
        self.start_wave_broadcasts += 1
        self._urgent = True
        return BroadcastStartWave(self.wave, exclude)


# ------------------------------------------------------------ the other two roles


class FrontendWaveState:
    """A frontend's half of the wave protocol (used by the DP client)."""

    def __init__(self) -> None:
        self.wave = 0
        self.running = False

    def on_snapshot(self, snap: DPLoadSnapshot) -> None:
        self.wave, self.running = snap.wave, snap.running

    def on_send(self, engine_index: int) -> tuple[int, DPWakeUp | None]:
        """Wave to stamp on a request going to ``engine_index``, and the wake-up to send
        to the coordinator with it (only the first request while engines look paused)."""
        if self.running:
            return self.wave, None
        self.running = True
        return self.wave, DPWakeUp(wave=self.wave, engine_index=engine_index)


class EngineWaveState:
    """One engine rank's half of the wave protocol (used by DPEngineCoreProc).

    Each method returns the wave to report as ``start_wave`` (or None)."""

    def __init__(self, engine_index: int, wave: int = 0) -> None:
        self.engine_index = engine_index
        self.wave = wave
        self.running = False

    def on_request(self, request_wave: int) -> int | None:
        if self.running:
            return None
        self.running = True
        if request_wave < self.wave:
            return self.wave  # nobody else knows this wave must start
        self.wave = request_wave
        return None

    def on_start_wave(self, msg: StartDPWave) -> bool:
        """Apply START_DP_WAVE; True when it made this rank start running."""
        if msg.exclude_engine_index == self.engine_index or msg.wave < self.wave:
            return False  # started on its own / crossed a wave end (race 2)
        started = not self.running
        self.wave = msg.wave
        self.running = True
        return started

    def on_wave_end(self) -> int:
        """The all-reduce found the group idle: pause; returns the completed wave (rank 0
        reports it as ``wave_complete``)."""
        done = self.wave
        self.wave = done + 1
        self.running = False
        return done
