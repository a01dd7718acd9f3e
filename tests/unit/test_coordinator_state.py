"""CoordinatorState: publishing rules, the wave protocol and its races, topology changes.

The last part model-checks the three roles of the wave protocol together (coordinator,
engines, frontends) under random message interleavings -- with and without engines
removed and added in between -- and asserts no rank is ever left running alone once all
messages are delivered.
"""

from __future__ import annotations

import collections
import random

import pytest

from tidal.dp_coordinator.state import (
    BroadcastStartWave,
    CoordinatorState,
    PublishSnapshot,
)
from tidal.engine_core.wave import EngineWaveState
from tidal.frontend.dp_state import FrontendWaveState
from tidal.protocol.messages import (
    STATS_DECODER,
    DPSetTopology,
    DPWakeUp,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
    encode,
)
from tidal.protocol.topology import Topology


def stats(
    engine: int, waiting: int, running: int, kv: float = 0.0, total: int = 0, tokens: int = 0
):
    s = SchedulerStats(
        num_waiting_reqs=waiting, num_running_reqs=running, kv_cache_usage=kv,
        num_requests_total=total, num_generation_tokens_total=tokens,
    )  # fmt: skip
    return EngineCoreOutputs(engine_id=engine, scheduler_stats=s)


def publishes(actions) -> list:
    return [a.snapshot for a in actions if isinstance(a, PublishSnapshot)]


def starts(actions) -> list[tuple[int, int | None]]:
    return [(a.wave, a.exclude_engine) for a in actions if isinstance(a, BroadcastStartWave)]


def settled(n: int | Topology = 2, **kw) -> CoordinatorState:
    """A state whose initial publication is done (at t=0)."""
    st = CoordinatorState(n, **kw)
    assert len(publishes(st.tick(0.0))) == 1
    return st


# ------------------------------------------------------------------- publishing


def test_publishes_only_on_change():
    st = settled()
    assert st.tick(0.5) == []  # nothing changed, no heartbeat due yet
    assert publishes(st.handle(stats(1, 2, 3), 0.6)) != []  # >= 100 ms since last: at once
    assert st.tick(0.8) == []
    # A report that changes nothing is not a change.
    assert st.handle(stats(1, 2, 3), 0.9) == []
    assert st.tick(1.0) == []


def test_load_changes_rate_limited_to_100ms():
    st = settled()
    snaps = publishes(st.handle(stats(0, 1, 0), 1.0))
    assert len(snaps) == 1 and snaps[0].counts == [[1, 0], [0, 0]]
    assert st.handle(stats(0, 2, 0), 1.03) == []
    assert st.handle(stats(1, 0, 5), 1.06) == []
    assert st.next_deadline() == pytest.approx(1.1)
    assert st.tick(1.099) == []
    (snap,) = publishes(st.tick(1.1))
    # One publication carries everything that changed in between.
    assert snap.counts == [[2, 0], [0, 5]]
    assert snap.seq == snaps[0].seq + 1


def test_heartbeat_when_unchanged():
    st = settled(heartbeat_interval_s=3.0)
    assert st.next_deadline() == pytest.approx(3.0)
    assert st.tick(2.99) == []
    (snap,) = publishes(st.tick(3.0))
    assert snap.timestamp == 3.0
    assert publishes(st.tick(6.0)) != []


def test_snapshot_contents_and_history():
    st = settled(2, history_len=3)
    st.handle(stats(0, 1, 2, kv=0.5, total=7), 1.0)
    snap = st.snapshot(1.0)
    assert snap.counts == [[1, 2], [0, 0]] and snap.kv_usage == [0.5, 0.0]
    for t in (2.0, 3.0, 4.0, 5.0):
        st.handle(stats(1, 0, int(t)), t)
    full = st.full_stats(5.0)
    assert full.num_engines == 2 and full.ranks[0].requests_total == 7
    # Ring buffer: only the last three publications, oldest first.
    assert [h[0] for h in full.ranks[1].history] == [3.0, 4.0, 5.0]
    assert full.ranks[1].history[-1] == (5.0, 0, 5)


