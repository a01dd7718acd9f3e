"""Liveness decisions (tidal/frontend/liveness.py), pure: silence (frozen processes, lost
hosts), the step-progress watchdog (stuck busy loops), deaths found together, and the
DP coordinator's watch (restart, kill, where wake-ups go), and a headless rank's watch of
its frontend, all on an injected clock."""

from __future__ import annotations

from tidal.engine_core.proc import FrontendWatch
from tidal.frontend.liveness import (
    COORDINATOR_HEARTBEAT_S,
    COORDINATOR_RECONNECT_S,
    CoordinatorAction,
    CoordinatorWatch,
    Finding,
    Liveness,
    WakeRoute,
)
from tidal.protocol.messages import EngineProgress


def busy(iterations: int, waiting: bool = False) -> EngineProgress:
    return EngineProgress(iterations, True, waiting)


IDLE = EngineProgress(7, False, False)


def ids(verdicts) -> list[tuple[int, Finding]]:
    return [(v.engine_id, v.finding) for v in verdicts]


def test_an_engine_never_heard_from_is_not_judged():
    lv = Liveness(silence_s=3.0)
    assert lv.check(100.0, [0, 1]) == []  # a local engine still importing says nothing
    lv.heard(1, 100.0)
    assert lv.check(102.9, [0, 1]) == []
    assert ids(lv.check(103.1, [0, 1])) == [(1, Finding.SILENT)]


def test_silence_is_death_and_each_engine_is_declared_once():
    lv = Liveness(silence_s=3.0)
    lv.expect([0, 1, 2], 10.0)
    lv.heard(0, 12.0)
    lv.heard(2, 12.0)
    (v,) = lv.check(13.5, [0, 1, 2])
    assert (v.engine_id, v.finding) == (1, Finding.SILENT) and "3.5s" in v.cause
    assert lv.check(20.0, [1]) == []  # declared already
    lv.forget(1)
    assert lv.check(20.0, [1]) == []  # forgotten: not watched any more


def test_only_watched_engines_are_judged():
    lv = Liveness(silence_s=3.0)
    lv.expect([0, 1], 0.0)
    assert ids(lv.check(10.0, [0])) == [(0, Finding.SILENT)]


def test_a_stalled_round_judges_nothing():
    lv = Liveness(silence_s=3.0)
    lv.expect([0], 0.0)
    assert lv.check(10.0, [0], loop_stalled=True) == []  # frames may wait unread
    lv.heard(0, 10.1)  # read once the loop ran again
    assert lv.check(10.6, [0]) == []


def test_after_a_group_failure_silence_is_judged_sooner_for_a_while():
    lv = Liveness(silence_s=3.0, suspect_silence_s=2.0, suspect_for_s=3.0)
    lv.expect([0, 1], 0.0)
    lv.heard(0, 8.0)
    lv.heard(1, 8.0)
    lv.suspect(8.0)
    assert lv.silence_limit(8.5) == 2.0 and lv.silence_limit(11.5) == 3.0
    lv.heard(1, 10.0)
    assert ids(lv.check(10.1, [0, 1])) == [(0, Finding.SILENT)]  # 2.1 s > 2 s; 1 spoke


def test_ranks_silent_together_are_declared_together():
    """A lost host: its ranks' last frames are up to a heartbeat interval apart, so one
    crosses the limit a round before the other; its verdict waits for the other's, and
    both come in one list (one recovery)."""
    lv = Liveness(silence_s=3.0, sweep_margin_s=1.0, min_sweep_s=1.25)
    lv.expect([0, 1, 2, 3], 0.0)
    lv.heard(2, 6.9)  # host lost at ~7: rank 2 spoke last at 6.9, rank 3 at 7.4
    lv.heard(3, 7.4)
    for t in (10.0, 10.4):  # rank 2 past 3 s, rank 3 not yet: wait for it
        lv.heard(0, t)  # the survivors speak
        lv.heard(1, t)
        assert lv.check(t, [0, 1, 2, 3]) == []
    lv.heard(0, 10.5)
    lv.heard(1, 10.5)
    out = lv.check(10.5, [0, 1, 2, 3])
    assert ids(out) == [(2, Finding.SILENT), (3, Finding.SILENT)]
    assert "3.6s" in out[0].cause and "3.1s" in out[1].cause  # each past its own limit


