"""CoordinatorState: publishing rules, the wave protocol and its races, resize.

The last part model-checks the three roles of the wave protocol together (coordinator,
engines, frontends) under random message interleavings and asserts no rank is ever left
running alone once all messages are delivered.
"""

from __future__ import annotations

import collections
import random

import pytest

from tidal.dp_coordinator.state import (
    BroadcastStartWave,
    CoordinatorState,
    EngineWaveState,
    FrontendWaveState,
    PublishSnapshot,
)
from tidal.engine_core.messages import (
    DPResize,
    DPWakeUp,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
)


def stats(engine: int, waiting: int, running: int, kv: float = 0.0, total: int = 0):
    s = SchedulerStats(
        num_waiting_reqs=waiting, num_running_reqs=running, kv_cache_usage=kv,
        num_requests_total=total,
    )  # fmt: skip
    return EngineCoreOutputs(engine_index=engine, scheduler_stats=s)


def publishes(actions) -> list:
    return [a.snapshot for a in actions if isinstance(a, PublishSnapshot)]


def starts(actions) -> list[tuple[int, int | None]]:
    return [(a.wave, a.exclude_engine) for a in actions if isinstance(a, BroadcastStartWave)]


def settled(n: int = 2, **kw) -> CoordinatorState:
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


def test_new_subscriber_gets_immediate_publish():
    st = settled()
    st.handle(stats(0, 1, 1), 1.0)
    st.request_publish()
    assert publishes(st.tick(1.01)) != []


# ----------------------------------------------------------------- wave protocol


def test_wake_up_starts_wave_excluding_the_requested_rank():
    st = settled(3)
    acts = st.handle(DPWakeUp(wave=0, engine_index=2), 1.0)
    assert starts(acts) == [(0, 2)]
    (snap,) = publishes(acts)  # wave state goes out at once, not rate-limited
    assert snap.running and snap.wave == 0


def test_duplicate_wake_ups_broadcast_once():
    st = settled(3)
    assert starts(st.handle(DPWakeUp(0, 1), 1.0)) == [(0, 1)]
    assert starts(st.handle(DPWakeUp(0, 2), 1.001)) == []
    assert starts(st.handle(EngineCoreOutputs(engine_index=1, start_wave=0), 1.002)) == []
    assert st.start_wave_broadcasts == 1


def test_wave_complete_pauses_and_advances():
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    (snap,) = publishes(st.handle(EngineCoreOutputs(engine_index=0, wave_complete=0), 1.01))
    assert (snap.wave, snap.running) == (1, False)
    assert st.waves_completed == 1
    # The next wake-up, for the new wave, starts it.
    assert starts(st.handle(DPWakeUp(1, 1), 1.02)) == [(1, 1)]


def test_stale_wake_up_starts_the_current_wave_for_everyone():
    """Race 1: a frontend saw (0, paused) but wave 0 ran and completed meanwhile."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    st.handle(EngineCoreOutputs(engine_index=0, wave_complete=0), 1.1)
    assert starts(st.handle(DPWakeUp(0, 1), 1.2)) == [(1, None)]
    # The stale-request rank's own start_wave for wave 1 is then a duplicate.
    assert starts(st.handle(EngineCoreOutputs(engine_index=1, start_wave=1), 1.21)) == []


def test_start_wave_from_engine():
    st = settled(3)
    acts = st.handle(EngineCoreOutputs(engine_index=2, start_wave=0), 1.0)
    assert starts(acts) == [(0, 2)] and st.running


def test_stale_start_wave_ignored():
    """Race 1: start_wave for a wave the coordinator has seen complete."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    st.handle(EngineCoreOutputs(engine_index=0, wave_complete=0), 1.1)
    assert starts(st.handle(EngineCoreOutputs(engine_index=1, start_wave=0), 1.2)) == []
    assert (st.wave, st.running) == (1, False)


@pytest.mark.parametrize("complete_first", [True, False])
def test_wave_complete_and_next_start_in_either_order(complete_first):
    """Race 3: rank 0's wave_complete=0 and rank 1's start_wave=1 cross."""
    st = settled(2)
    st.handle(DPWakeUp(0, 0), 1.0)
    complete = EngineCoreOutputs(engine_index=0, wave_complete=0)
    start = EngineCoreOutputs(engine_index=1, start_wave=1)
    first, second = (complete, start) if complete_first else (start, complete)
    acts = st.handle(first, 1.1) + st.handle(second, 1.2)
    assert starts(acts) == [(1, 1)]
    # Either way: wave 1 running; the late wave_complete must not clear the flag.
    assert (st.wave, st.running) == (1, True)


def test_stale_wave_complete_does_not_clear_running():
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_index=1, start_wave=4), 1.0)
    assert (st.wave, st.running) == (4, True)
    st.handle(EngineCoreOutputs(engine_index=0, wave_complete=2), 1.1)
    assert (st.wave, st.running) == (4, True)


def test_messages_from_removed_ranks_ignored():
    st = settled(2)
    assert st.handle(EngineCoreOutputs(engine_index=5, start_wave=0), 1.0) == []
    assert not st.running and st.ignored_messages == 1


def test_engine_dead_is_recorded_and_published():
    st = settled(2)
    acts = st.handle(EngineCoreOutputs(engine_index=1, engine_dead=True, dead_reason="x"), 0.01)
    assert publishes(acts) and st.full_stats(0.01).ranks[1].dead


# ------------------------------------------------------------------------ resize