def test_requests_total_never_goes_back():
    st = settled(1)
    st.handle(stats(0, 0, 0, total=10), 1.0)
    st.handle(stats(0, 0, 1, total=4), 2.0)  # a reordered/older report
    assert st.full_stats(2.0).ranks[0].requests_total == 10


def test_generation_tokens_total_per_engine():
    st = settled(2)
    assert [r.generation_tokens_total for r in st.full_stats(0.5).ranks] == [0, 0]
    st.handle(stats(0, 0, 2, tokens=40), 1.0)
    st.handle(stats(1, 0, 1, tokens=7), 1.2)
    # Steady decoding: only the counter moved. Not a load change, so no publication (the
    # snapshots do not carry it), but /stats shows it at once.
    assert st.handle(stats(0, 0, 2, tokens=90), 1.5) == [] and st.tick(1.6) == []
    st.handle(stats(0, 0, 2, tokens=60), 1.7)  # a reordered/older report
    full = st.full_stats(1.8)
    assert [(r.engine_id, r.generation_tokens_total) for r in full.ranks] == [(0, 90), (1, 7)]
    # It crosses the coordinator -> frontend wire (msgpack) intact.
    assert STATS_DECODER.decode(encode(full)).ranks[1].generation_tokens_total == 7
    # A future engine's counter is kept with its early row; a survivor keeps its own.
    st.handle(stats(2, 0, 1, tokens=5), 2.0)
    st.handle(DPSetTopology(st.topology.without([1]).grown(1)), 2.1)
    full = st.full_stats(2.2)
    assert [(r.engine_id, r.generation_tokens_total) for r in full.ranks] == [(0, 90), (2, 5)]


def test_new_subscriber_gets_immediate_publish():
    st = settled()
    st.handle(stats(0, 1, 1), 1.0)
    st.request_publish()
    assert publishes(st.tick(1.01)) != []


# ----------------------------------------------------------------- wave protocol


def test_wake_up_starts_wave_excluding_the_requested_rank():
    st = settled(3)
    acts = st.handle(DPWakeUp(wave=0, engine_id=2), 1.0)
    assert starts(acts) == [(0, 2)]
    (snap,) = publishes(acts)  # wave state goes out at once, not rate-limited
    assert snap.running and snap.wave == 0


def test_duplicate_wake_ups_broadcast_once():
    st = settled(3)
    assert starts(st.handle(DPWakeUp(0, 1), 1.0)) == [(0, 1)]
    assert starts(st.handle(DPWakeUp(0, 2), 1.001)) == []
    assert starts(st.handle(EngineCoreOutputs(engine_id=1, start_wave=0), 1.002)) == []
    assert st.start_wave_broadcasts == 1


def test_wave_complete_pauses_and_advances():
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    (snap,) = publishes(st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 1.01))
    assert (snap.wave, snap.running) == (1, False)
    assert st.waves_completed == 1
    # The next wake-up, for the new wave, starts it.
    assert starts(st.handle(DPWakeUp(1, 1), 1.02)) == [(1, 1)]


def test_stale_wake_up_starts_the_current_wave_for_everyone():
    """Race 1: a frontend saw (0, paused) but wave 0 ran and completed meanwhile."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 1.1)
    assert starts(st.handle(DPWakeUp(0, 1), 1.2)) == [(1, None)]
    # The stale-request rank's own start_wave for wave 1 is then a duplicate.
    assert starts(st.handle(EngineCoreOutputs(engine_id=1, start_wave=1), 1.21)) == []


def test_start_wave_from_engine():
    st = settled(3)
    acts = st.handle(EngineCoreOutputs(engine_id=2, start_wave=0), 1.0)
    assert starts(acts) == [(0, 2)] and st.running


def test_stale_start_wave_ignored():
    """Race 1: start_wave for a wave the coordinator has seen complete."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 1.1)
    assert starts(st.handle(EngineCoreOutputs(engine_id=1, start_wave=0), 1.2)) == []
    assert (st.wave, st.running) == (1, False)