def test_a_starved_rank_is_asked_not_swept_with_a_dead_one_after_a_group_failure():
    """A GROUP_FAILED: engine 0 is dead; engine 1 lives but was starved of CPU for 1.5 s
    (in the sweep band below the 2 s limit). Its next heartbeat answers for it: only
    engine 0 is declared."""
    lv = Liveness(
        silence_s=3.0,
        suspect_silence_s=2.0,
        suspect_for_s=3.0,
        sweep_margin_s=1.0,
        min_sweep_s=1.25,
    )
    lv.expect([0, 1, 2], 0.0)
    lv.heard(0, 8.0)  # engine 0 died just after
    lv.heard(1, 8.6)  # engine 1 starved from here
    lv.heard(2, 10.0)
    lv.suspect(9.0)
    assert lv.check(10.1, [0, 1, 2]) == []  # 0 past 2 s; 1 silent 1.5 s: wait for it
    lv.heard(1, 10.3)  # it speaks
    lv.heard(2, 10.3)
    assert ids(lv.check(10.6, [0, 1, 2])) == [(0, Finding.SILENT)]
    assert lv.check(11.0, [1, 2]) == []


def test_the_last_rank_is_judged_by_the_full_limit_after_a_group_failure():
    """--dp 2: engine 0 died (its exit is handled, so it is forgotten); engine 1 is starved
    for 2.5 s, past the shorter limit a group failure sets. Declaring it would leave
    nothing: only the full silence limit does."""
    lv = Liveness(silence_s=3.0, suspect_silence_s=2.0, suspect_for_s=3.0)
    lv.expect([0, 1], 0.0)
    lv.heard(1, 8.0)
    lv.suspect(8.2)
    lv.forget(0)
    assert lv.check(10.5, [1]) == []  # 2.5 s: past 2, not 3
    assert ids(lv.check(11.1, [1])) == [(1, Finding.SILENT)]


def test_a_dead_rank_waits_for_the_band_at_most_the_sweep_margin():
    """Engines entering the band one after the other do not hold a verdict for longer
    than ``sweep_margin_s``."""
    lv = Liveness(silence_s=3.0, sweep_margin_s=1.0, min_sweep_s=1.25)
    lv.expect([0, 1, 2], 0.0)
    lv.heard(0, 6.9)
    lv.heard(1, 7.9)  # in the band at 10.0 (2.1 s) ...
    lv.heard(2, 8.3)  # ... engine 2 at 10.4
    assert lv.check(10.0, [0, 1, 2]) == []
    lv.heard(1, 10.4)  # engine 1 speaks
    assert lv.check(10.5, [0, 1, 2]) == []  # engine 2 in the band now
    out = lv.check(11.0, [0, 1, 2])  # held for 1 s: the dead one goes alone
    assert ids(out) == [(0, Finding.SILENT)]


def test_a_live_rank_is_not_swept_with_a_dead_one():
    lv = Liveness(silence_s=3.0, sweep_margin_s=1.0, min_sweep_s=1.25)
    lv.expect([0, 1], 0.0)
    lv.heard(1, 9.5)  # spoke half a second ago
    assert ids(lv.check(10.0, [0, 1])) == [(0, Finding.SILENT)]


def test_the_watchdog_finds_a_busy_loop_stuck_in_one_iteration():
    lv = Liveness(silence_s=3.0, stall_s=10.0)
    lv.expect([0, 1], 0.0)
    for t in range(1, 30):  # heartbeats every second: 0 stuck in iteration 5, 1 idle
        lv.heard(0, float(t), busy(5))
        lv.heard(1, float(t), IDLE)
        out = lv.check(float(t), [0, 1])
        if out:
            break
    (v,) = out
    assert (v.engine_id, v.finding) == (0, Finding.STALLED) and "iteration 5" in v.cause
    assert t == 12  # first busy heartbeat at 1: stuck past 10 s at 12, not before


