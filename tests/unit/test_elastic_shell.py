"""The engine's elastic shell (tidal/engine_core/elastic_shell.py) against a recording
executor and busy loop: every role's path carries out the state's actions in order, with
the helper's results coming back through the input queue, and cancelled jobs leave no
standby groups behind."""

from __future__ import annotations

import queue
import threading

import pytest

from tests.waiting import wait_until
from tidal.engine_core.elastic_shell import ElasticShell
from tidal.executor.worker import WORKER_RPCS
from tidal.protocol.elastic import (
    ExpertTransferSpec,
    ScaleAbort,
    ScaleCommit,
    ScaleEvent,
    ScalePrepare,
    ScaleReport,
)
from tidal.protocol.topology import Topology


class FakeExecutor:
    """Records each call; a name the workers do not export fails the test."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: dict[str, Exception] = {}
        self.gate: dict[str, threading.Event] = {}
        self.barrier_result = (7, 64)

    def call(self, method: str, *args: object) -> object:
        WORKER_RPCS.resolve(method)
        self.calls.append((method, *args))
        gate = self.gate.get(method)
        if gate is not None:
            gate.wait(10)
        if method in self.fail:
            raise self.fail[method]
        if method == "elastic.transfer_experts":
            return 0
        if method == "elastic.standby_barrier":
            return self.barrier_result
        return None

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeLoop:
    """The busy loop's side (``EngineHooks``)."""

    def __init__(self, requests: list[str] | None = None) -> None:
        self.requests = list(requests or [])
        self.inputs: queue.Queue = queue.Queue()
        self.reports: list[ScaleReport] = []
        self.removed: list[str] = []
        self.wave_started = 0
        self.topology: Topology | None = None
        self.adopted_wave: int | None = None
        self.left = False
        self.wave = 3

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def remove_requests(self, ids: list[str]) -> None:
        self.removed += ids
        self.requests = [r for r in self.requests if r not in ids]

    def ensure_wave_running(self) -> None:
        self.wave_started += 1

    def current_wave(self) -> int:
        return self.wave

    def take_rank(self, topology: Topology, wave: int | None) -> None:
        self.topology, self.adopted_wave = topology, wave

    def send_report(self, report: ScaleReport) -> None:
        self.reports.append(report)

    def post_input(self, item: object) -> None:
        self.inputs.put(item)

    def leave(self) -> None:
        self.left = True

    def events(self) -> list[ScaleEvent]:
        return [r.event for r in self.reports]


def pump(shell: ElasticShell, loop: FakeLoop, until, timeout: float = 10.0) -> None:
    """Run step 1 + step 2 of the busy loop until ``until()``."""

    def step() -> bool:
        while True:
            try:
                shell.deliver(loop.inputs.get_nowait())
            except queue.Empty:
                break
        shell.progress()
        return until()

    assert wait_until(step, timeout), "the shell did not get there"


OLD = Topology(0, [0, 1], placement=[[0, 1], [2, 3]], store_address="127.0.0.1:1")


def prepare_up(**kw) -> ScalePrepare:
    new = Topology(
        1, [0, 1, 2], placement=[[0, 1], [2, 3], [0, 2]], store_address="127.0.0.1:2"
    )
    return ScalePrepare(
        operation_id="op",
        sequence=1,
        topology=new,
        leaving=[],
        joining=[2],
        transfers=[
            ExpertTransferSpec(0, 2, 0, 0, 0, 10),
            ExpertTransferSpec(2, 2, 1, 1, 0, 10),
        ],
        threads_per_rank=1,
        **kw,
    )


def prepare_down() -> ScalePrepare:
    new = Topology(1, [0], placement=[[0, 1, 2, 3]], store_address="127.0.0.1:2")
    return ScalePrepare(
        operation_id="op",
        sequence=1,
        topology=new,
        leaving=[1],
        joining=[],
        transfers=[ExpertTransferSpec(2, 0, 2, 1, 0, 10), ExpertTransferSpec(3, 0, 3, 1, 1, 10)],
    )


def make(engine_id: int, epoch: int | None, loop: FakeLoop, ex: FakeExecutor) -> ElasticShell:
    return ElasticShell(engine_id, epoch, ex, loop, expert_parallel=True)


