"""Request migration (docs/architecture.md#elastic-migration), pure: the resumed request, and who owns a request.

A request moves when its engine leaves (handed back by a draining engine, or found on a
dead one). The frontend holds its prompt ids, the output ids it has streamed and its
parameters; ``resume_request`` builds the *resumed* request for another engine:

- prompt = original prompt + every output token already streamed, so the new engine's
  KV cache is rebuilt by one prefill and generation continues at the next position;
- the output count carries over (``num_output_tokens``): ``max_tokens`` and
  ``min_tokens`` count the tokens already streamed, so the total is what an unmoved
  request would produce; stop strings are the frontend detokenizer's and simply carry
  on; logprobs continue per new token; prompt logprobs, once all returned, are not
  asked for again -- a request that moves mid-prefill (chunked: some of them returned,
  no output yet) asks for them again, and the frontend drops the positions it already
  has (``prompt_logprobs_done``), so the client gets each position exactly once;
- the request id is unchanged (the frontend's output processor keys on it; a child of an
  ``n > 1`` request keeps its own id and seed), and an explicit ``data_parallel_rank``
  is dropped (that rank may be the one that left).

Wire form. ``ResumedRequest.to_engine_request()`` sends the original parameters with
``EngineCoreRequest.num_output_tokens = k``: the engine takes the last ``k`` prompt
tokens as outputs already produced, for the token budgets, the frequency / presence /
repetition penalties and the seeded sampler's output position (its noise is a function
of (seed, output position), docs/architecture.md#elastic-migration). So greedy, seeded and penalised requests
alike continue exactly as an unmoved request would.

Ownership. ``OwnershipTable`` is the frontend's rule "outputs from an engine that no
longer owns the request are dropped": each request has exactly one owner engine, and an
output is accepted only from it. The resumed request is built from exactly the tokens
accepted up to the move (``migrate`` checks the count) and every later output of the old
owner is dropped: no gap, no duplicate. A request may move back to an engine that owned
it before only once that engine is known to have stopped it -- its hand-back report or
its abort acknowledgement, each sent on the same FIFO stream after its last output for
the request -- otherwise a late output of the old assignment would be taken for one of
the new. (Engine ids are never reused, so a dead or removed engine is never a target.)
Requests leave the table only when they finish or their client aborts them: a move
never drops one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from tidal.protocol.messages import EngineCoreRequest, FinishReason
from tidal.sampling_params import SamplingParams

# ------------------------------------------------------------------- resumed requests


@dataclass(frozen=True)
class ResumedRequest:
    """A request continuing on another engine after ``num_output_tokens`` outputs."""

    original: EngineCoreRequest
    prompt_token_ids: list[int]  # original prompt + outputs so far
    num_output_tokens: int  # carried over: the last this many prompt tokens are outputs
    # Prompt logprob positions already returned, when the original asked for them and
    # they are not all returned yet (a move mid-prefill): asked for again, and the first
    # this many dropped. None: not asked for (again).
    prompt_logprobs_done: int | None = None

    @property
    def request_id(self) -> str:
        return self.original.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the original prompt."""
        return len(self.prompt_token_ids) - self.num_output_tokens

    @property
    def sampling_params(self) -> SamplingParams:
        """The original parameters; prompt logprobs off once all were returned."""
        if self.prompt_logprobs_done is not None:
            return self.original.sampling_params
        return msgspec.structs.replace(self.original.sampling_params, prompt_logprobs=None)

    def to_engine_request(
        self, *, current_wave: int, arrival_time: float | None = None
    ) -> EngineCoreRequest:
        """The wire form: the original parameters, the carry-over in ``num_output_tokens``."""
        o = self.original
        return EngineCoreRequest(
            request_id=o.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling_params=self.sampling_params,
            eos_token_id=o.eos_token_id,
            arrival_time=o.arrival_time if arrival_time is None else arrival_time,
            client_index=o.client_index,
            current_wave=current_wave,
            data_parallel_rank=None,  # the pinned rank may be the one that left
            num_output_tokens=self.num_output_tokens,
        )


@dataclass(frozen=True)
class AlreadyFinished:
    """The outputs so far already end the request (its finish was lost with its engine)."""

    request_id: str
    reason: FinishReason


def resume_request(
    request: EngineCoreRequest,
    output_token_ids: Sequence[int],
    max_model_len: int | None = None,
    prompt_logprobs_returned: int = 0,
) -> ResumedRequest | AlreadyFinished:
    """The resumed form of ``request`` after ``output_token_ids`` were streamed, or
    ``AlreadyFinished`` when those outputs already meet a stop condition (the engine
    died between sampling the last token and reporting the finish). ``max_model_len``:
    the context limit, which also ends a request (as LENGTH). ``prompt_logprobs_returned``:
    prompt logprob positions the client has (one per prompt token after the first)."""
    p = request.sampling_params
    if p.n != 1:
        raise ValueError(
            f"request {request.request_id!r} has n={p.n}: migrate each child engine request "
            "(n=1, its own seed) separately"
        )
    outputs = list(output_token_ids)
    k = len(outputs)
    # The scheduler's order: a stop token wins over the length limit it also reaches.
    if outputs and k >= p.min_tokens:
        stops = set(p.stop_token_ids)
        if request.eos_token_id is not None and not p.ignore_eos:
            stops.add(request.eos_token_id)
        if outputs[-1] in stops:
            return AlreadyFinished(request.request_id, FinishReason.STOP)
    if p.max_tokens is not None and k >= p.max_tokens:
        return AlreadyFinished(request.request_id, FinishReason.LENGTH)
    if max_model_len is not None and len(request.prompt_token_ids) + k >= max_model_len:
        return AlreadyFinished(request.request_id, FinishReason.LENGTH)
    done: int | None = None
    wanted = len(request.prompt_token_ids) - 1  # positions 1 .. P-1
    if p.prompt_logprobs is not None and k == 0 and prompt_logprobs_returned < wanted:
        # Moved mid-prefill: the prompt is re-read from its start, logprobs with it.
        done = prompt_logprobs_returned
    return ResumedRequest(request, [*request.prompt_token_ids, *outputs], k, done)


