"""Turns engine outputs (token ids) into user outputs (text, logprobs, finish reasons).

Shared by the offline ``LLM`` and the server's ``AsyncLLM``. A request with ``n > 1`` is
fanned out into ``n`` child engine requests (``"{i}_{request_id}"``); their outputs are
merged back under the parent id here. A child the engine failed (``FinishReason.ERROR``)
fails its whole request: it becomes a ``RequestFailedError`` instead of an output. So
does an output this side cannot process (the tokenizer raising on a token): that request
fails alone, and the others in the same batch of outputs go on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tidal.frontend.detokenizer import IncrementalDetokenizer
from tidal.frontend.outputs import (
    CompletionOutput,
    Logprob,
    OutputKind,
    PromptLogprobs,
    RequestOutput,
)
from tidal.protocol.errors import RequestFailedError
from tidal.protocol.messages import EngineCoreOutput, FinishReason, Logprobs
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # characters already emitted (DELTA)
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_final: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    children: dict[str, _Child]
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Child request ids the engine must abort (a stop string matched in the frontend, or
    # a sibling failed).
    reqs_to_abort: list[str]
    # Requests (by parent id) that the engine failed; they are forgotten here.
    failed: list[RequestFailedError] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind = OutputKind.FINAL_ONLY,
    ) -> list[str]:
        """Register a request; returns the child engine request ids to submit."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        taken = next((c for c in ids if c in self._child_to_parent), None)
        if taken is not None:  # e.g. "0_x" beside "x" with n > 1: outputs would cross
            raise ValueError(
                f"request id {request_id!r}: its engine request id {taken!r} is in use "
                f"by request {self._child_to_parent[taken]!r}"
            )
        children = {}
        for i, cid in enumerate(ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
            child = _Child(index=i, detok=detok)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children[cid] = child
            self._child_to_parent[cid] = request_id
        self._parents[request_id] = _Parent(
            request_id, prompt, list(prompt_token_ids), params, kind, children
        )
        if params.prompt_logprobs is not None:
            self._parents[request_id].prompt_logprobs = [None]
        return list(children)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def num_unfinished(self) -> int:
        return len(self._parents)

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent request; returns the child ids to abort in the engine."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for cid in parent.children:
            self._child_to_parent.pop(cid, None)
        return list(parent.children)

    def finish_all(self, message: str) -> tuple[list[RequestOutput], list[str]]:
        """End every request here with finish reason ``abort`` and ``message`` as its
        stop reason (the server's drain timed out); returns their last outputs and the
        child ids still running in the engine. Everything is forgotten."""
        outputs: list[RequestOutput] = []
        running: list[str] = []
        for pid, parent in list(self._parents.items()):
            for cid, child in parent.children.items():
                if child.finish_reason is None:
                    child.finish_reason, child.stop_reason = "abort", message
                    running.append(cid)
            ro = self._make_output(parent)
            if ro is not None:
                outputs.append(ro)
            self.abort(pid)
        return outputs, running

    def parent_of(self, child_id: str) -> str | None:
        return self._child_to_parent.get(child_id)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        failed: list[RequestFailedError] = []
        for out in outputs:
            pid = self._child_to_parent.get(out.request_id)
            if pid is None:
                continue  # aborted meanwhile
            parent = self._parents[pid]
            child = parent.children[out.request_id]
            if child.finish_reason is not None:
                continue
            if out.finish_reason is FinishReason.ERROR:
                message = str(out.stop_reason or "the engine failed the request")
                error = RequestFailedError(pid, message, invalid=out.invalid_request)
            else:
                try:
                    if self._apply(parent, child, out):
                        to_abort.append(out.request_id)
                    touched[pid] = parent
                    continue
                except Exception as e:  # noqa: BLE001 - fails this request, not the frontend
                    logger.exception("request %s: processing its output failed", pid)
                    message = f"the server failed to process this request's output: {e!r}"
                    error = RequestFailedError(pid, message)
            failed.append(error)
            child.finish_reason = "error"
            to_abort += [c for c, ch in parent.children.items() if ch.finish_reason is None]
            self.abort(pid)
            touched.pop(pid, None)
        results = []
        for pid, parent in touched.items():
            ro = self._make_output(parent)
            if ro is not None:
                results.append(ro)
            if parent.finished:
                self.abort(pid)
        return ProcessedOutputs(results, to_abort, failed)

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput) -> bool:
        """Fold one engine output into a child; True when a stop string ended it."""
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(
                self._to_dicts(out.new_prompt_logprobs, parent.params.detokenize)
            )
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and child.logprobs is not None:
            child.logprobs.extend(self._to_dicts(out.new_logprobs, parent.params.detokenize))
            step = sum(lp.logprobs[0] for lp in out.new_logprobs)
            child.cumulative_logprob = (child.cumulative_logprob or 0.0) + step
        stop = (
            child.detok.update(out.new_token_ids, out.finish_reason is FinishReason.STOP)
            if parent.params.detokenize
            else None
        )
        if stop is not None:
            child.finish_reason, child.stop_reason = "stop", stop
            return out.finish_reason is None  # still running in the engine: abort it
        if out.finish_reason is not None:
            child.finish_reason = str(out.finish_reason)
            child.stop_reason = out.stop_reason
        return False

    def _to_dicts(self, lps: list[Logprobs], decode: bool) -> list[dict[int, Logprob]]:
        result = []
        for lp in lps:
            d: dict[int, Logprob] = {}
            for j, (tok, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
                if tok in d:
                    continue
                rank = lp.rank if j == 0 else j
                d[tok] = Logprob(val, rank, self.tokenizer.decode([tok]) if decode else None)
            result.append(d)
        return result

    def _make_output(self, parent: _Parent) -> RequestOutput | None:
        if parent.kind is OutputKind.FINAL_ONLY and not parent.finished:
            return None
        delta = parent.kind is OutputKind.DELTA
        comps = [self._completion(c, delta) for c in parent.children.values()]
        comps = [c for c in comps if c is not None]
        prompt_lps = parent.prompt_logprobs
        if delta:
            if parent.sent_prompt_logprobs:
                prompt_lps = None
            parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=sorted(comps, key=lambda c: c.index),
            finished=parent.finished,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _completion(self, c: _Child, delta: bool) -> CompletionOutput | None:
        text = c.detok.output_text
        if not delta:
            return CompletionOutput(
                c.index,
                text,
                list(c.token_ids),
                c.cumulative_logprob,
                c.logprobs,
                c.finish_reason,
                c.stop_reason,
            )
        if c.sent_final:
            return None
        c.sent_final = c.finish_reason is not None
        end = len(text) if c.finish_reason else max(c.sent_text, len(text) - c.detok.holdback)
        new_text, new_ids = text[c.sent_text : end], c.token_ids[c.sent_tokens :]
        new_lps = c.logprobs[c.sent_logprobs :] if c.logprobs is not None else None
        if not new_text and not new_ids and c.finish_reason is None:
            return None
        c.sent_text, c.sent_tokens = end, len(c.token_ids)
        c.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
        return CompletionOutput(
            c.index,
            new_text,
            new_ids,
            c.cumulative_logprob,
            new_lps,
            c.finish_reason,
            c.stop_reason,
        )