def test_survivor_commits_at_the_consensus_step_and_runs_the_commit_in_order():
    ex, loop = FakeExecutor(), FakeLoop()
    shell = make(0, 0, loop, ex)
    shell.deliver(prepare_up())
    pump(shell, loop, lambda: ScaleEvent.PREPARED in loop.events())
    assert ex.names()[:3] == [
        "elastic.join_standby",
        "elastic.pack_expert_sends",
        "elastic.transfer_experts",
    ]
    join = ex.calls[0]
    assert join[1:] == (1, "127.0.0.1:2", [0, 1, 2], [0, 1, 2], 0, 60.0)
    assert loop.wave_started == 1  # the consensus needs the wave running
    assert shell.holds_wave and shell.consensus_value == 0  # no COMMIT yet
    shell.deliver(ScaleCommit("op", 1))
    shell.progress()
    assert shell.consensus_value == 1
    shell.on_consensus(32, 0, 1)  # someone not ready: nothing happens
    assert ScaleEvent.COMMITTED not in loop.events()
    n = len(ex.calls)
    shell.on_consensus(64, 1, 1)
    assert loop.events()[-1] is ScaleEvent.COMMITTED and loop.reports[-1].step == 64
    assert ex.names()[n:] == [
        "elastic.swap_groups",
        "elastic.install_experts",
        "worker.set_num_threads",
        "elastic.destroy_retired_groups",
        "elastic.standby_barrier",
    ]
    assert ex.calls[n + 1] == ("elastic.install_experts", 1, [[0, 1], [2, 3], [0, 2]], 0)
    assert ex.calls[-1] == ("elastic.standby_barrier", 1, loop.wave, 64)
    assert loop.topology is not None and loop.topology.epoch == 1 and loop.adopted_wave is None
    assert shell.serving and not shell.active


def test_joiner_commits_on_the_barrier_and_adopts_the_wave():
    ex, loop = FakeExecutor(), FakeLoop()
    shell = make(2, None, loop, ex)
    assert not shell.serving
    shell.deliver(prepare_up())
    pump(shell, loop, lambda: ScaleEvent.COMMITTED in loop.events())
    assert loop.events() == [ScaleEvent.PREPARED, ScaleEvent.COMMITTED]
    assert "elastic.standby_barrier" in ex.names()
    assert "elastic.destroy_retired_groups" not in ex.names()
    assert loop.adopted_wave == 7 and loop.reports[-1].step == 64
    assert shell.serving


def test_leaving_engine_hands_back_its_requests_then_leaves_at_the_commit():
    ex, loop = FakeExecutor(), FakeLoop(["a", "b"])
    shell = make(1, 0, loop, ex)
    shell.deliver(prepare_down())
    assert shell.accepts_new_requests
    pump(shell, loop, lambda: ScaleEvent.PREPARED in loop.events())
    assert not shell.accepts_new_requests
    assert loop.removed == ["a", "b"]
    handed = [r for r in loop.reports if r.event is ScaleEvent.HANDED_BACK]
    assert handed and handed[0].request_ids == ["a", "b"]
    shell.bounce("late")  # an ADD that arrived anyway
    shell.deliver(ScaleCommit("op", 1))
    shell.progress()
    assert loop.reports[-1].request_ids == ["late"]
    shell.on_consensus(32, 1, 1)
    assert loop.events()[-2:] == [ScaleEvent.COMMITTED, ScaleEvent.LEFT]
    assert loop.left and "elastic.leave_groups" in ex.names()
    assert "elastic.swap_groups" not in ex.names()


def test_failed_rendezvous_rolls_back_and_reports_the_cause():
    ex, loop = FakeExecutor(), FakeLoop()
    ex.fail["elastic.join_standby"] = RuntimeError("peer 2 never came")
    shell = make(0, 0, loop, ex)
    shell.deliver(prepare_up())
    pump(shell, loop, lambda: ScaleEvent.FAILED in loop.events())
    assert "peer 2 never came" in (loop.reports[-1].cause or "")
    assert {"elastic.destroy_standby", "elastic.discard_staged"} <= set(ex.names())
    assert "elastic.swap_groups" not in ex.names() and shell.serving and not shell.active


def test_abort_while_a_job_runs_destroys_its_groups_again_once_it_ends():
    ex, loop = FakeExecutor(), FakeLoop()
    gate = ex.gate["elastic.join_standby"] = threading.Event()
    shell = make(0, 0, loop, ex)
    shell.deliver(prepare_up())
    shell.progress()
    assert wait_until(lambda: "elastic.join_standby" in ex.names(), 10)
    shell.deliver(ScaleAbort("op", 1, "a joiner died"))
    shell.progress()
    assert loop.events() == [ScaleEvent.ROLLED_BACK]
    destroyed = ex.names().count("elastic.destroy_standby")
    gate.set()  # the rendezvous completes after the rollback (it built groups)
    pump(shell, loop, lambda: ex.names().count("elastic.destroy_standby") > destroyed)
    assert shell.num_threads == 0


def test_a_fatal_commit_raises():
    ex, loop = FakeExecutor(), FakeLoop()
    shell = make(0, 0, loop, ex)
    shell.deliver(prepare_up(commit_timeout_s=0.01))
    pump(shell, loop, lambda: ScaleEvent.PREPARED in loop.events())
    shell.deliver(ScaleCommit("op", 1))
    shell.progress()
    ex.fail["elastic.swap_groups"] = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        shell.on_consensus(32, 1, 1)