@pytest.mark.parametrize("complete_first", [True, False])
def test_wave_complete_and_next_start_in_either_order(complete_first):
    """Race 3: rank 0's wave_complete=0 and rank 1's start_wave=1 cross."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    complete = EngineCoreOutputs(engine_id=0, wave_complete=0)
    start = EngineCoreOutputs(engine_id=1, start_wave=1)
    first, second = (complete, start) if complete_first else (start, complete)
    acts = st.handle(first, 1.1) + st.handle(second, 1.2)
    assert starts(acts) == [(1, 1)]
    # Either way: wave 1 running; the late wave_complete must not clear the flag.
    assert (st.wave, st.running) == (1, True)


def test_stale_wave_complete_does_not_clear_running():
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_id=1, start_wave=4), 1.0)
    assert (st.wave, st.running) == (4, True)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=2), 1.1)
    assert (st.wave, st.running) == (4, True)


def test_messages_from_removed_ranks_ignored():
    st = settled(Topology.initial(6).without([2, 3, 4, 5]))
    assert st.handle(EngineCoreOutputs(engine_id=5, start_wave=0), 1.0) == []
    assert not st.running and st.ignored_messages == 1


def test_engine_dead_is_recorded_and_published():
    st = settled(2)
    acts = st.handle(EngineCoreOutputs(engine_id=1, engine_dead=True, dead_reason="x"), 0.01)
    assert publishes(acts) and st.full_stats(0.01).ranks[1].dead


# ---------------------------------------------------------------------- topology


def test_resize_up_and_down():
    st = settled(2)
    st.handle(stats(0, 1, 1), 1.0)
    st.handle(stats(1, 2, 2), 1.2)
    st.handle(DPWakeUp(0, 0), 1.3)
    assert st.running
    grown = st.topology.grown(2)
    (snap,) = publishes(st.handle(DPSetTopology(grown), 1.31))  # immediate
    assert snap.counts == [[1, 1], [2, 2], [0, 0], [0, 0]]
    assert (snap.epoch, snap.engine_ids) == (1, [0, 1, 2, 3])
    assert not snap.running  # "paused" is the safe belief while ranks change
    assert len(st.full_stats(1.31).ranks) == 4
    st.set_topology(grown.without([1, 2, 3]))
    (snap,) = publishes(st.tick(1.32))
    assert snap.counts == [[1, 1]] and st.ready_message().num_engines == 1
    assert st.handle(stats(2, 5, 5), 1.5) == [] and st.ignored_messages == 1
    with pytest.raises(ValueError):
        st.set_topology(st.topology.without([0]))  # a topology needs an engine


def test_remove_an_engine_from_the_middle():
    st = settled(3, history_len=4)
    for e in range(3):
        st.handle(stats(e, e, 10 + e, kv=0.1 * e, total=e), 1.0 + e)
    topo = st.topology.without([1])
    assert topo.engine_ids == [0, 2] and topo.rank_of(2) == 1
    (snap,) = publishes(st.handle(DPSetTopology(topo), 4.0))
    assert (snap.epoch, snap.engine_ids) == (1, [0, 2])
    assert snap.counts == [[0, 10], [2, 12]] and snap.kv_usage == [0.0, pytest.approx(0.2)]
    full = st.full_stats(4.0)
    assert [(r.rank, r.engine_id) for r in full.ranks] == [(0, 0), (1, 2)]
    assert full.epoch == 1 and full.ranks[1].requests_total == 2
    assert full.ranks[1].history[-1] == (4.0, 2, 12)  # the survivor keeps its history
    # Engine 2 is rank 1 now, but it is still addressed (and excluded) by its id.
    assert starts(st.handle(EngineCoreOutputs(engine_id=2, start_wave=0), 4.1)) == [(0, 2)]


def test_remove_a_dead_engine():
    st = settled(3)
    st.handle(stats(1, 4, 4), 1.0)
    st.handle(EngineCoreOutputs(engine_id=1, engine_dead=True, dead_reason="oom"), 1.1)
    assert st.full_stats(1.1).ranks[1].dead
    st.handle(DPSetTopology(st.topology.without([1])), 1.2)
    full = st.full_stats(1.2)
    assert [r.engine_id for r in full.ranks] == [0, 2] and not any(r.dead for r in full.ranks)
    # Its last words, still in flight, do not bring it back.
    st.handle(EngineCoreOutputs(engine_id=1, engine_dead=True, dead_reason="oom"), 1.3)
    (snap,) = publishes(st.tick(5.0))
    assert snap.engine_ids == [0, 2] and snap.counts == [[0, 0], [0, 0]]
    assert st.ignored_messages == 1


def test_messages_from_a_removed_engine_are_ignored():
    """Races 6 and 7: stats, start_wave and engine_dead of a removed engine in flight."""
    st = settled(3)
    st.handle(DPSetTopology(st.topology.without([2])), 1.0)
    assert st.handle(stats(2, 9, 9), 1.1) == []
    assert starts(st.handle(EngineCoreOutputs(engine_id=2, start_wave=0), 1.2)) == []
    assert starts(st.handle(EngineCoreOutputs(engine_id=2, start_wave=3), 1.3)) == []
    assert (st.wave, st.running) == (0, False)
    assert st.snapshot(1.3).engine_ids == [0, 1]
    assert st.ignored_messages == 3
    assert st.full_stats(1.3).ignored_messages == 3


def test_removed_engines_wave_complete_still_ends_the_wave():
    """Race 7: the old rank 0's wave_complete arrives after its removal; the survivors
    shared that all-reduce, so the wave number still moves on."""
    st = settled(3)
    st.handle(DPWakeUp(0, 1), 1.0)
    st.handle(DPSetTopology(st.topology.without([0])), 1.1)
    (snap,) = publishes(st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 1.2))
    assert (snap.wave, snap.running) == (1, False) and snap.engine_ids == [1, 2]
    # ... but an id that cannot be an engine's does not end a wave.
    st.handle(EngineCoreOutputs(engine_id=2**16, wave_complete=1), 1.3)
    assert st.wave == 1 and st.ignored_messages == 2


def test_wake_up_for_an_engine_outside_the_topology_wakes_everyone():
    """Race 8: the frontend routed by an older (or newer) topology."""
    st = settled(3)
    st.handle(DPSetTopology(st.topology.without([1])), 1.0)
    assert starts(st.handle(DPWakeUp(0, 1), 1.1)) == [(0, None)]


def test_new_engines_get_fresh_ids():
    st = settled(2)
    st.handle(stats(1, 3, 3), 0.5)
    topo = st.topology.without([1]).grown(1)
    assert topo.engine_ids == [0, 2] and topo.epoch == 2  # id 1 is never reused
    st.handle(DPSetTopology(topo), 1.1)
    assert st.snapshot(1.1).counts == [[0, 0], [0, 0]]  # engine 2 starts idle
    st.handle(stats(2, 0, 4), 1.2)
    assert st.snapshot(1.2).counts == [[0, 0], [0, 4]]
    assert st.ready_message().epoch == 1 + 1


def test_a_new_engine_ahead_of_its_topology_is_heard():
    """Race 11: engine 2 committed and serves before the coordinator learns of it."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 0.5)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 0.6)
    topo = st.topology.grown(1)
    assert st.handle(stats(2, 1, 2), 1.0) == []  # kept aside, not published yet
    assert st.snapshot(1.0).engine_ids == [0, 1]
    # Its start_wave (a stale request reached it) is the only thing that wakes the others.
    assert starts(st.handle(EngineCoreOutputs(engine_id=2, start_wave=1), 1.1)) == [(1, 2)]
    st.handle(DPSetTopology(topo), 1.2)
    assert st.snapshot(1.2).counts == [[0, 0], [0, 0], [1, 2]] and st.ignored_messages == 0


