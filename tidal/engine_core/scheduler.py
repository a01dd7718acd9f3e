"""Continuous batching for one engine: which tokens of which requests run in the next step.

No prefill or decode phases: every step has a token budget (``max_num_batched_tokens``)
and each scheduled request gets a slice ``all_token_ids[start : start + n]`` of the tokens
it has not computed yet. A slice that reaches the last known token samples one
(``ScheduledRequest.samples``); a shorter one is a chunk of a chunked prefill.

Order in a step (decode first, then first come first served):
1. RUNNING requests in admission order, each ``min(remaining tokens, budget left)``:
   one token for a decode, a chunk for an ongoing chunked prefill. When one cannot get
   blocks, the last running request (the newest, lowest priority) is preempted by
   recompute, repeatedly, until the allocation fits or the request preempts itself.
2. Only if nothing was preempted: WAITING requests (preempted ones are back at the front)
   while the budget and ``max_num_seqs`` allow, starting after their prefix-cache hit.
   Without chunked prefill, a request whose tokens do not fit the budget left waits
   (and so does everything behind it: no overtaking).

``schedule()`` advances ``request.num_computed_tokens`` as it schedules (``start`` keeps
the old value); ``update_from_output()`` appends sampled tokens, applies stop rules,
frees finished requests and builds the per-client ``EngineCoreOutputs``.

Structured outputs (docs/architecture.md#structured-outputs): a request with a grammar
waits in WAITING, passed over by the others, until its grammar has compiled on the
backend's threads (a step never waits for a compile; one that fails fails the request
alone). Its matcher is synced with its output tokens when it is admitted (a resumed
request replays the ones it carried over), advanced with every token appended here, and
``schedule()`` puts the next-token bitmask of each of them that samples in the step.

Livelock freedom: ``add_request`` rejects a request that could need more blocks than
the pool has (or, without chunked prefill, more tokens than one step's budget), so a
request running alone can always grow and a preempted one can always be re-admitted.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine_core.kv_cache import KVCacheManager
from tidal.engine_core.request import Request, RequestStatus
from tidal.engine_core.structured import GrammarBackend, NoTokenAllowed, first_line
from tidal.executor.batch import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    RequestTimings,
    SchedulerStats,
)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

logger = logging.getLogger(__name__)

# Step sizes kept for the next stats message: an engine that runs many steps without an
# output (a long chunked prefill) sends the newest.
ITERATION_TOKENS_KEPT = 256


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        grammars: GrammarBackend | None = None,
        kv_windows: Sequence[int | None] = (None,),
    ) -> None:
        """``grammars``: compiles structured-output requests' grammars (None: such a
        request is refused). ``kv_windows``: the model's KV cache groups
        (``KVCacheSpec.group_windows``: blocks wholly behind a group's window are freed
        while a request runs; None: kept)."""
        self.config = scheduler_config
        self.grammars = grammars
        self.max_model_len = scheduler_config.max_model_len
        self.async_scheduling = scheduler_config.async_scheduling
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_windows
        )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_requests_total = 0  # requests ever admitted (for load dashboards)
        self.num_generation_tokens_total = 0  # output tokens ever appended (ditto)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order = priority order
        # Finished/aborted since the last schedule(): the runner drops their state.
        self._finished_req_ids: set[str] = set()
        # Finished/aborted since the last update_from_output(), per client.
        self._finished_by_client: dict[int, set[str]] = defaultdict(set)
        # request id -> prompt tokens 1..n whose logprobs were sent (recompute resends).
        self._prompt_logprobs_sent: dict[str, int] = {}
        self.num_preemptions = 0  # cumulative
        self._abandoned = 0  # preempted by abandon_step, not yet taken
        # Requests failed outside a step's update (their grammar did not compile, or their
        # outputs did not replay): reported with the next update_from_output.
        self._failed_outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        # request id -> why its bitmask could not be made in the step just scheduled
        # (the request fails in that step's update).
        # request id -> (why its grammar failed it, whether that is its own input's fault)
        self._grammar_errors: dict[str, tuple[str, bool]] = {}
        self._num_structured = 0  # unfinished requests with a grammar: 0 skips the bitmasks
        self._iteration_tokens: deque[int] = deque(maxlen=ITERATION_TOKENS_KEPT)

    # ---- request lifecycle ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ``ValueError`` if it is invalid or could never be served."""
        self._validate(request)
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this engine has no grammar backend")
            # What ends this request is what its grammar may end with.
            ends = (
                []
                if request.eos_token_id is None or request.sampling_params.ignore_eos
                else [request.eos_token_id]
            )
            ends += sorted(request.stop_token_ids)
            request.grammar = self.grammars.request_grammar(spec, ends)
            self._num_structured += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_requests_total += 1

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Client aborts: free blocks, no EngineCoreOutput; unknown ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, frontend stop strings). Produces no
        EngineCoreOutput; the ids go to the next ``finished_req_ids``/``finished_requests``."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:  # already finished: a normal race with the engine
                continue
            req.status = status
            self._release(req)
            removed.add(rid)
        if removed:
            self.running = [r for r in self.running if r.request_id not in removed]
            self.waiting = deque(r for r in self.waiting if r.request_id not in removed)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """Finishes not yet reported to the runner or the clients (e.g. aborts)."""
        return bool(self._finished_req_ids or self._finished_by_client)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return [r.request_id for r in (*self.running, *self.waiting)]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def make_stats(self, take_steps: bool = False) -> SchedulerStats:
        """Counts now; prefix-cache, preemption, request and generated-token counters are
        cumulative since start. With ``take_steps`` (the outputs to the clients, alone),
        ``iteration_tokens`` are the steps' sizes since the last such call. ``step_counter``
        and ``current_wave`` are the engine core's to fill."""
        kv = self.kv_cache_manager
        steps: list[int] = []
        if take_steps:
            steps = list(self._iteration_tokens)
            self._iteration_tokens.clear()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preempted=self.num_preemptions,
            num_requests_total=self.num_requests_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            iteration_tokens=steps,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        # Admitting new work right after preempting for lack of blocks would only
        # thrash: the preempted requests would have to be preempted again.
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        if out.total_num_scheduled_tokens:
            self._iteration_tokens.append(out.total_num_scheduled_tokens)
        self._fill_bitmasks(out)
        return out

    def _fill_bitmasks(self, out: SchedulerOutput) -> None:
        """The next-token bitmask of every structured request that samples in ``out``."""
        if self.grammars is None or not self._num_structured:
            return
        todo: list[Request] = []
        for sr in out.scheduled:
            req = sr.request
            assert isinstance(req, Request)  # the scheduler's own
            if req.grammar is None or not sr.samples:
                continue
            # Kept in step by admission and update; a mismatch would be a bug, and the
            # request (not the engine) pays for it.
            if req.grammar.sync(req.output_token_ids):
                if req.grammar.active:  # a dormant one (before starts_after) masks nothing
                    todo.append(req)
            else:
                self._grammar_errors[req.request_id] = (
                    "structured_outputs: its output tokens do not match its grammar",
                    False,
                )
        if not todo:
            return
        masks = self.grammars.bitmasks([r.grammar for r in todo if r.grammar is not None])
        for r, m in zip(todo, masks):
            if isinstance(m, Exception):
                own = isinstance(m, NoTokenAllowed)
                self._grammar_errors[r.request_id] = (f"structured_outputs: {first_line(m)}", own)
            else:
                out.grammar_bitmask[r.request_id] = m

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        block_size = self.kv_cache_manager.block_size
        groups = self.kv_cache_manager.num_groups  # block_ids interleaves their tables
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_output_placeholders
            start = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) + pending - start, budget)
            if num_new <= 0 or (pending and self._holds_back(req)):
                i += 1  # waiting for a token the runner has not returned
                continue
            # Most steps a decode fits the blocks it has: no allocation call.
            if start + num_new > len(req.block_ids) // groups * block_size and not (
                self._allocate_or_preempt(req, num_new, out)
            ):
                break  # it preempted itself, so it was the last running request
            self._add_scheduled(out, req, num_new)
            budget -= num_new
            i += 1
        return budget

    def _holds_back(self, req: Request) -> bool:
        """Async scheduling: whether ``req``, whose last token is not known yet, must wait
        for it instead of being scheduled on a placeholder: its pending tokens already
        reach its length cap (no extra token to discard), or its sampling reads its
        outputs' values."""
        pending = req.num_output_placeholders
        return (
            req.reads_outputs
            or req.num_output_tokens + pending >= req.max_tokens
            or req.num_tokens + pending >= self.max_model_len
        )

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        # Victims come from the tail, which is never before ``req``: nothing already
        # scheduled in this step loses its blocks.
        while not self.kv_cache_manager.allocate_slots(req, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.add(victim.request_id)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv_cache_manager
        passed_over: list[Request] = []  # grammars still compiling, in queue order
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and not self._grammar_ready(req):
                self.waiting.popleft()
                if not req.is_finished:
                    passed_over.append(req)
                continue
            hit_blocks, num_hit = self._lookup_prefix(req)
            num_new = req.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(req, num_new, hit_blocks, num_hit):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if self._uses_prefix_cache(req):
                kv.record_prefix_cache_query(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            self._add_scheduled(out, req, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))
        return budget

    def _grammar_ready(self, req: Request) -> bool:
        """Whether ``req`` may be admitted now: its grammar compiled and its outputs so far
        (a resumed request's) replayed. A grammar that cannot be used fails the request
        (it is then finished, and already out of the queue)."""
        g = req.grammar
        assert g is not None
        if not g.ready:
            return False
        error = g.error
        if error is None and not g.sync(req.output_token_ids):
            error = "its output tokens so far do not match its grammar"
        if error is None:
            return True
        output = self._fail_request(req, f"structured_outputs: {error}")
        self._failed_outputs[req.client_index].append(output)
        return False

    def _uses_prefix_cache(self, req: Request) -> bool:
        # Prompt logprobs need logits at every prompt position, so no skipping.
        return (
            self.kv_cache_manager.enable_prefix_caching
            and req.sampling_params.prompt_logprobs is None
        )

    def _lookup_prefix(self, req: Request) -> tuple[list[int], int]:
        if not self._uses_prefix_cache(req):
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(req)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        num_tokens = len(req.all_token_ids)
        # A chunk past the known tokens is the one placeholder of a decode.
        out.scheduled.append(ScheduledRequest(req, start, num_new, start >= num_tokens))
        req.num_computed_tokens = end = start + num_new
        if self.async_scheduling and end == num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1  # it samples: the next decode may feed on it

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop the KV, go back to the front of the queue."""
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        # A pending token still arrives (the step that samples it ran) and is appended;
        # the re-prefill then computes it like any other.
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def abandon_step(self, sched: SchedulerOutput | None = None) -> int:
        """A step that will never complete (its collective failed: docs/architecture.md#faults): every
        running request is preempted by recompute -- its KV may be half-written, and the
        tokens it was computing never reached anyone -- in its order, ahead of the
        waiting ones; the abandoned step's finish notices go to the next step; the prefix
        cache is emptied (blocks cached for this step may hold garbage). Output tokens
        already produced stay: the re-prefill recomputes exactly the same state.
        Returns how many requests were preempted."""
        if sched is not None:
            self._finished_req_ids |= sched.finished_req_ids
        self._grammar_errors.clear()  # the abandoned steps' are void
        preempted = 0
        while self.running:
            self._preempt(self.running.pop())  # last first: appendleft keeps the order
            preempted += 1
        self.kv_cache_manager.reset_prefix_cache()
        self._abandoned += preempted
        return preempted

    def take_abandoned(self) -> int:
        """Requests preempted by ``abandon_step`` since the last call."""
        n, self._abandoned = self._abandoned, 0
        return n

    # ---- update --------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply one step's results; returns outputs grouped by ``client_index``.

        ``runner_output.prompt_logprobs[rid][k]`` is taken to be the entry of prompt
        token ``start + 1 + k`` (from the logits at position ``start + k`` of the slice).
        """
        per_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        any_finished = any_preempted = False
        requests = self.requests
        failed = runner_output.failed
        grammar_errors = self._grammar_errors
        sampled = runner_output.sampled_token_ids
        # The step's parts that most steps lack are looked up only when present.
        kv = self.kv_cache_manager
        step = _StepOutput(
            runner_output,
            kv.block_size if kv.enable_prefix_caching else 0,
            bool(runner_output.logprobs),
            bool(runner_output.prompt_logprobs),
        )
        for sched in scheduler_output.scheduled:
            req = sched.request
            if requests.get(req.request_id) is not req:
                continue  # finished from outside since it was scheduled (or, async, by
                # a stop in the step before: this step's extra token is dropped here)
            assert isinstance(req, Request)  # the scheduler's own
            # Async: preempted by the step scheduled after this one (it is in waiting).
            any_preempted |= req.status is RequestStatus.PREEMPTED
            error = None
            invalid = False  # the error is the request's own input's (HTTP 400), not ours
            if failed or grammar_errors:
                error = failed.get(req.request_id)
                if error is None and req.request_id in grammar_errors:
                    error, invalid = grammar_errors.pop(req.request_id)
            if error is None and req.grammar is not None:
                error = _advance_grammar(req, sampled.get(req.request_id))
            output: EngineCoreOutput | None = None
            try:
                if error is None:
                    output = self._update_request(req, sched, step)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                logger.exception("updating request %r failed", req.request_id)
                error = f"internal error while updating the request: {type(e).__name__}: {e}"
            if error is not None:
                output = self._fail_request(req, error, invalid=invalid)
            if output is not None:
                per_client[req.client_index].append(output)
                any_finished |= output.finish_reason is not None
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            if any_preempted:
                self.waiting = deque(r for r in self.waiting if not r.is_finished)
        for client, outputs in self._failed_outputs.items():
            per_client[client].extend(outputs)
        self._failed_outputs.clear()
        return self._group_outputs(per_client)

    def _update_request(
        self, req: Request, sched: ScheduledRequest, step: _StepOutput
    ) -> EngineCoreOutput | None:
        """Append ``req``'s sampled tokens of the step, apply the stop rules; its output
        (None when there is nothing to say). The per-request cost of every step at high
        batch sizes: a decode's path is a few attribute reads and one struct."""
        rid = req.request_id
        if req.num_output_placeholders and sched.samples:
            req.num_output_placeholders -= 1  # its token is here (or the step failed it)
        if step.block_size and req.num_computed_tokens >= (req.num_cached_blocks + 1) * (
            step.block_size
        ):  # a block filled: offer it to the prefix cache, before a finish frees it
            self.kv_cache_manager.cache_computed_blocks(req)
        tokens = step.output.sampled_token_ids.get(rid)
        new_tokens: list[int] = []
        if tokens:
            outputs, all_ids = req.output_token_ids, req.all_token_ids
            for token in tokens:
                outputs.append(token)
                all_ids.append(token)
                new_tokens.append(token)
                # Only a stopping token, a length cap or a grammar can stop it.
                if (
                    token in req.stopping_token_ids
                    or len(outputs) >= req.max_tokens
                    or len(all_ids) >= self.max_model_len
                    or req.grammar is not None
                ) and self._check_stop(req):
                    break
            self.num_generation_tokens_total += len(new_tokens)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
        prompt_lps = self._new_prompt_logprobs(sched, step.output) if step.prompt_lps else None
        finished = req.status >= RequestStatus.FINISHED_STOPPED
        if not (new_tokens or prompt_lps or finished):
            return None
        logprobs = None
        if step.logprobs and (logprobs := step.output.logprobs.get(rid)) is not None:
            logprobs = logprobs[: len(new_tokens)]
        if not finished:  # (num_cached_tokens is set once it was scheduled)
            return EngineCoreOutput(rid, new_tokens, logprobs, prompt_lps, None, None,
                                    req.num_cached_tokens)  # fmt: skip
        self._release(req)
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_lps,
            finish_reason=_FINISH_REASONS[req.status],
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            timings=_timings(req),
        )

    def _fail_request(
        self, req: Request, message: str, *, invalid: bool = False
    ) -> EngineCoreOutput:
        """Finish ``req`` with an error, alone. Its blocks are freed without being cached:
        this step did not write their KV, so a prefix-cache entry would serve garbage.
        ``invalid``: the request's own input is at fault (the API answers 400)."""
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = message
        if self.requests.get(req.request_id) is req:
            self._release(req)
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            stop_reason=message,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            timings=_timings(req),
            invalid_request=invalid,
        )

    def _check_stop(self, req: Request) -> bool:
        """Stop rules after appending one token (vLLM order); sets status/stop_reason."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated:
            # The grammar took its end token (the request's EOS or a stop id; with
            # ignore_eos and no stop ids, the model's EOS): nothing may follow it.
            req.status = RequestStatus.FINISHED_STOPPED
            if last in req.stop_token_ids:
                req.stop_reason = last
            return True
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in req.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _new_prompt_logprobs(
        self, sched: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> list[Logprobs] | None:
        """This step's prompt logprobs minus positions already sent before a preemption."""
        rid = sched.request.request_id
        lps = runner_output.prompt_logprobs.get(rid)
        if not lps:
            return None
        sent = self._prompt_logprobs_sent.get(rid, 0)
        new = lps[max(0, sent - sched.start) :]
        if not new:
            return None
        self._prompt_logprobs_sent[rid] = sched.start + len(lps)
        return new

    def _group_outputs(
        self, per_client: dict[int, list[EngineCoreOutput]]
    ) -> dict[int, EngineCoreOutputs]:
        if not per_client and not self._finished_by_client:
            return {}
        stats = self.make_stats(take_steps=True)
        result = {}
        for client in per_client.keys() | self._finished_by_client.keys():
            finished = self._finished_by_client.get(client)
            result[client] = EngineCoreOutputs(
                outputs=per_client.get(client, []),
                scheduler_stats=stats,
                finished_requests=finished or None,
            )
        self._finished_by_client.clear()
        return result

    # ---- helpers -------------------------------------------------------------------

    def _release(self, req: Request) -> None:
        """Forget a finished request (status already set); caller fixes the queues."""
        self.kv_cache_manager.free(req)
        rid = req.request_id
        del self.requests[rid]
        self._prompt_logprobs_sent.pop(rid, None)
        self._grammar_errors.pop(rid, None)
        if req.grammar is not None:
            self._num_structured -= 1
        self._finished_req_ids.add(rid)
        self._finished_by_client[req.client_index].add(rid)

    def _validate(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if n > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt has {n} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        # Most tokens it can ever hold KV for: all but the last one it can reach.
        final = max(n + 1, min(n + req.max_tokens, self.max_model_len))
        need_tokens = final - 1
        kv = self.kv_cache_manager
        # At most one budget of new tokens a step (a whole prompt without chunked prefill:
        # checked below to fit the budget).
        peak = kv.peak_blocks_for(need_tokens, self.config.max_num_batched_tokens)
        if peak > kv.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} may need KV for {need_tokens} tokens "
                f"({peak} blocks) but the cache holds only "
                f"{kv.num_usable_blocks} blocks; lower max_tokens or enlarge the KV cache"
            )
        if (
            not self.config.enable_chunked_prefill
            and need_tokens > self.config.max_num_batched_tokens
        ):
            raise ValueError(
                f"request {rid!r} may need {need_tokens} tokens in one step, more than "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) without "
                "chunked prefill"
            )


class _StepOutput(NamedTuple):
    """A step's runner output and which of its optional parts it has."""

    output: ModelRunnerOutput
    block_size: int  # with prefix caching (full blocks are offered to it), else 0
    logprobs: bool
    prompt_lps: bool


def _advance_grammar(req: Request, tokens: list[int] | None) -> str | None:
    """Advance ``req``'s matcher by this step's sampled tokens (the mask allowed them: a
    refusal is a fault of this request alone). Returns the error, if any."""
    assert req.grammar is not None
    for token in tokens or ():
        if not req.grammar.accept(token):
            return f"structured_outputs: token {token} is not allowed by its grammar"
    return None


def _timings(req: Request) -> RequestTimings:
    """A finished request's phases (docs/operations.md#metrics); a phase it never reached
    is 0 and the time goes to the one it was in."""
    now = time.monotonic()
    scheduled = req.scheduled_time if req.scheduled_time is not None else now
    first = req.first_token_time if req.first_token_time is not None else now
    return RequestTimings(
        queued_s=scheduled - req.queued_time,
        prefill_s=max(first - scheduled, 0.0),
        decode_s=max(now - first, 0.0),
    )