# ------------------------------------------------------------------- ownership


@dataclass(frozen=True)
class Assignment:
    """``engine_id`` owns the request since topology ``epoch``; ``generation`` counts moves."""

    engine_id: int
    epoch: int
    generation: int = 0


class OwnershipTable:
    """Which engine owns each unfinished request, and how many outputs were accepted."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self._owner: dict[str, Assignment] = {}
        self._accepted: dict[str, int] = {}  # output tokens accepted so far
        # Former owners not yet known to have stopped the request: not a target.
        self._unstopped: dict[str, set[int]] = {}
        self.dropped_outputs = 0  # outputs from an engine that does not own the request
        self.stale_epochs = 0

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._owner

    def set_epoch(self, epoch: int) -> bool:
        """Adopt a newer topology epoch (epochs only increase: an older one is counted
        and ignored)."""
        if epoch < self.epoch:
            self.stale_epochs += 1
            return False
        self.epoch = epoch
        return True

    def assign(self, request_id: str, engine_id: int) -> Assignment:
        """A new request, sent to ``engine_id``."""
        if request_id in self._owner:
            raise ValueError(f"request {request_id!r} already has an owner")
        a = Assignment(engine_id, self.epoch)
        self._owner[request_id] = a
        self._accepted[request_id] = 0
        self._unstopped[request_id] = set()
        return a

    def owner(self, request_id: str) -> Assignment | None:
        return self._owner.get(request_id)

    def num_accepted(self, request_id: str) -> int:
        return self._accepted[request_id]

    def owned_by(self, engine_id: int) -> list[str]:
        """Requests ``engine_id`` owns (what must move when it leaves or dies)."""
        return [r for r, a in self._owner.items() if a.engine_id == engine_id]

    def can_move_to(self, request_id: str, engine_id: int) -> bool:
        """Whether ``engine_id`` may become the owner: not the owner, and not a former
        owner that may still send outputs of its old assignment."""
        a = self._owner.get(request_id)
        return (
            a is not None
            and a.engine_id != engine_id
            and engine_id not in self._unstopped[request_id]
        )

    def accept(self, engine_id: int, request_id: str, num_new_tokens: int = 0) -> bool:
        """Whether an output of ``engine_id`` for ``request_id`` is passed on: only from
        its current owner. Counts the accepted tokens."""
        a = self._owner.get(request_id)
        if a is None or a.engine_id != engine_id:
            self.dropped_outputs += 1
            return False
        self._accepted[request_id] += num_new_tokens
        return True

    def migrate(
        self,
        request_id: str,
        to_engine: int,
        num_outputs_so_far: int | None = None,
        *,
        old_owner_stopped: bool = False,
    ) -> Assignment:
        """Move ``request_id`` to ``to_engine``; from now on only its outputs are accepted.
        ``num_outputs_so_far``: the output count the resumed request was built from,
        checked against what was accepted (a mismatch would be a gap or a duplicate).
        ``old_owner_stopped``: the owner reported it stopped the request (hand-back)."""
        a = self._owner.get(request_id)
        if a is None:
            raise KeyError(f"request {request_id!r} is not in the ownership table")
        if not self.can_move_to(request_id, to_engine):
            raise ValueError(
                f"request {request_id!r} cannot move to engine {to_engine}: it owns it, or "
                "owned it and may still send outputs of that assignment"
            )
        if num_outputs_so_far is not None and num_outputs_so_far != self._accepted[request_id]:
            raise ValueError(
                f"request {request_id!r}: resumed after {num_outputs_so_far} outputs but "
                f"{self._accepted[request_id]} were accepted"
            )
        if not old_owner_stopped:
            self._unstopped[request_id].add(a.engine_id)
        new = Assignment(to_engine, self.epoch, a.generation + 1)
        self._owner[request_id] = new
        return new

    def stopped(self, engine_id: int, request_id: str) -> None:
        """``engine_id`` acknowledged it stopped ``request_id`` (abort done): it sends no
        more outputs for it, so it may own it again."""
        unstopped = self._unstopped.get(request_id)
        if unstopped is not None:
            unstopped.discard(engine_id)

    def finish(self, request_id: str) -> None:
        """The request finished (or its client aborted it): forget it."""
        self._owner.pop(request_id, None)
        self._accepted.pop(request_id, None)
        self._unstopped.pop(request_id, None)

    def requests(self) -> Iterable[str]:
        return self._owner.keys()