def test_a_rolled_back_joiners_early_row_is_dropped():
    st = settled(2)
    st.handle(stats(2, 1, 1), 1.0)  # engine 2 started, then its scale-up was rolled back
    topo = st.topology.retire_ids([2]).grown(1)
    assert topo.engine_ids == [0, 1, 3]
    st.handle(DPSetTopology(topo), 1.1)
    assert st.snapshot(1.1).counts == [[0, 0], [0, 0], [0, 0]]
    assert st.handle(stats(2, 5, 5), 1.2) == [] and st.ignored_messages == 1


def test_stale_and_repeated_topologies():
    """Race 9: topologies only move forward."""
    st = settled(3)
    t1 = st.topology.without([2])
    t2 = t1.grown(1)
    assert st.set_topology(t2)
    publishes(st.tick(1.0))
    assert st.handle(DPSetTopology(t1), 1.5) == []  # stale: nothing published, no change
    assert not st.set_topology(t1) and st.stale_topologies == 2
    assert st.topology == t2 and st.snapshot(1.5).engine_ids == [0, 1, 3]
    assert not st.set_topology(t2)  # a duplicate
    assert st.stale_topologies == 2
    with pytest.raises(ValueError, match="two topologies"):
        st.set_topology(Topology(t2.epoch, [0, 1]))


