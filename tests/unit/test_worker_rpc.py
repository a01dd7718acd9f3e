"""Worker calls by name (tidal/executor/rpc.py): resolution against the exports only, on
the engine (``Executor.call``) and in a worker process (``WorkerProc``), and each
``Reduce`` over a rank's results."""

from __future__ import annotations

import types
from typing import Any

import msgspec
import pytest

from tidal.executor import worker_proc
from tidal.executor.base import Executor
from tidal.executor.rpc import Reduce, Rpc, RpcNameError, RpcSpec, RpcTable, rpc
from tidal.executor.worker import WORKER_RPCS, Worker
from tidal.protocol.worker import ReplyMode, WorkerCall, WorkerErrorKind, WorkerReply


class Counter:
    def __init__(self) -> None:
        self.n = 0

    @rpc(Reduce.SUM)
    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def reset(self) -> None:  # public, not exported
        self.n = 0

    def _peek(self) -> int:
        return self.n


class Louder(Counter):  # exports are inherited
    @rpc(Reduce.FIRST, reply=ReplyMode.DRIVER)
    def shout(self, word: str) -> str:
        return word.upper()


TABLE = RpcTable({"counter": Louder})


def test_an_exported_name_resolves_to_its_spec_and_types_and_runs():
    r = TABLE.resolve("counter.add")
    assert (r.namespace, r.name, r.spec.reduce, r.params, r.result) == (
        "counter", "add", Reduce.SUM, (int,), int,
    )  # fmt: skip
    assert TABLE.resolve("counter.shout").spec.reply is ReplyMode.DRIVER
    target = Louder()
    r, fn = TABLE.bind({"counter": target}, "counter.add")
    assert fn(2) == 2 and fn(3) == 5 and target.n == 5
    assert TABLE.bind({"counter": target}, "counter.shout")[1]("hi") == "HI"


@pytest.mark.parametrize(
    ("method", "named"),
    [
        ("gauge.add", "no namespace 'gauge'"),
        ("counter.reset", "Louder exports no 'reset'"),
        ("counter.nothing", "Louder exports no 'nothing'"),
        ("counter._peek", "'_peek' is private"),
        ("counter.__init__", "'__init__' is private"),
        ("add", "expected '<namespace>.<method>'"),
    ],
)
def test_anything_else_is_refused_naming_it(method, named):
    with pytest.raises(RpcNameError, match="worker call") as e:
        TABLE.resolve(method)
    assert repr(method) in str(e.value) and named in str(e.value)


def test_the_workers_table_refuses_what_it_does_not_export():
    assert WORKER_RPCS.resolve("elastic.join_standby").spec.reduce is Reduce.NONE
    assert WORKER_RPCS.resolve("elastic.transfer_experts").spec.reduce is Reduce.SUM
    for method, named in [
        ("worker.load_model", "Worker exports no 'load_model'"),  # public, not a call
        ("worker._rebuild_tensor_parallel", "is private"),
        ("elastic.init_joiner", "ElasticWorkerState exports no 'init_joiner'"),
        ("runner.load_model", "ModelRunner exports no 'load_model'"),
        ("kv.initialize", "no namespace 'kv'"),
    ]:
        with pytest.raises(RpcNameError, match=named):
            WORKER_RPCS.resolve(method)


def test_private_methods_and_inconsistent_specs_cannot_be_declared():
    with pytest.raises(ValueError, match="private"):
        rpc()(Counter._peek)
    with pytest.raises(ValueError, match="only the driver answers"):
        RpcSpec(Reduce.SUM, reply=ReplyMode.DRIVER)
    with pytest.raises(ValueError, match="ReplyMode.DRIVER"):
        RpcSpec(Reduce.FIRST, driver_only=True)
    with pytest.raises(ValueError, match="no result over no workers"):
        RpcSpec(Reduce.FIRST, empty_after_shutdown=True)


def test_reductions():
    assert Reduce.NONE.apply([1, 2]) is None
    assert Reduce.FIRST.apply(["driver", "peer"]) == "driver"
    assert Reduce.MIN.apply([40, 32, 36]) == 32
    assert Reduce.SUM.apply([10, 20, 0]) == 30
    assert Reduce.ANY.apply([False, True]) is True
    assert Reduce.ANY.apply([False, False]) is False
    assert Reduce.ANY.apply([]) is False  # a shut-down rank waits on nobody
    assert Reduce.SUM_COUNTS.apply([{3: [1, 0, 2]}, {3: [0, 4, 1], 5: [7]}]) == {
        3: [1, 4, 3],
        5: [7],
    }
    assert Reduce.EACH.apply([1, 2]) == [1, 2]


