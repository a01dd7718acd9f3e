"""A ``SchedulerOutput`` to the TP workers and back (``tidal.protocol.worker.StepInput``).

The scheduler's output references its ``Request`` objects; workers in other processes get
the wire form instead, and keep their own copy of each request so a step carries only what
changed (docs/architecture.md#tensor-parallel: the step's input is broadcast every step, so its size is the
queue's latency at 256 requests):

- ``StepEncoder`` (engine side) mirrors what the workers hold per request: the object it
  came from, how many output tokens and which block table they have. A request the
  workers do not hold -- new, or a different object under the same id (re-added after a
  migration), or whose block table is no longer an extension of theirs (preempted and
  re-allocated) -- goes whole (``WorkerRequest``); otherwise its chunk carries only the
  new output tokens and appended blocks. Requests the scheduler finished go to
  ``forget``, on both sides.
- ``StepDecoder`` (worker side) applies that and returns a ``SchedulerOutput`` over its
  ``WorkerSideRequest`` copies, which satisfy the runner's ``RunnerRequest``.

Both ends apply the same rules in the same order, so the copies stay equal to the
scheduler's requests at every step (``tests/unit/test_step_wire.py`` checks it field by
field against a real scheduler run with preemption and aborts). A step that raised on the
engine after the workers applied it changes nothing: the deltas describe the scheduler's
requests as they were scheduled, whether or not the step's tokens come back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.executor.batch import RunnerRequest, ScheduledRequest, SchedulerOutput
from tidal.protocol.worker import StepInput, WorkerChunk, WorkerRequest
from tidal.sampling_params import SamplingParams


@dataclass
class _Sent:
    request: RunnerRequest  # the scheduler's object (identity tells a re-added request)
    num_outputs: int
    blocks: list[int]


class StepEncoder:
    """Engine side: ``encode(sched)`` for each step, in order."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    @property
    def num_held(self) -> int:
        """Requests the workers hold now."""
        return len(self._sent)

    def encode(self, sched: SchedulerOutput) -> StepInput:
        step = StepInput(grammar_bitmask=sched.grammar_bitmask)
        for rid in sched.finished_req_ids:
            if self._sent.pop(rid, None) is not None:
                step.forget.append(rid)
        for sr in sched.scheduled:
            req = sr.request
            rid = req.request_id
            chunk = WorkerChunk(rid, sr.start, sr.num_new_tokens)
            sent = self._sent.get(rid)
            blocks = req.block_ids
            outputs = req.output_token_ids
            if (
                sent is None
                or sent.request is not req
                or len(outputs) < sent.num_outputs
                or blocks[: len(sent.blocks)] != sent.blocks
            ):
                step.new_requests.append(
                    WorkerRequest(
                        rid,
                        list(req.prompt_token_ids),
                        req.sampling_params,
                        list(outputs),
                        list(blocks),
                        req.eos_token_id,
                    )
                )
                self._sent[rid] = _Sent(req, len(outputs), list(blocks))
            else:
                if len(outputs) > sent.num_outputs:
                    chunk.new_output_token_ids = outputs[sent.num_outputs :]
                    sent.num_outputs = len(outputs)
                if len(blocks) > len(sent.blocks):
                    chunk.new_block_ids = blocks[len(sent.blocks) :]
                    sent.blocks.extend(chunk.new_block_ids)
            step.chunks.append(chunk)
        return step


class WorkerSideRequest:
    """A worker's copy of a scheduled request (``RunnerRequest``)."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "block_ids",
        "sampling_params",
        "eos_token_id",
    )

    def __init__(self, wire: WorkerRequest) -> None:
        self.request_id = wire.request_id
        self.prompt_token_ids = wire.prompt_token_ids
        self.output_token_ids = wire.output_token_ids
        self.all_token_ids = wire.prompt_token_ids + wire.output_token_ids
        self.block_ids = wire.block_ids
        self.sampling_params: SamplingParams = wire.sampling_params
        self.eos_token_id = wire.eos_token_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class StepDecoder:
    """Worker side: ``decode(step)`` for each step, in order."""

    def __init__(self) -> None:
        self.requests: dict[str, WorkerSideRequest] = {}

    def decode(self, step: StepInput) -> SchedulerOutput:
        for rid in step.forget:
            self.requests.pop(rid, None)
        for wire in step.new_requests:
            self.requests[wire.request_id] = WorkerSideRequest(wire)
        scheduled: list[ScheduledRequest] = []
        total = 0
        for chunk in step.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:
                raise KeyError(f"step input names request {chunk.request_id!r}, never sent")
            if chunk.new_output_token_ids:
                req.output_token_ids.extend(chunk.new_output_token_ids)
                req.all_token_ids.extend(chunk.new_output_token_ids)
            if chunk.new_block_ids:
                req.block_ids.extend(chunk.new_block_ids)
            scheduled.append(ScheduledRequest(req, chunk.start, chunk.num_new_tokens))
            total += chunk.num_new_tokens
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=total,
            grammar_bitmask=step.grammar_bitmask,
        )