def test_stale_topology_does_not_clear_running():
    st = settled(2)
    st.set_topology(st.topology.grown(1))
    st.handle(DPWakeUp(st.wave, 0), 1.0)
    assert st.running
    st.handle(DPSetTopology(Topology.initial(2)), 1.1)
    assert st.running and st.num_engines == 3


def test_ready_message_carries_wave():
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=3), 1.0)
    ready = st.ready_message()
    assert (ready.num_engines, ready.wave, ready.running) == (2, 4, False)


# ------------------------------------------------------------- the other roles


def test_frontend_sends_one_wake_up_per_paused_wave():
    fe = FrontendWaveState()
    assert fe.on_send(1) == (0, DPWakeUp(0, 1))
    assert fe.on_send(0) == (0, None)
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_id=0, wave_complete=0), 1.0)
    fe.on_snapshot(st.snapshot(1.0))
    assert fe.on_send(0) == (1, DPWakeUp(1, 0))


def test_frontend_wakes_after_a_topology_change_and_drops_stale_snapshots():
    """Race 10: a snapshot saying "running" from before the change must not suppress the
    wake-up that the new (paused) engine needs."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    old = st.snapshot(1.0)
    assert old.running and old.epoch == 0
    fe = FrontendWaveState()
    assert fe.on_snapshot(old) and fe.running
    topo = st.topology.grown(1)
    fe.set_topology(topo)
    assert not fe.on_snapshot(old)  # stale epoch: dropped
    assert fe.on_send(2) == (0, DPWakeUp(0, 2))
    st.set_topology(topo)
    assert fe.on_snapshot(st.snapshot(1.1)) and fe.epoch == 1
    fe.set_topology(topo)  # learnt late: already on that epoch, nothing to undo
    assert fe.on_send(0) == (0, DPWakeUp(0, 0))  # the snapshot said paused


def test_engine_rules():
    e = EngineWaveState(engine_id=1, wave=3)
    assert e.on_request(3) is None and e.running  # current wave: the frontend woke others
    e.on_wave_end()
    assert (e.wave, e.running) == (4, False)
    assert e.on_request(3) == 4  # stale request while paused: must tell the coordinator
    assert e.on_request(2) is None  # already running
    e.on_wave_end()
    assert not e.on_start_wave(StartDPWave(5, exclude_engine_id=1))  # excluded
    assert not e.on_start_wave(StartDPWave(4))  # crossed a wave end (race 2)
    assert not e.running
    assert e.on_start_wave(StartDPWave(5)) and (e.wave, e.running) == (5, True)
    f = EngineWaveState(engine_id=0, wave=0)
    assert f.on_request(7) is None and f.wave == 7  # a newer wave is adopted


# --------------------------------------------------------- protocol model check


class ProtocolModel:
    """Coordinator + engines + frontends exchanging messages over FIFO channels that a
    seeded scheduler delivers in random order. ``collective()`` is one all-reduce: it
    needs every rank running, serves all work and ends the wave.

    With ``n_reconfigs``, a planned topology change (remove any engine, or add one with
    a fresh id) commits at the next wave end, as the elastic commit does at a step
    boundary: removed engines stop, a new engine takes the group's wave, and the
    coordinator and each frontend learn the topology later, each at a random moment. A
    request reaching a removed engine is migrated by its frontend (docs/architecture.md#elastic-migration)."""

    def __init__(
        self,
        rng: random.Random,
        n_engines: int,
        n_frontends: int,
        engine_cls,
        n_reconfigs: int = 0,
    ):
        self.rng = rng
        self.engine_cls = engine_cls
        self.topology = Topology.initial(n_engines)  # the engines' (committed) topology
        self.coord = CoordinatorState(self.topology, publish_interval_s=0.0)
        self.engines = {e: engine_cls(e) for e in self.topology.engine_ids}  # alive
        self.work = dict.fromkeys(self.engines, 0)
        self.fronts = [FrontendWaveState() for _ in range(n_frontends)]
        self.front_topology = [self.topology] * n_frontends
        self.reconfigs_left = n_reconfigs
        self.planned: Topology | None = None
        self.chan: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.now = 0.0
        self.served = 0
        self._apply(self.coord.tick(0.0))

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, PublishSnapshot):
                for f in range(len(self.fronts)):
                    self.chan["snap", f].append(a.snapshot)
            else:  # every engine process alive is subscribed
                for e in self.engines:
                    self.chan["start", e].append(a.message())

    def send_request(self) -> None:
        f = self.rng.randrange(len(self.fronts))
        self._route(f, self.rng.choice(self.front_topology[f].engine_ids))

    def _route(self, f: int, e: int) -> None:
        wave, wake = self.fronts[f].on_send(e)
        self.chan["req", f, e].append(wave)
        if wake is not None:
            self.chan["wake", f].append(wake)

    def plan(self) -> None:
        self.reconfigs_left -= 1
        ids = self.topology.engine_ids
        if len(ids) > 1 and self.rng.random() < 0.5:
            self.planned = self.topology.without([self.rng.choice(ids)])
        else:
            self.planned = self.topology.grown(1)

    def _commit(self, wave: int) -> None:
        new, self.planned = self.planned, None
        for e in [e for e in self.engines if e not in new]:
            del self.engines[e], self.work[e]
        for e in new.engine_ids:
            if e not in self.engines:
                self.engines[e] = self.engine_cls(e, wave)
                self.work[e] = 0
        self.topology = new
        self.chan["topo", "coord"].append(DPSetTopology(new))
        for f in range(len(self.fronts)):
            self.chan["topo", f].append(new)

    def deliver(self, key: tuple) -> None:
        msg = self.chan[key].popleft()
        self.now += 0.001
        kind = key[0]
        if kind == "req":
            f, e = key[1], key[2]
            if e not in self.engines:  # removed meanwhile: the frontend migrates it
                self._route(f, self.rng.choice(self.topology.engine_ids))
                return
            self.work[e] += 1
            sw = self.engines[e].on_request(msg)
            if sw is not None:
                self.chan["eng", e].append(EngineCoreOutputs(engine_id=e, start_wave=sw))
        elif kind == "start":
            if key[1] in self.engines:
                self.engines[key[1]].on_start_wave(msg)
        elif kind == "snap":
            self.fronts[key[1]].on_snapshot(msg)
        elif kind == "topo" and key[1] != "coord":
            self.fronts[key[1]].set_topology(msg)
            self.front_topology[key[1]] = msg
        else:  # "wake" / "eng" / the coordinator's "topo"
            self._apply(self.coord.handle(msg, self.now))

    def collective_ready(self) -> bool:
        return all(e.running for e in self.engines.values())

    def collective(self) -> None:
        self.served += sum(self.work.values())
        self.work = dict.fromkeys(self.engines, 0)
        done = [self.engines[e].on_wave_end() for e in self.topology.engine_ids]
        rank0 = self.topology.engine_ids[0]
        self.chan["eng", rank0].append(EngineCoreOutputs(engine_id=rank0, wave_complete=done[0]))
        if self.planned is not None:
            self._commit(done[0] + 1)

    def run(self, n_requests: int, max_steps: int = 100_000) -> None:
        left = n_requests
        for _ in range(max_steps):
            moves = [k for k, q in self.chan.items() if q]
            if left:
                moves.append("send")
            if self.collective_ready():
                moves.append("collective")
            if self.reconfigs_left and self.planned is None:
                moves.append("plan")
            if not moves:
                return
            move = self.rng.choice(moves)
            if move == "send":
                self.send_request()
                left -= 1
            elif move == "collective":
                self.collective()
            elif move == "plan":
                self.plan()
            else:
                self.deliver(move)
        raise AssertionError("model did not quiesce")

    def check_quiescent(self, n_requests: int) -> None:
        running = {e: w.running for e, w in self.engines.items()}
        assert not any(running.values()), f"ranks stranded running alone: {running}"
        assert self.served == n_requests
        waves = {e.wave for e in self.engines.values()}
        assert waves == {self.coord.wave}, (waves, self.coord.wave)
        assert not self.coord.running
        assert self.coord.topology == self.topology


