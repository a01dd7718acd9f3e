"""The frontend's request book for elastic EP (docs/architecture.md#elastic-migration), pure: no sockets, no clock.

With ``--enable-elastic-ep`` the multiprocess client records every engine request it
sends (each child of an ``n > 1`` request separately, ``n = 1`` each): the original
``EngineCoreRequest``, the output token ids accepted so far, and (``OwnershipTable``) the
engine that owns it. That is what a move needs:

- ``accept(engine_id, outputs)``: only the owner's outputs pass; every other one (a late
  output of an engine the request moved away from, or of a request already finished or
  aborted here) is dropped before it reaches ``AsyncLLM``. Finished requests leave the book.
- ``take(engine_id, request_ids)``: the requests to move off ``engine_id`` (those named --
  it handed them back -- or every one it owns: it is gone), each as a ``ResumedRequest``
  (send it elsewhere, then ``moved``) or ``AlreadyFinished`` (the outputs so far already
  end it: ``finished_output`` is the finish to deliver).
- ``finish(request_id)``: the request finished or its client aborted it.

Prompt logprobs: the positions accepted are counted; a request resumed mid-prefill asks
for them again and the positions the client already has are dropped from its new owner's
outputs (``_skip_prompt_lps``), so each position reaches the client exactly once.

A request is resumed from exactly the tokens accepted up to the move, and only its new
owner's outputs are accepted from then on: no gap, no duplicate (``tidal.elastic.migration``).
"""

from __future__ import annotations

from collections.abc import Iterable

from tidal.elastic.migration import (
    AlreadyFinished,
    OwnershipTable,
    ResumedRequest,
    resume_request,
)
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason


class RequestBook:
    """Every unfinished engine request this client sent, its owner and its outputs."""

    def __init__(self, epoch: int = 0, max_model_len: int | None = None) -> None:
        self.ownership = OwnershipTable(epoch)
        self.max_model_len = max_model_len
        self._requests: dict[str, EngineCoreRequest] = {}
        self._outputs: dict[str, list[int]] = {}
        self._prompt_lps: dict[str, int] = {}  # prompt logprob positions accepted
        self._skip_prompt_lps: dict[str, int] = {}  # ... to drop from a resumed request
        self.migrated = 0  # requests resumed on another engine
        self.resumed_mid_prefill = 0  # ... asking for their prompt logprobs again
        self.finished_on_move = 0  # requests whose outputs already ended them

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def dropped_outputs(self) -> int:
        """Outputs dropped because their engine does not own the request (any more)."""
        return self.ownership.dropped_outputs

    def set_epoch(self, epoch: int) -> None:
        self.ownership.set_epoch(epoch)

    def add(self, request: EngineCoreRequest, engine_id: int) -> None:
        """``request`` is being sent to ``engine_id`` (call before the send: its outputs
        may be read before the sender's next line runs)."""
        self.ownership.assign(request.request_id, engine_id)
        self._requests[request.request_id] = request
        self._outputs[request.request_id] = []

    def owner(self, request_id: str) -> int | None:
        a = self.ownership.owner(request_id)
        return None if a is None else a.engine_id

    def outputs(self, request_id: str) -> list[int]:
        """The output token ids accepted so far (a copy)."""
        return list(self._outputs[request_id])

    def accept(self, engine_id: int, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs of ``engine_id`` to pass on: those of requests it owns. Records
        their tokens; a finished one leaves the book."""
        kept: list[EngineCoreOutput] = []
        for out in outputs:
            rid = out.request_id
            if rid not in self._requests:
                continue  # finished or aborted here already: nobody waits for it
            if not self.ownership.accept(engine_id, rid, len(out.new_token_ids)):
                continue  # a former owner's late output
            if out.new_prompt_logprobs:
                self._take_prompt_logprobs(rid, out)
            self._outputs[rid].extend(out.new_token_ids)
            kept.append(out)
            if out.finished:
                self.finish(rid)
        return kept

    def _take_prompt_logprobs(self, rid: str, out: EngineCoreOutput) -> None:
        """Count the prompt logprob positions of ``out``, first dropping those a resumed
        request repeats (the client has them from its earlier owner)."""
        lps = out.new_prompt_logprobs or []
        skip = self._skip_prompt_lps.get(rid, 0)
        if skip:
            dropped = min(skip, len(lps))
            lps = lps[dropped:]
            out.new_prompt_logprobs = lps or None
            if skip > dropped:
                self._skip_prompt_lps[rid] = skip - dropped
            else:
                del self._skip_prompt_lps[rid]
        self._prompt_lps[rid] = self._prompt_lps.get(rid, 0) + len(lps)

    def finish(self, request_id: str) -> None:
        """Finished, or aborted by its client: forget it (idempotent)."""
        self.ownership.finish(request_id)
        self._requests.pop(request_id, None)
        self._outputs.pop(request_id, None)
        self._prompt_lps.pop(request_id, None)
        self._skip_prompt_lps.pop(request_id, None)

    def owned_by(self, engine_id: int) -> list[str]:
        return self.ownership.owned_by(engine_id)

    def take(
        self, engine_id: int, request_ids: Iterable[str] | None = None
    ) -> list[ResumedRequest | AlreadyFinished]:
        """What to do with each request to move off ``engine_id``: ``request_ids`` (it
        handed them back), or None for every request it owns (it is gone). Requests it
        does not own (finished, aborted or moved meanwhile) are skipped. Nothing changes
        until ``moved`` / ``finish``."""
        ids = self.owned_by(engine_id) if request_ids is None else list(dict.fromkeys(request_ids))
        out: list[ResumedRequest | AlreadyFinished] = []
        for rid in ids:
            if self.owner(rid) != engine_id:
                continue
            out.append(
                resume_request(
                    self._requests[rid],
                    self._outputs[rid],
                    self.max_model_len,
                    self._prompt_lps.get(rid, 0),
                )
            )
        return out

    def blocked_targets(self, request_id: str, candidates: Iterable[int]) -> set[int]:
        """Engines among ``candidates`` the request may not move to: its owner, and former
        owners not yet known to have stopped it."""
        return {e for e in candidates if not self.ownership.can_move_to(request_id, e)}

    def moved(self, resumed: ResumedRequest, to_engine: int, *, old_owner_stopped: bool) -> None:
        """``resumed`` is being sent to ``to_engine`` (call before the send)."""
        self.ownership.migrate(
            resumed.request_id,
            to_engine,
            resumed.num_output_tokens,
            old_owner_stopped=old_owner_stopped,
        )
        if resumed.prompt_logprobs_done is not None:  # asked again: drop what we have
            self._skip_prompt_lps[resumed.request_id] = resumed.prompt_logprobs_done
            self.resumed_mid_prefill += 1
        self.migrated += 1

    def finished_output(self, done: AlreadyFinished) -> EngineCoreOutput:
        """The finish the lost engine never sent: forget the request, return the output
        that ends its stream (no new tokens)."""
        request = self._requests.get(done.request_id)
        stop_reason: int | None = None
        outputs = self._outputs.get(done.request_id) or []
        if done.reason is FinishReason.STOP and request is not None and outputs:
            p, last = request.sampling_params, outputs[-1]
            eos = not p.ignore_eos and request.eos_token_id == last
            if not eos and last in p.stop_token_ids:
                stop_reason = last  # like the engine: the stop token id (EOS: None)
        self.finish(done.request_id)
        self.finished_on_move += 1
        return EngineCoreOutput(
            done.request_id, [], finish_reason=done.reason, stop_reason=stop_reason
        )

    def failed_output(self, request_id: str, message: str) -> EngineCoreOutput:
        """The request could not be moved: forget it, return an ERROR finish for it."""
        self.finish(request_id)
        return EngineCoreOutput(
            request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message
        )
