"""Async scheduling (docs/architecture.md#async-scheduling) against a fake executor whose
sampled tokens reach the host one step late.

``FakeModel`` stands in for the runner: it keeps, per request, the tokens whose KV it
computed (position by position), feeds a placeholder from its own previous step's
sampled ids (as the real runner does on the device), and samples a token that is a
pure function of the context (and, seeded, of the seed and output position). Its
async output holds the tokens back until ``resolve``. So a request runs the same
tokens through both engines exactly when the engine core and scheduler keep the
placeholders, stops, aborts and preemptions right.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tidal.engine_core.core import EngineCore
from tidal.engine_core.dp_proc import DP_ALLREDUCE_INTERVAL
from tidal.engine_core.request import RequestStatus
from tidal.executor.base import Executor
from tidal.executor.batch import ModelRunnerOutput, PendingRunnerOutput, SchedulerOutput
from tidal.executor.model_runner import fill_placeholders_device, fill_placeholders_host
from tidal.executor.rpc import Rpc
from tidal.launch.engine_args import EngineArgs
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from tidal.sampling_params import SamplingParams

EOS = 2
BLOCK = 4


def next_token(context: list[int], num_prompt: int, seed: int | None) -> int:
    """The fake model's choice: greedy = f(context); seeded = f(seed, output position,
    context). Token EOS comes up now and then (a stop)."""
    key = repr((context, seed, len(context) - num_prompt if seed is not None else None))
    return 1 + zlib.crc32(key.encode()) % 30  # 1..30, EOS (2) included


class _Late(PendingRunnerOutput):
    """The tokens stay in the fake device until resolve."""

    def __init__(self, model: FakeModel, out: ModelRunnerOutput, tokens: dict[str, int]):
        self.model, self.out, self.tokens = model, out, tokens
        self.launch = model.forwards
        self.resolved = False

    def resolve(self) -> ModelRunnerOutput:
        assert not self.resolved
        self.resolved = True
        self.model.resolved_late += self.model.forwards > self.launch  # the next one launched
        for rid, tok in self.tokens.items():
            self.out.sampled_token_ids[rid] = [tok]
        return self.out


class FakeModel:
    def __init__(self) -> None:
        self.kv: dict[str, list[int]] = {}  # request id -> tokens with KV, by position
        self.last_sampled: dict[str, int] = {}  # the previous launch's tokens ("device")
        self.forwards = 0
        self.dummies = 0
        self.placeholders = 0  # placeholder rows fed
        self.resolved_late = 0
        self.fed: dict[str, int] = {}  # request id -> rows it was in (its forwards)

    def execute(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, int]]:
        out = ModelRunnerOutput()
        tokens: dict[str, int] = {}
        if so.is_empty:
            return out, tokens
        self.forwards += 1
        for sr in so.scheduled:
            req = sr.request
            rid = req.request_id
            kv = self.kv.setdefault(rid, [])
            del kv[sr.start :]  # recompute after a preemption starts over
            assert len(kv) == sr.start, (rid, len(kv), sr.start)
            if sr.placeholder:
                assert sr.num_new_tokens == 1 and sr.start == req.num_tokens
                kv.append(self.last_sampled[rid])
                self.placeholders += 1
            else:
                kv.extend(req.all_token_ids[sr.start : sr.start + sr.num_new_tokens])
            # What the KV holds is what the request's tokens are (or become: a placeholder).
            assert kv[: req.num_tokens] == req.all_token_ids[: len(kv)]
            self.fed[rid] = self.fed.get(rid, 0) + 1
            if sr.samples:
                tokens[rid] = next_token(kv, req.num_prompt_tokens, req.sampling_params.seed)
        self.last_sampled = tokens
        return out, tokens


class FakeExecutor(Executor):
    def __init__(self, config: Any, num_blocks: int, model: FakeModel) -> None:
        super().__init__(config)
        self.num_blocks, self.model = num_blocks, model
        self.on_forward: Callable[[], None] = lambda: None  # a collective, for EP

    def _run(self, rpc: Rpc, args: tuple[Any, ...]) -> list[Any]:
        name = f"{rpc.namespace}.{rpc.name}"
        if name == "runner.determine_num_blocks":
            return [self.num_blocks]
        if name == "runner.kv_cache_bytes":
            return [0]
        if name == "runner.kv_cache_info":
            return [{"sliding_window": None}]  # full attention: no block freed early
        if name == "worker.initialize_kv_cache":
            return [None]
        if name == "runner.execute_dummy_batch":
            self.model.forwards += 1
            self.model.dummies += 1
            self.on_forward()
            return [None]
        if name in ("runner.execute_model", "runner.execute_model_async"):
            (so,) = args
            out, tokens = self.model.execute(so)
            if not so.is_empty:
                self.on_forward()
            if name == "runner.execute_model":
                out.sampled_token_ids = {rid: [t] for rid, t in tokens.items()}
                return [out]
            return [_Late(self.model, out, tokens)]
        raise AssertionError(f"unexpected call {name}")

    def worker_pids(self) -> list[int]:
        return []

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def make_core(qwen3_ckpt) -> Callable[..., tuple[EngineCore, FakeModel]]:
    def make(async_scheduling: bool, num_blocks: int = 200, **kw: Any):
        args = {
            "model": qwen3_ckpt,
            "device": "cpu",
            "max_model_len": 128,
            "block_size": BLOCK,
            "enable_prefix_caching": False,
            "async_scheduling": async_scheduling,
            **kw,
        }
        config = EngineArgs(**args).create_engine_config()
        model = FakeModel()
        return EngineCore(config, FakeExecutor(config, num_blocks, model)), model

    return make


def _prompt(i: int, n: int) -> list[int]:
    return [3 + (7 * i + 5 * j) % 400 for j in range(n)]


def _requests() -> list[EngineCoreRequest]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),  # greedy, may stop on EOS
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),  # to max_tokens
        SamplingParams(temperature=0.8, seed=11, max_tokens=15),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[5, 9]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True, min_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=0.5),  # reads outputs
    ]
    reqs = [
        EngineCoreRequest(f"r{i}", _prompt(i, 5 + 3 * i), p, eos_token_id=EOS)
        for i, p in enumerate(params * 3)
    ]
    return reqs


def _drive(
    core: EngineCore,
    reqs: list[EngineCoreRequest],
    between: Callable[[int], None] = lambda step: None,
    max_steps: int = 2000,
) -> tuple[dict[str, list[int]], dict[str, Any], list[EngineCoreOutputs]]:
    """Step until idle; (request id -> tokens sent, -> finish reason, every output)."""
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, Any] = {}
    seen: list[EngineCoreOutputs] = []
    for step in range(max_steps):
        if not core.has_unfinished_requests() and not core.scheduler.has_requests():
            return tokens, reasons, seen
        outs, _ = core.step()
        for eco in outs.values():
            seen.append(eco)
            for o in eco.outputs:
                assert o.request_id not in reasons, f"output after the finish: {o}"
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
        between(step)
    raise AssertionError("did not finish")


def _all_blocks_free(core: EngineCore) -> bool:
    kv = core.scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("budget", [2048, 16])  # 16: chunked prefills among the decodes
def test_same_tokens_as_synchronous(make_core, budget) -> None:
    sync, _ = make_core(False, max_num_batched_tokens=budget)
    want, want_reasons, _ = _drive(sync, _requests())
    core, model = make_core(True, max_num_batched_tokens=budget)
    got, reasons, _ = _drive(core, _requests())
    assert got == want and reasons == want_reasons
    assert {FinishReason.STOP, FinishReason.LENGTH} <= set(reasons.values())
    assert model.placeholders > 0 and model.resolved_late > 0  # it did run ahead
    assert _all_blocks_free(core) and core._pending is None


def test_a_stop_costs_at_most_one_discarded_token(make_core) -> None:
    sync, sync_model = make_core(False)
    want, want_reasons, _ = _drive(sync, _requests())
    core, model = make_core(True)
    got, _, _ = _drive(core, _requests())
    assert got == want  # the extra tokens reached no one
    for r in _requests():
        rid, extra = r.request_id, model.fed[r.request_id] - sync_model.fed[r.request_id]
        if want_reasons[rid] == FinishReason.LENGTH:
            assert extra == 0, rid  # max_tokens is known ahead: no extra token
        elif r.sampling_params.needs_penalties:
            assert extra == 0, rid  # it waits for each token: never runs ahead
        else:
            assert extra in (0, 1), rid
    stopped = [r for r, why in want_reasons.items() if why == FinishReason.STOP]
    assert any(model.fed[r] - sync_model.fed[r] == 1 for r in stopped)


def test_abort_and_external_finish_mid_step(make_core) -> None:
    sync, _ = make_core(False)
    want, _, _ = _drive(sync, _requests())
    core, _ = make_core(True)

    def between(step: int) -> None:
        if step == 3:  # a step is in flight (pending) for both
            assert core._pending is not None
            pending_ids = {sr.request.request_id for sr in core._pending[0].scheduled}
            assert {"r0", "r2"} <= pending_ids
            core.abort_requests(["r0"])
            core.scheduler.finish_requests(["r2"], RequestStatus.FINISHED_STOPPED)  # stop str

    got, reasons, seen = _drive(core, _requests(), between)
    for rid in ("r0", "r2"):
        assert rid not in reasons  # no output after the finish, no finish output
        assert got.get(rid, []) == want[rid][: len(got.get(rid, []))]
        assert any(rid in (eco.finished_requests or ()) for eco in seen)
    assert {k: v for k, v in got.items() if k not in ("r0", "r2")} == {
        k: v for k, v in want.items() if k not in ("r0", "r2")
    }
    assert _all_blocks_free(core)


def test_preemption_mid_step(make_core) -> None:
    """A KV cache too small for the batch: requests with a token in flight are preempted
    by the step scheduled next, their token still arrives, and they resume exactly."""
    sync, _ = make_core(False)
    want, want_reasons, _ = _drive(sync, _requests())
    core, model = make_core(True, num_blocks=22)
    got, reasons, _ = _drive(core, _requests())
    assert core.scheduler.num_preemptions > 0
    assert got == want and reasons == want_reasons
    assert model.placeholders > 0
    assert _all_blocks_free(core)


def test_equal_forward_counts_across_two_ep_ranks(make_core) -> None:
    """Two ranks in lockstep as the DP busy loop drives them (a dummy forward when a
    rank launched nothing; the all-reduce every DP_ALLREDUCE_INTERVAL steps ends the
    wave): every forward of one rank meets one of the other, also the passes where a
    rank only processed the step before."""
    ranks = [make_core(True), make_core(True)]
    reqs = _requests()
    for r in reqs[:10]:
        ranks[0][0].add_request(r)
    ranks[1][0].add_request(reqs[12])  # one short request: rank 1 idles most of the wave
    in_collective: list[int] = []
    for i, (core, _) in enumerate(ranks):
        assert isinstance(core.executor, FakeExecutor)
        core.executor.on_forward = lambda i=i: in_collective.append(i)
    counter = 0
    for _ in range(1000):
        for core, _ in ranks:
            _, ran = core.step()
            if not ran:
                core.execute_dummy_batch()
        # Each rank entered exactly one forward ("collective") this pass.
        assert sorted(in_collective) == [0, 1]
        in_collective.clear()
        counter += 1
        if counter % DP_ALLREDUCE_INTERVAL == 0 and not any(
            core.has_unfinished_requests() for core, _ in ranks
        ):
            break
    else:
        raise AssertionError("the wave did not end")
    (c0, m0), (c1, m1) = ranks
    assert m0.forwards == m1.forwards == counter and m1.dummies > m0.dummies
    assert m0.placeholders > 0 and _all_blocks_free(c0) and _all_blocks_free(c1)


def test_preempted_mid_step_and_finished_by_the_token_in_flight(make_core) -> None:
    """v's last token is in flight when a's growth preempts it (the newest): the token
    still arrives, finishes v in the waiting queue, and v leaves it."""

    def reqs() -> list[EngineCoreRequest]:
        return [
            EngineCoreRequest("a", _prompt(0, 4), SamplingParams(max_tokens=12, ignore_eos=True)),
            EngineCoreRequest("v", _prompt(1, 3), SamplingParams(max_tokens=5, ignore_eos=True)),
        ]

    sync, _ = make_core(False, num_blocks=5)
    want, want_reasons, _ = _drive(sync, reqs())
    core, _ = make_core(True, num_blocks=5)
    finished_waiting = []
    got, reasons, _ = _drive(
        core,
        reqs(),
        lambda step: finished_waiting.extend(r for r in core.scheduler.waiting if r.is_finished),
    )
    assert got == want and reasons == want_reasons
    assert core.scheduler.num_preemptions > 0 and not finished_waiting
    assert _all_blocks_free(core)


def test_placeholder_fill_on_host_equals_the_device_ops() -> None:
    tokens = torch.tensor([41, 42, 43, 44, 45])  # [N] the previous step's sampled ids
    rows, src = [0, 3, 6], [4, 0, 2]
    want = torch.arange(8)  # [T] input ids, placeholders at rows
    got = want.clone()
    fill_placeholders_device(want, tokens, rows, src)
    fill_placeholders_host(got, tokens, rows, src)
    assert want.tolist() == [45, 1, 2, 41, 4, 5, 43, 7] and torch.equal(got, want)


def test_refused_with_tensor_parallel_workers(qwen3_ckpt) -> None:
    args = EngineArgs(model=qwen3_ckpt, tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling with tensor_parallel_size 2"):
        args.create_engine_config()
