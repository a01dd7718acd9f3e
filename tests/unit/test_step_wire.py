"""The step's wire form for TP workers (tidal/executor/step_wire.py): over a real scheduler
run -- chunked prefills, decodes, preemption by recompute (a new block table), aborts, a
request re-added under the same id -- the worker's copies equal the scheduler's requests
at every step, while steady decode steps carry only deltas."""

from __future__ import annotations

import msgspec

from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.executor.batch import ModelRunnerOutput
from tidal.executor.step_wire import StepDecoder, StepEncoder
from tidal.protocol.worker import StepInput
from tidal.sampling_params import SamplingParams

WIRE = msgspec.msgpack.Decoder(StepInput)


def _check(sched, decoded) -> None:
    assert len(decoded.scheduled) == len(sched.scheduled)
    assert decoded.total_num_scheduled_tokens == sched.total_num_scheduled_tokens
    for want, got in zip(sched.scheduled, decoded.scheduled):
        a, b = want.request, got.request
        assert (got.start, got.num_new_tokens, got.samples) == (
            want.start,
            want.num_new_tokens,
            want.samples,
        )
        for name in ("request_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
                     "block_ids", "sampling_params", "eos_token_id", "num_prompt_tokens",
                     "num_tokens"):  # fmt: skip
            assert getattr(b, name) == getattr(a, name), name


def test_worker_copies_follow_the_scheduler_through_preemption_and_aborts():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks=14,  # tight: decodes preempt others
    )
    enc, dec = StepEncoder(), StepDecoder()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(5):
        sched.add_request(Request(f"r{i}", [10 + i] * (5 + 3 * i), params))
    sizes, news, preempted = [], 0, 0
    for step in range(80):
        if step == 6:
            sched.abort_requests(["r1"])
        if step == 9:  # the same id again, a new request object
            sched.add_request(Request("r1", [99, 98, 97], params))
        if not sched.has_requests():
            break
        out = sched.schedule()
        preempted += len(out.preempted_req_ids)
        wire = msgspec.msgpack.encode(enc.encode(out))
        step_in = WIRE.decode(wire)
        news += len(step_in.new_requests)
        sizes.append((len(out.scheduled), len(wire)))
        _check(out, dec.decode(step_in))
        result = ModelRunnerOutput()
        for sr in out.scheduled:
            if sr.samples:
                result.sampled_token_ids[sr.request.request_id] = [7 + step % 5]
        sched.update_from_output(out, result)
    assert not sched.has_requests()
    assert preempted > 0  # the tight cache made the scheduler recompute someone
    assert news > 6  # 6 requests, plus those resent after a preemption
    # Every finished request was forgotten on both sides.
    enc.encode(sched.schedule())
    assert enc.num_held == 0 and dec.requests.keys() <= {"r1"}
    # A decode step of several requests carries deltas, not prompts.
    decodes = [n for k, n in sizes if k >= 3]
    assert decodes and min(decodes) < 200


def test_decode_steps_carry_one_token_and_no_prompt():
    enc, dec = StepEncoder(), StepDecoder()
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), num_blocks=200)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(32):
        sched.add_request(Request(f"q{i}", list(range(3 + i, 60)), params))
    lengths = []
    for _ in range(4):
        out = sched.schedule()
        wire = msgspec.msgpack.encode(enc.encode(out))
        lengths.append(len(wire))
        _check(out, dec.decode(WIRE.decode(wire)))
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                sampled_token_ids={sr.request.request_id: [5] for sr in out.scheduled if sr.samples}
            ),
        )
    assert lengths[0] > 32 * 40  # the prompts, once
    assert max(lengths[1:]) < 32 * 16  # then a token (and now and then a block) each
