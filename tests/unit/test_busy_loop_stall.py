"""A busy loop whose requests can none of them run (each waits for its grammar to compile
on a thread) waits on its input queue between steps instead of spinning: a spinning loop
holds the GIL against the compile thread. An idle loop blocks longer; a loop that ran
something does not block at all."""

from __future__ import annotations

import queue

from tidal.engine_core import proc as proc_mod
from tidal.engine_core.proc import EngineCoreProc, LoopProgress, ShutdownState


class _RecordingQueue(queue.Queue):
    def __init__(self) -> None:
        super().__init__()
        self.blocking_gets: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None):  # type: ignore[override]
        if block:
            self.blocking_gets.append(timeout)
        return super().get(block, timeout)


class _Core:
    """An engine core with one request that cannot be scheduled (or none)."""

    def __init__(self, has_work: bool, runs: bool) -> None:
        self.has_work, self.runs = has_work, runs

    def has_unfinished_requests(self) -> bool:
        return self.has_work

    def step(self):
        return {}, self.runs


def _proc(core: _Core) -> EngineCoreProc:
    p = object.__new__(EngineCoreProc)  # the loop's own state only: no sockets, no threads
    p.engine_core = core  # type: ignore[assignment]
    p.progress = LoopProgress()
    p.shutdown_state = ShutdownState.RUNNING
    p.input_queue = _RecordingQueue()  # type: ignore[assignment]
    p._stalled = False
    p._check_io_threads = lambda: None  # type: ignore[method-assign]
    return p


def _iterations(p: EngineCoreProc, n: int) -> list[float | None]:
    for _ in range(n):
        p._process_input_queue()
        p._process_engine_step()
    return p.input_queue.blocking_gets  # type: ignore[attr-defined]


def test_a_stalled_loop_waits_briefly_on_its_queue():
    gets = _iterations(_proc(_Core(has_work=True, runs=False)), 5)
    # The first iteration has not stepped yet; every later one follows a step that ran nothing.
    assert gets == [proc_mod._STALLED_POLL_S] * 4


def test_a_loop_that_runs_steps_never_blocks():
    assert _iterations(_proc(_Core(has_work=True, runs=True)), 5) == []


def test_an_idle_loop_blocks_for_the_idle_poll():
    gets = _iterations(_proc(_Core(has_work=False, runs=False)), 3)
    assert gets == [proc_mod._IDLE_POLL_S] * 3