class _Canned(Executor):
    """Each call answers with the per-worker results given for its name."""

    def __init__(self, results: dict[str, list[Any]]) -> None:
        self.results = results
        self.ran: list[tuple[str, tuple]] = []

    def _run(self, rpc: Rpc, args: tuple[Any, ...]) -> list[Any]:
        self.ran.append((rpc.method, args))
        return self.results[rpc.method]

    def worker_pids(self) -> list[int]:
        return []

    def register_failure_callback(self, callback: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_call_combines_the_workers_results_as_the_method_declares():
    ex = _Canned(
        {
            "runner.determine_num_blocks": [40, 32],
            "elastic.transfer_experts": [1024, 2048],
            "worker.waiting_on_peers": [False, True],
            "runner.get_expert_load": [{0: [1, 2]}, {0: [3, 4]}],
            "elastic.standby_barrier": [(3, 9), (3, 9)],
            "elastic.swap_groups": [None, None],
            "worker.get_cpu_kernels": [{"r": 0}, {"r": 1}],
        }
    )
    assert ex.call("runner.determine_num_blocks") == 32
    assert ex.call("elastic.transfer_experts", 1, [], [], 0, 5.0) == 3072
    assert ex.call("worker.waiting_on_peers") is True
    assert ex.call("runner.get_expert_load") == {0: [4, 6]}
    assert ex.call("elastic.standby_barrier", 1, 3, 9) == (3, 9)
    assert ex.call("elastic.swap_groups", 1) is None
    assert ex.call("worker.get_cpu_kernels") == {"r": 0}
    assert ex.call("worker.get_cpu_kernels", reduce=Reduce.EACH) == [{"r": 0}, {"r": 1}]
    assert ex.ran[1] == ("elastic.transfer_experts", (1, [], [], 0, 5.0))


def test_call_refuses_an_unknown_name_before_anything_runs():
    ex = _Canned({})
    with pytest.raises(RpcNameError, match="'elastic.swap'"):
        ex.call("elastic.swap", 1)
    assert ex.ran == []


class _NoModelWorker:
    """What ``Worker.serve`` reads of a worker, before its model is loaded."""

    model_runner = types.SimpleNamespace(has_model=False)
    serve = Worker.serve


def test_a_worker_process_refuses_an_unexported_name_naming_it(monkeypatch):
    """The worker checks again (an engine of another version): an error reply naming the
    call, and the worker goes on serving."""
    proc = worker_proc.WorkerProc.__new__(worker_proc.WorkerProc)  # only what serving a call reads
    proc.tp_rank, proc.engine_id = 0, 0
    target = Louder()
    proc.targets = {"counter": target}
    proc.worker = _NoModelWorker()
    replies: list[WorkerReply] = []
    proc._reply = replies.append

    monkeypatch.setattr(worker_proc, "WORKER_RPCS", TABLE)
    for call_id, method in enumerate(["counter.reset", "counter._peek", "gauge.add"]):
        proc._serve(WorkerCall(call_id, method, msgspec.Raw(msgspec.msgpack.encode([]))))
    proc._serve(WorkerCall(9, "counter.add", msgspec.Raw(msgspec.msgpack.encode([4]))))
    errors = replies[:3]
    assert all(r.error_kind is WorkerErrorKind.ERROR for r in errors)
    assert "RpcNameError" in errors[0].error and "'counter.reset'" in errors[0].error
    assert "'_peek' is private" in errors[1].error
    assert "no namespace 'gauge'" in errors[2].error
    assert target.n == 4 and msgspec.msgpack.decode(replies[3].result) == 4


def test_serve_reports_every_call_but_a_step_as_a_change():
    """``Worker.serve`` (every executor's way into a worker) runs each call but a step
    inside the model's decode plans' ``changing``, the report ``Verify.ON_CHANGE`` counts
    on: while it runs a change is under way, and one more is counted after it."""
    from tidal.models.cpu_decode import DecodePlans

    plans = DecodePlans()
    model = types.SimpleNamespace(decode_plans=plans)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(has_model=True, model=model))
    seen: list[tuple[int, int]] = []

    def probe(*args: Any) -> int:
        seen.append((plans._in_flight, plans._changes))
        return len(args)

    for method in ("runner.execute_model", "worker.get_cpu_kernels", "elastic.swap_groups"):
        assert Worker.serve(worker, WORKER_RPCS.resolve(method), probe, (1, 2)) == 2  # type: ignore[arg-type]
    assert seen == [(0, 0), (1, 1), (1, 3)]
    assert plans._in_flight == 0 and plans._changes == 4
