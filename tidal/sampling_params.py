"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # like vLLM's default cap: top-k logprobs beyond this cost more than they help


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Every invalid value raises ``ValueError`` naming the field, so frontends can turn
    the message into an HTTP 400 unchanged.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            v = getattr(self, name)
            _check(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                name,
                f"must be a finite number, got {v!r}",
            )
        for name in ("top_k", "min_tokens"):
            v = getattr(self, name)
            _check(
                isinstance(v, int) and not isinstance(v, bool),
                name,
                f"must be an integer, got {v!r}",
            )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(
            self.seed is None
            or (isinstance(self.seed, int) and -(1 << 63) <= self.seed < (1 << 63)),
            "seed",
            f"must be a 64-bit integer, got {self.seed!r}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be >= 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name} {msg}")