def test_progress_waiting_on_peers_or_other_frames_are_no_stall():
    lv = Liveness(silence_s=3.0, stall_s=10.0)
    lv.expect([0, 1, 2], 0.0)
    for t in range(1, 40):
        lv.heard(0, float(t), busy(5, waiting=True))  # waits for a stuck peer
        lv.heard(1, float(t), busy(t))  # a new iteration every second
        lv.heard(2, float(t), busy(9) if t % 5 else None)  # outputs now and then
    assert lv.check(40.0, [0, 1, 2]) == []


def test_the_watchdog_is_off_with_no_timeout():
    lv = Liveness(silence_s=3.0, stall_s=0.0)
    lv.expect([0], 0.0)
    for t in range(1, 1000, 2):
        lv.heard(0, float(t), busy(5))
    assert lv.check(1000.0, [0]) == []


def test_a_silent_engine_is_not_also_reported_stalled():
    lv = Liveness(silence_s=3.0, stall_s=5.0)
    lv.expect([0], 0.0)
    lv.heard(0, 1.0, busy(5))
    assert ids(lv.check(20.0, [0])) == [(0, Finding.SILENT)]


# ------------------------------------------------------------------ the coordinator


def test_a_quiet_coordinator_is_left_alone_a_silent_one_killed_a_dead_one_restarted_once():
    w = CoordinatorWatch(100.0, timeout_s=4.0)
    assert w.check(103.9, alive=True) is CoordinatorAction.NONE
    w.heard(103.0)
    assert w.check(106.9, alive=True) is CoordinatorAction.NONE
    assert w.check(107.1, alive=True) is CoordinatorAction.KILL  # frozen
    # Our own loop stalled: its snapshots may be waiting unread.
    assert w.check(107.1, alive=True, loop_stalled=True) is CoordinatorAction.NONE
    assert w.check(107.2, alive=False) is CoordinatorAction.RESTART
    assert w.check(107.3, alive=False) is CoordinatorAction.NONE  # one restart at a time
    w.restart_failed()
    assert w.check(107.4, alive=False) is CoordinatorAction.RESTART
    w.restarted(108.0)
    assert w.check(111.9, alive=True) is CoordinatorAction.NONE  # heard at its restart


def test_wake_ups_go_direct_while_the_coordinator_is_down_silent_or_just_restarted():
    w = CoordinatorWatch(100.0)
    assert w.wake_route(100.5, alive=True) is WakeRoute.COORDINATOR
    assert w.wake_route(100.5, alive=False) is WakeRoute.DIRECT
    silent = 100.0 + 2 * COORDINATOR_HEARTBEAT_S + 0.1
    assert w.wake_route(silent, alive=True) is WakeRoute.COORDINATOR_AND_DIRECT
    w.check(silent, alive=False)
    w.restarted(200.0)
    # Its sockets reconnect in the background: the frontend plays its part meanwhile.
    assert w.wake_route(200.1, alive=True) is WakeRoute.COORDINATOR_AND_DIRECT
    w.heard(200.0 + COORDINATOR_RECONNECT_S)
    assert w.wake_route(200.0 + COORDINATOR_RECONNECT_S + 0.1, alive=True) is WakeRoute.COORDINATOR


def test_a_headless_rank_counts_its_frontend_dead_after_its_timeout_from_the_first_heartbeat():
    w = FrontendWatch(timeout_s=4.0)
    w.heard(False, 1.0)  # a request before any heartbeat: this frontend is not watched yet
    assert not w.silent(100.0)
    w.heard(True, 100.0)
    w.heard(False, 103.0)  # from then on any message proves it alive
    assert not w.silent(107.0) and w.silent(107.1)
    local = FrontendWatch(4.0, enabled=False)  # a local frontend: its launcher is watched
    local.heard(True, 100.0)
    assert not local.silent(1e9)
