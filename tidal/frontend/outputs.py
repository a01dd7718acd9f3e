"""User-facing results of ``LLM.generate`` and ``AsyncLLM.generate`` (vLLM-compatible shape)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@enum.unique
class OutputKind(enum.Enum):
    CUMULATIVE = enum.auto()  # every output holds everything so far
    DELTA = enum.auto()  # every output holds only what is new (streaming)
    FINAL_ONLY = enum.auto()  # one output when the request finishes


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
