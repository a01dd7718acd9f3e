"""What crosses the scheduler -> model runner -> scheduler boundary inside one engine.

These stay in-process (the executor runs in the engine's process), so they are plain
dataclasses that reference the scheduler's request objects rather than serialisable
messages. They live with the executor, below the engine core (docs/architecture.md#layers), because the
Executor interface is written in them; the runner sees a request only through
``RunnerRequest``, which ``tidal.engine_core.request.Request`` satisfies.

Pure Python, no torch: the scheduler imports this module too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

from tidal.protocol.messages import Logprobs
from tidal.sampling_params import SamplingParams

# KV cache block 0 is reserved and never handed to a request (``engine_core/kv_cache.py``),
# so the runner may aim the KV writes of padding or dummy tokens at it and pad block
# tables with it.
NULL_BLOCK_ID = 0


class RunnerRequest(Protocol):
    """What the model runner reads of a scheduled request (read-only: the scheduler owns it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output

    @property
    def block_ids(self) -> list[int]: ...  # the block table

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass
class ScheduledRequest:
    request: RunnerRequest
    start: int  # request.num_computed_tokens before this step
    num_new_tokens: int  # compute KV for all_token_ids[start : start + num_new_tokens]
    # Async scheduling (docs/architecture.md#async-scheduling): this one-token chunk is
    # the token the previous step samples for the request, not yet in ``all_token_ids``;
    # the runner takes it from that step's sampled ids. Such a chunk always samples.
    placeholder: bool = False

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last token (known or a placeholder), so the
        step samples one."""
        return self.placeholder or self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished or aborted since the previous schedule(): runners drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> the tokens its grammar allows next, for the structured-output requests
    # that sample in this step: [ceil(V / 32)] int32 as little-endian bytes, bit t % 32 of
    # word t // 32 set = token t allowed (docs/architecture.md#structured-outputs).
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # req_id -> sampled token ids of this step ([] or absent for a partial prefill chunk).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> one Logprobs per sampled token, when the request asked for logprobs.
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # req_id -> Logprobs for prompt positions computed in this step (position 0 excluded).
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # req_id -> why the runner could not prepare or sample it. Those requests were left
    # out of this step (their KV for it was not written); the scheduler fails them alone.
    failed: dict[str, str] = field(default_factory=dict)


class PendingRunnerOutput(ABC):
    """A step launched but not waited for (``runner.execute_model_async``): its sampled
    ids stay where they were sampled until ``resolve``, which the engine core calls one
    step later, after launching the next step (docs/architecture.md#async-scheduling)."""

    @abstractmethod
    def resolve(self) -> ModelRunnerOutput:
        """The step's output, its sampled ids copied to the host (waits for them)."""


class ReadyRunnerOutput(PendingRunnerOutput):
    """An output already on the host (an empty step, or nothing to defer)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def resolve(self) -> ModelRunnerOutput:
        return self.output