def test_resize_up_and_down():
    st = settled(2)
    st.handle(stats(0, 1, 1), 1.0)
    st.handle(stats(1, 2, 2), 1.2)
    st.handle(DPWakeUp(0, 0), 1.3)
    assert st.running
    (snap,) = publishes(st.handle(DPResize(num_engines=4), 1.31))  # immediate
    assert snap.counts == [[1, 1], [2, 2], [0, 0], [0, 0]]
    assert not snap.running  # "paused" is the safe belief while ranks change
    assert len(st.full_stats(1.31).ranks) == 4
    st.resize(1)
    (snap,) = publishes(st.tick(1.32))
    assert snap.counts == [[1, 1]] and st.ready_message().num_engines == 1
    assert st.handle(stats(2, 5, 5), 1.5) == [] and st.ignored_messages == 1
    with pytest.raises(ValueError):
        st.resize(0)


def test_ready_message_carries_wave():
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_index=0, wave_complete=3), 1.0)
    ready = st.ready_message()
    assert (ready.num_engines, ready.wave, ready.running) == (2, 4, False)


# ------------------------------------------------------------- the other roles


def test_frontend_sends_one_wake_up_per_paused_wave():
    fe = FrontendWaveState()
    assert fe.on_send(1) == (0, DPWakeUp(0, 1))
    assert fe.on_send(0) == (0, None)
    st = settled(2)
    st.handle(EngineCoreOutputs(engine_index=0, wave_complete=0), 1.0)
    fe.on_snapshot(st.snapshot(1.0))
    assert fe.on_send(0) == (1, DPWakeUp(1, 0))


def test_engine_rules():
    e = EngineWaveState(engine_index=1, wave=3)
    assert e.on_request(3) is None and e.running  # current wave: the frontend woke others
    e.on_wave_end()
    assert (e.wave, e.running) == (4, False)
    assert e.on_request(3) == 4  # stale request while paused: must tell the coordinator
    assert e.on_request(2) is None  # already running
    e.on_wave_end()
    assert not e.on_start_wave(StartDPWave(5, exclude_engine_index=1))  # excluded
    assert not e.on_start_wave(StartDPWave(4))  # crossed a wave end (race 2)
    assert not e.running
    assert e.on_start_wave(StartDPWave(5)) and (e.wave, e.running) == (5, True)
    f = EngineWaveState(engine_index=0, wave=0)
    assert f.on_request(7) is None and f.wave == 7  # a newer wave is adopted


# --------------------------------------------------------- protocol model check


class ProtocolModel:
    """Coordinator + engines + frontends exchanging messages over FIFO channels that a
    seeded scheduler delivers in random order. ``collective()`` is one all-reduce: it
    needs every rank running, serves all work and ends the wave."""

    def __init__(self, rng: random.Random, n_engines: int, n_frontends: int, engine_cls):
        self.rng = rng
        self.coord = CoordinatorState(n_engines, publish_interval_s=0.0)
        self.engines = [engine_cls(i) for i in range(n_engines)]
        self.work = [0] * n_engines
        self.fronts = [FrontendWaveState() for _ in range(n_frontends)]
        self.chan: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.now = 0.0
        self.served = 0
        self._apply(self.coord.tick(0.0))

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, PublishSnapshot):
                for f in range(len(self.fronts)):
                    self.chan["snap", f].append(a.snapshot)
            else:
                for e in range(len(self.engines)):
                    self.chan["start", e].append(a.message())

    def send_request(self) -> None:
        f = self.rng.randrange(len(self.fronts))
        e = self.rng.randrange(len(self.engines))
        wave, wake = self.fronts[f].on_send(e)
        self.chan["req", f, e].append(wave)
        if wake is not None:
            self.chan["wake", f].append(wake)

    def deliver(self, key: tuple) -> None:
        msg = self.chan[key].popleft()
        self.now += 0.001
        kind = key[0]
        if kind == "req":
            e = key[2]
            self.work[e] += 1
            sw = self.engines[e].on_request(msg)
            if sw is not None:
                self.chan["eng", e].append(EngineCoreOutputs(engine_index=e, start_wave=sw))
        elif kind == "start":
            self.engines[key[1]].on_start_wave(msg)
        elif kind == "snap":
            self.fronts[key[1]].on_snapshot(msg)
        else:  # "wake" / "eng": to the coordinator
            self._apply(self.coord.handle(msg, self.now))

    def collective_ready(self) -> bool:
        return all(e.running for e in self.engines)

    def collective(self) -> None:
        self.served += sum(self.work)
        self.work = [0] * len(self.engines)
        done = [e.on_wave_end() for e in self.engines]
        self.chan["eng", 0].append(EngineCoreOutputs(engine_index=0, wave_complete=done[0]))

    def run(self, n_requests: int, max_steps: int = 100_000) -> None:
        left = n_requests
        for _ in range(max_steps):
            moves = [k for k, q in self.chan.items() if q]
            if left:
                moves.append("send")
            if self.collective_ready():
                moves.append("collective")
            if not moves:
                return
            move = self.rng.choice(moves)
            if move == "send":
                self.send_request()
                left -= 1
            elif move == "collective":
                self.collective()
            else:
                self.deliver(move)
        raise AssertionError("model did not quiesce")

    def check_quiescent(self, n_requests: int) -> None:
        running = [e.running for e in self.engines]
        assert not any(running), f"ranks stranded running alone: {running}"
        assert self.served == n_requests
        waves = {e.wave for e in self.engines}
        assert waves == {self.coord.wave}, (waves, self.coord.wave)
        assert not self.coord.running


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


class _EngineAcceptingStaleStarts(EngineWaveState):
    """The classic bug: an engine that honours a START_DP_WAVE that crossed a wave end."""

    def on_start_wave(self, msg: StartDPWave) -> bool:
        if msg.exclude_engine_index == self.engine_index:
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