@pytest.mark.parametrize("seed", range(300))
def test_protocol_never_strands_a_rank(seed):
    rng = random.Random(seed)
    n_engines, n_frontends = rng.randint(2, 4), rng.randint(1, 3)
    model = ProtocolModel(rng, n_engines, n_frontends, EngineWaveState)
    n = rng.randint(1, 12)
    model.run(n)
    model.check_quiescent(n)
    # And the deployment still works afterwards.
    model.run(3)
    model.check_quiescent(n + 3)


@pytest.mark.parametrize("seed", range(300))
def test_protocol_never_strands_a_rank_across_topology_changes(seed):
    """Races 6-10: engines removed (any position) and added while requests, wake-ups,
    starts and snapshots are in flight."""
    rng = random.Random(seed)
    model = ProtocolModel(
        rng, rng.randint(1, 4), rng.randint(1, 3), EngineWaveState, n_reconfigs=rng.randint(1, 4)
    )
    n = rng.randint(1, 16)
    model.run(n)
    model.check_quiescent(n)
    model.reconfigs_left = 0
    model.run(3)
    model.check_quiescent(n + 3)


class _EngineAcceptingStaleStarts(EngineWaveState):
    """The classic bug: an engine that honours a START_DP_WAVE that crossed a wave end."""

    def on_start_wave(self, msg: StartDPWave) -> bool:
        if msg.exclude_engine_id == self.engine_id:
            return False
        started = not self.running
        self.wave, self.running = max(self.wave, msg.wave), True
        return started


def test_model_check_catches_a_broken_engine_rule():
    failures = 0
    for seed in range(300):
        rng = random.Random(seed)
        model = ProtocolModel(
            rng, rng.randint(2, 4), rng.randint(1, 3), _EngineAcceptingStaleStarts
        )
        n = rng.randint(1, 12)
        try:
            model.run(n)
            model.check_quiescent(n)
        except AssertionError:
            failures += 1
    assert failures > 0
