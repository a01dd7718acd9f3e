"""A request as the engine core sees it: token ids, progress, blocks, status.

Owned by the scheduler (the busy loop's thread); the model runner reads it in-process.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tidal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.engine_core.structured import RequestGrammar


@enum.unique
class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine failed this request alone (stop_reason: why)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class Request:
    """One sequence. ``all_token_ids`` is prompt + output; ``num_computed_tokens`` of them
    have KV in ``block_ids`` (the block table, written by the KV cache manager; with KV
    cache groups their tables interleaved: tidal/engine_core/kv_cache.py).

    A *resumed* request (``num_output_tokens=k``, docs/architecture.md#elastic-migration) arrives with the last
    ``k`` of ``prompt_token_ids`` already generated elsewhere: they become its first
    ``output_token_ids``, so every rule that counts outputs (max/min_tokens, penalties,
    the seeded sampler's output position) continues as if it had never moved. Only
    tokens generated here are reported and checked for stops."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        max_model_len: int | None = None,
        current_wave: int = 0,
        num_output_tokens: int = 0,
    ) -> None:
        # (An empty prompt is the scheduler's to refuse, with its own message.)
        if num_output_tokens < 0 or 0 < len(prompt_token_ids) <= num_output_tokens:
            raise ValueError(
                f"num_output_tokens must be >= 0 and below the prompt's length "
                f"({len(prompt_token_ids)}), got {num_output_tokens}"
            )
        split = len(prompt_token_ids) - num_output_tokens
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids[:split])
        self.sampling_params = sampling_params
        # Checked against every sampled token: a set, whatever the list's length.
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.eos_token_id = eos_token_id
        # The tokens that may stop it (stop ids, and EOS unless ignored): a sampled token
        # outside them stops it only by length (or its grammar), checked without a call.
        eos = () if eos_token_id is None or sampling_params.ignore_eos else (eos_token_id,)
        self.stopping_token_ids = self.stop_token_ids.union(eos)
        self.client_index = client_index
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # This engine's clock (arrival_time may be the frontend's): the request's timings.
        self.queued_time = time.monotonic()
        self.scheduled_time: float | None = None  # first scheduled here
        self.first_token_time: float | None = None  # first token generated here
        self.current_wave = current_wave
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(prompt_token_ids[split:])
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling (docs/architecture.md#async-scheduling): tokens scheduled to be
        # sampled whose ids are not back yet (0, 1 or 2). ``num_computed_tokens`` may
        # count one of them: the decode that feeds it is scheduled before it is known.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule; -1 = not yet
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks of all_token_ids
        # Leading blocks of block_ids already offered to the prefix cache (the KV cache
        # manager's, like the two above).
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # The scheduler's matcher for a structured-output request (docs/architecture.md#structured-outputs).
        self.grammar: RequestGrammar | None = None
        # Its sampling reads the values of its outputs, not only their count (penalties,
        # bad words, a grammar): async scheduling samples it only when they are all known.
        self.reads_outputs = (
            sampling_params.needs_penalties
            or bool(sampling_params.bad_words_token_ids)
            or sampling_params.structured_outputs is not None
        )
        # Resolved output cap: the request's max_tokens, bounded by the model length.
        limit = (max_model_len - len(self.prompt_token_ids)) if max_model_len else None
        mt = sampling_params.max_tokens
        self.max_tokens = min(x for x in (mt, limit) if x is not None) if (mt or limit) else 1 << 30

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
