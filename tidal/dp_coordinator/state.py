"""DP coordinator state and the wave protocol (pure: no sockets, no clocks).

Every table is keyed by engine id, the engine's stable identity; its DP rank is its
position in the current ``Topology`` (docs/architecture.md#elastic-identity, ``tidal.protocol.topology``).

Waves
=====
While a *wave* runs, every DP rank steps -- dummy batches when it has no work -- so the
EP collectives of all ranks stay matched; every 32 steps the ranks all-reduce "does anyone
have unfinished work?". When nobody has, wave ``w`` ends: rank 0 sends
``EngineCoreOutputs(wave_complete=w)``, every rank pauses and sets ``current_wave = w + 1``.
A rank that runs while another is paused blocks in the collectives until the other joins,
so the protocol's one job is: **whenever any rank starts, every rank starts.**

Actors and their rules (W = the coordinator's wave, R = its ``running`` flag):

Frontend (``tidal.frontend.dp_state.FrontendWaveState``): stamps each request with the
  wave of its last snapshot. If it believes the engines are paused it also sends
  ``DPWakeUp(wave, engine)`` once and then believes them running (until a snapshot says
  otherwise). A new topology makes it believe them paused; a snapshot of an older epoch
  than its topology is dropped.

Engine (``tidal.engine_core.wave.EngineWaveState``, applied by ``DPEngineCoreProc``):
  * request stamped ``rw`` while paused at ``cw``:
      ``rw >= cw``: adopt ``max(rw, cw)`` and run. The frontend either sent a wake-up, or
        saw R=True for that wave, so a START_DP_WAVE for it is already on its way.
      ``rw < cw``: the frontend has not yet seen wave ``rw`` end, so nobody will wake the
        others: run and send ``start_wave=cw`` to the coordinator.
  * request while running: just add it (it joins the running wave).
  * ``StartDPWave(w, exclude)``: ignore if ``exclude`` is this engine (it started on its
    own); ignore if ``w < cw`` -- it crossed a wave end (see race 2); else adopt ``w`` and run.
  * wave end (all-reduce says idle): ``cw = w + 1``, pause; rank 0 sends ``wave_complete=w``.

Coordinator (``CoordinatorState.handle``):
  * ``DPWakeUp(w, e)``: if R, ignore (duplicate). Else set R and broadcast START(W,
    exclude=e) -- or exclude nobody if ``w < W`` (the wake-up is stale; engine e is paused
    at W and will start on the stale request anyway, an extra START is harmless) or if e
    is a former engine (race 8).
    ``w > W`` cannot happen with one coordinator; it is adopted defensively.
  * ``start_wave=w`` from engine e: ``w > W`` -> W = w, R, START(w, exclude=e);
    ``w == W`` and not R -> R, START(W, exclude=e); otherwise ignore (duplicate or stale).
  * ``wave_complete=w``: ``w >= W`` -> W = w + 1, not R; ``w < W`` -> ignore (stale).
  * from an engine not in the current topology: a *future* one is served as a member
    (race 11); a *former* one is ignored and counted (races 6, 7) -- except its
    ``wave_complete``, applied as above (race 7).
  * ``DPSetTopology(t)``: ``t.epoch`` newer -> adopt it (survivors keep their rows, new
    engines start idle, removed ones are forgotten), R = False (see "when in doubt"
    below); older -> drop, count (race 9); same epoch -> duplicate if the same engines,
    else an error (two controllers).

Races (and why the rules above are safe; tests/unit/test_coordinator_state.py model-checks
all three roles under random interleavings, with and without topology changes)
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

Topology races (the engine id is stable, the rank is not; see ``tidal.protocol.topology``)
------------------------------------------------------------------------------------------
The engines commit a topology first, at one step boundary; the coordinator is told after
(``DPSetTopology``) and the frontends each at their own moment. So the coordinator may be
*behind* the engines, never ahead, and an engine it does not know is either *former*
(``id < next_id``: removed, or a rolled-back joiner) or *future* (``id >= next_id``: in a
topology already committed but not yet received here). A former engine's messages are
ignored and counted (but see race 7); a future engine is served as a member.

6. A removed engine's stats / ``engine_dead`` in flight when the new topology arrives.
   Ignored and counted: applying them would recreate its row, and every snapshot would
   show a removed engine again (the balancer would route to it).
7. A removed engine's ``wave_complete=w`` / ``start_wave=w`` in flight. ``start_wave`` is
   ignored: the engine has left the group, so nobody must be woken for its sake (its
   requests migrate and come back as new requests, with their own wake-ups).
   ``wave_complete=w`` is applied if the id was ever handed out (``< next_id``): the old
   rank 0 reports the all-reduce that ended wave w for the whole group, survivors
   included (the commit happens at a step boundary of that same group), so it is true
   whoever sends it, and the usual ``w < W`` rule drops it if it is stale. Dropping it
   would also be safe -- W stays one behind the survivors, the next request reaches an
   engine at W+1 which sends ``start_wave=W+1``, case 1 -- but would leave the
   coordinator and the engines disagreeing on the wave until then.
8. A wake-up naming a former engine (the frontend routed by an older topology): it is
   not in the group, so START excludes nobody. One naming a future engine excludes it
   as usual: it started on the request itself.
9. A stale topology. Topologies only move forward: one with an older epoch (a delayed
   copy, a second frontend forwarding what it learnt late) is dropped and counted; it
   must not bring back a removed engine. The same epoch again with the same engines is
   a duplicate (no-op); with other engines it is a bug (ValueError, logged by proc).
10. A snapshot published before a topology change reaches a frontend after its own
   ``set_topology``: its epoch is older, and the frontend's balancer and wave state drop
   it. For the balancer this matters: it would resurrect a removed engine (vllm#55772).
   The wave state drops it so that its belief never goes back an epoch: it took
   "paused" at ``set_topology`` (when in doubt, below), and a "running" from before the
   change would suppress a wake-up that is cheap to send. (The model check finds it
   not needed for safety when the commit falls on a wave end: such a request carries a
   wave older than the group's, so the engine it reaches sends ``start_wave`` itself,
   case 1.) Every snapshot therefore carries ``epoch`` and the ``engine_ids`` its rows
   describe.
11. A new engine serves before the coordinator learns the topology holding it: a
   migrated or newly routed request, stamped with an older wave, reaches it paused at
   the group's wave, and it sends ``start_wave``. That message overtakes the topology,
   and it is the only thing that will wake the others: dropping it strands the new
   engine running alone (the model check finds this). So a future engine's
   ``start_wave`` / ``wave_complete`` are applied like a member's, and its stats and
   ``engine_dead`` are kept aside and become its row when the topology arrives (its
   load is not lost until its next change). A rolled-back joiner's kept row is dropped
   once a topology's ``next_id`` passes its id.

When in doubt, R = False: a wrong "paused" costs one redundant START (an empty wave of
32 dummy steps), a wrong "running" lets a request start one rank alone, with nobody
waking the rest. So a topology change clears R: new engines are paused and old ones may
be mid-commit.

Publishing: load changes are published at most every ``publish_interval_s``; a change of
wave, running flag or topology (and a new frontend subscribing) is published at once, since a
stale wave state costs a round trip; an unchanged state is republished every
``heartbeat_interval_s`` so frontends can tell the coordinator is alive.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from tidal.protocol.messages import (
    CoordinatorReady,
    DPCoordinatorStats,
    DPLoadSnapshot,
    DPRankStats,
    DPSetTopology,
    DPWakeUp,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
)
from tidal.protocol.topology import MAX_ENGINE_ID, Topology

# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class PublishSnapshot:
    """Send ``snapshot`` to every frontend."""

    snapshot: DPLoadSnapshot


@dataclass(frozen=True)
class BroadcastStartWave:
    """Send START_DP_WAVE(wave, exclude_engine) to every engine (exclude: an engine id)."""

    wave: int
    exclude_engine: int | None

    def message(self) -> StartDPWave:
        return StartDPWave(wave=self.wave, exclude_engine_id=self.exclude_engine)


Action = PublishSnapshot | BroadcastStartWave
CoordinatorInput = EngineCoreOutputs | DPWakeUp | DPSetTopology


# ------------------------------------------------------------------------- coordinator


class _Rank:
    """Last reported load of one engine plus its history ring buffer."""

    __slots__ = (
        "waiting",
        "running",
        "kv_usage",
        "requests_total",
        "generation_tokens_total",
        "dead",
        "history",
    )

    def __init__(self, history_len: int) -> None:
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.requests_total = 0
        self.generation_tokens_total = 0
        self.dead = False
        self.history: collections.deque[tuple[float, int, int]] = collections.deque(
            maxlen=history_len
        )

    def update(self, s: SchedulerStats) -> bool:
        """Apply one stats report; True when anything a frontend uses changed."""
        new = (s.num_waiting_reqs, s.num_running_reqs, s.kv_cache_usage)
        changed = new != (self.waiting, self.running, self.kv_usage)
        self.waiting, self.running, self.kv_usage = new
        # Cumulative counters: never let a restarted/reordered report move them backwards.
        # Not "changed": snapshots do not carry them (full_stats reads them on demand).
        self.requests_total = max(self.requests_total, s.num_requests_total)
        self.generation_tokens_total = max(
            self.generation_tokens_total, s.num_generation_tokens_total
        )
        return changed


class CoordinatorState:
    """Per-engine load, the wave number and running flag, and when to publish them.

    Feed it with ``handle(msg, now)`` and ``tick(now)``; both return the actions due now.
    ``next_deadline()`` says when ``tick`` will next have something to do. Tables are
    keyed by engine id, in the rank order of ``topology``.
    """

    def __init__(
        self,
        topology: Topology | int,
        history_len: int = 600,
        publish_interval_s: float = 0.1,
        heartbeat_interval_s: float = 3.0,
        wave: int = 0,
    ) -> None:
        """``wave``: where to start -- 0 at launch; a restarted coordinator (docs/architecture.md#faults) starts at the frontend's last known wave, paused (when in doubt, R = False);
        the engines' next ``start_wave`` / ``wave_complete`` correct it (races 1, 3)."""
        if isinstance(topology, int):  # launch size: engine ids 0..n-1
            topology = Topology.initial(topology)
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.history_len = history_len
        self.publish_interval_s = publish_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.topology = topology
        self._ranks = {e: _Rank(history_len) for e in topology.engine_ids}
        # Rows of future engines (race 11), adopted when a topology holding them arrives.
        self._early: dict[int, _Rank] = {}
        self.wave = wave
        self.running = False
        self.waves_completed = 0
        self.start_wave_broadcasts = 0
        self.ignored_messages = 0  # from engines outside the topology (races 6, 7)
        self.stale_topologies = 0  # older epoch than the current one (race 9)
        self._seq = 0
        self._last_publish = -math.inf
        self._changed = True  # first tick publishes
        self._urgent = False

    # ------------------------------------------------------------------ public API

    @property
    def num_engines(self) -> int:
        return self.topology.size

    @property
    def epoch(self) -> int:
        return self.topology.epoch

    def handle(self, msg: CoordinatorInput, now: float) -> list[Action]:
        """Apply one message from an engine or a frontend."""
        if isinstance(msg, EngineCoreOutputs):
            actions = self._on_engine(msg)
        elif isinstance(msg, DPWakeUp):
            actions = self._on_wake_up(msg.wave, msg.engine_id)
        elif isinstance(msg, DPSetTopology):
            self.set_topology(msg.topology)
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

    def set_topology(self, topology: Topology) -> bool:
        """Elastic scaling (commit) or a rank death: the group is now ``topology``.

        Any engine may go (middle of the table, a dead one) and new ones come; survivors
        keep their rows and history. Returns False for a stale or repeated topology
        (race 9); raises ValueError for a different one at the current epoch."""
        if not topology.supersedes(self.topology):
            if topology.epoch < self.topology.epoch:
                self.stale_topologies += 1
            return False
        old, early = self._ranks, self._early
        self._ranks = {
            e: old.get(e) or early.pop(e, None) or _Rank(self.history_len)
            for e in topology.engine_ids
        }
        # Kept rows whose id this topology's allocator has passed never joined (race 11).
        self._early = {e: r for e, r in early.items() if e >= topology.next_id}
        self.topology = topology
        # New engines are paused and old ones may be mid-commit: "paused" is the safe belief.
        self.running = False
        self._urgent = True
        return True

    def snapshot(self, now: float) -> DPLoadSnapshot:
        """The published struct (``seq`` is that of the latest publication)."""
        ranks = self._ranks.values()
        return DPLoadSnapshot(
            seq=self._seq,
            timestamp=now,
            epoch=self.topology.epoch,
            engine_ids=list(self.topology.engine_ids),
            wave=self.wave,
            running=self.running,
            counts=[[r.waiting, r.running] for r in ranks],
            kv_usage=[r.kv_usage for r in ranks],
        )

    def ready_message(self) -> CoordinatorReady:
        return CoordinatorReady(
            num_engines=self.num_engines,
            wave=self.wave,
            running=self.running,
            epoch=self.topology.epoch,
        )

    def full_stats(self, now: float) -> DPCoordinatorStats:
        return DPCoordinatorStats(
            timestamp=now,
            num_engines=self.num_engines,
            wave=self.wave,
            running=self.running,
            waves_completed=self.waves_completed,
            start_wave_broadcasts=self.start_wave_broadcasts,
            epoch=self.topology.epoch,
            ignored_messages=self.ignored_messages + self.stale_topologies,
            ranks=[
                DPRankStats(
                    rank=i,
                    engine_id=e,
                    waiting=r.waiting,
                    running=r.running,
                    kv_usage=r.kv_usage,
                    requests_total=r.requests_total,
                    dead=r.dead,
                    history=list(r.history),
                    generation_tokens_total=r.generation_tokens_total,
                )
                for i, (e, r) in enumerate(self._ranks.items())
            ],
        )

    # ------------------------------------------------------------------ internals

    def _publish(self, now: float) -> PublishSnapshot:
        self._seq += 1
        self._last_publish = now
        self._changed = self._urgent = False
        for r in self._ranks.values():
            r.history.append((now, r.waiting, r.running))
        return PublishSnapshot(self.snapshot(now))

    def _on_engine(self, out: EngineCoreOutputs) -> list[Action]:
        e = out.engine_id  # the sender's engine id
        rank = self._ranks.get(e)
        member = rank is not None
        if not member:
            if not self.topology.next_id <= e <= MAX_ENGINE_ID:  # former (or no engine)
                self.ignored_messages += 1  # races 6, 7
                if out.wave_complete is not None and 0 <= e < self.topology.next_id:
                    self._on_wave_complete(out.wave_complete)  # the old rank 0's (race 7)
                return []
            rank = self._early.setdefault(e, _Rank(self.history_len))  # future (race 11)
        if out.scheduler_stats is not None and rank.update(out.scheduler_stats) and member:
            self._changed = True
        if out.engine_dead and not rank.dead:
            rank.dead = True
            if member:
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
        # Stale: wake everyone (race 1); so does a former engine's wake-up (race 8).
        former = engine not in self._ranks and engine < self.topology.next_id
        exclude = engine if wave == self.wave and not former else None
        return [self._start(exclude)]

    def _start(self, exclude: int | None) -> BroadcastStartWave:
        self.running = True
        self.start_wave_broadcasts += 1
        self._urgent = True
        return BroadcastStartWave(self.wave, exclude)
