"""The OpenAI serving logic: ``/v1/completions`` and ``/v1/chat/completions`` (SSE
streaming or not) and ``/v1/models``, turned into ``engine.generate`` calls.

Tokenization, chat templates and body parsing run off the event loop, so one huge request
does not stall the other streams. A client that hangs up cancels its work, which aborts
its engine requests; so does one that stops reading its stream (``max_stream_backlog``
outputs queued for it), whose connection is then dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, assert_never

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tidal.config import FrontendConfig
from tidal.engine_core.structured import check_spec, spec_key
from tidal.frontend.outputs import CompletionOutput, OutputKind, PromptLogprobs, RequestOutput
from tidal.frontend.processor import ProcessedPrompt
from tidal.frontend.template_sandbox import SandboxUnavailable, TemplateSandbox
from tidal.launch import openai_models as P
from tidal.launch.connections import ABORT_CONNECTION, ServerLimits
from tidal.launch.errors import APIError, classify_error
from tidal.launch.http_limits import read_json
from tidal.launch.reasoning import (
    ReasoningParser,
    ReasoningStream,
    count_reasoning_tokens,
    reasoning_parser,
)
from tidal.launch.tool_parsers import (
    ChatOutputStream,
    ForcedToolStream,
    MarkupToolStream,
    ToolCallDelta,
    ToolMode,
    ToolParser,
    ToolStream,
    assemble,
    tool_parser,
)
from tidal.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the server takes any engine with AsyncLLM's
    # interface and imports no torch (AsyncLLM does), so tests run it on a fake engine.
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client hangs up first; then cancel it (which aborts the
    engine requests it iterates) and raise ClientGone. The request body must be read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # no-op once done; cancelling unwinds its generate() iterators
    if task not in done:
        raise ClientGone()
    return task.result()


class StreamBacklogExceeded(APIError):
    """A streaming client stopped reading: its outputs piled up on the server."""

    def __init__(self, request_id: str, limit: int) -> None:
        super().__init__(
            408,
            f"request {request_id} aborted: the client did not read its stream and "
            f"{limit} outputs were queued for it (the server's --max-stream-backlog)",
            code="stream_backlog_exceeded",
        )


class ConnectionDropped(Exception):
    """The stream's connection was dropped: nothing more can be sent on it."""


Dropper = Callable[[], None] | None


def connection_dropper(request: Request) -> Dropper:
    """Drops the request's connection at once, where the server offers that (see
    ``connections``; None where not); a plain close would wait for the client to read
    what is queued, which it does not."""
    return request.scope.get("extensions", {}).get(ABORT_CONNECTION)


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class _Job:
    """One engine request: a prompt of the batch, its params, and its first choice index."""

    prompt: ProcessedPrompt
    params: SamplingParams
    request_id: str
    first_choice: int
    data_parallel_rank: int | None
    # Chat: splits each choice's text into reasoning, content and tool calls (None: the
    # text is the content).
    parse_output: Callable[[], ChatOutputStream] | None = None


@dataclass
class _Final:
    """A finished job: its choices by index within the job, the prompt's logprobs, and
    how many prompt tokens the prefix cache held."""

    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0


_END = object()


class OpenAIServing:
    """Turns OpenAI requests into ``engine.generate`` calls and outputs into responses."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        max_stream_backlog: int | None = None,
        on_backlog_abort: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        # Outputs a stream may have waiting for its client before its requests are aborted.
        self.max_stream_backlog = max_stream_backlog or ServerLimits.max_stream_backlog
        self.on_backlog_abort = on_backlog_abort  # counts them (metrics)
        self.model_name = served_model_name
        self.model_path = engine.config.model.model
        self.max_model_len = engine.config.model.max_model_len
        # The checkpoint's recommended sampling values: the defaults of unset fields.
        self.sampling_defaults = dict(engine.config.model.sampling_defaults)
        self.tokenizer = engine.tokenizer
        self.limits: FrontendConfig = engine.config.frontend
        # Structured-output compile checks running, by spec and field (check_grammar).
        self._grammar_checks: dict[tuple[bytes, str], asyncio.Future[None]] = {}
        # Request-supplied chat templates: refused unless the flag allows them, and then
        # rendered in a killable worker (started by the first such request).
        self.template_sandbox: TemplateSandbox | None = None
        if self.limits.trust_request_chat_template:
            self.template_sandbox = TemplateSandbox(
                engine.config.model.tokenizer, max_chars=self.limits.max_request_body_bytes
            )
        name = self.limits.tool_call_parser
        self.tool_parser: ToolParser | None = tool_parser(name) if name else None
        name = self.limits.reasoning_parser
        self.reasoning_parser: ReasoningParser | None = reasoning_parser(name) if name else None

    # -- checks --

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.model_path):
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, "engine is dead", code="engine_dead")

    def check_sizes(self, data: Any) -> None:
        """The request limits on the raw JSON body, before anything walks it (the
        ``precheck`` of ``read_json``): a body of a million stop ids or a fan-out of
        32,768 choices is refused in milliseconds. Values of the wrong type are left to
        the type checks that follow."""
        if not isinstance(data, dict):
            return
        stop, ids, n, prompt = (data.get(k) for k in ("stop", "stop_token_ids", "n", "prompt"))
        self.limits.check_sizes(
            n=n if type(n) is int else 1,
            num_prompts=_num_prompts(prompt),
            stop=[stop] if isinstance(stop, str) else stop if isinstance(stop, list) else (),
            stop_token_ids=ids if isinstance(ids, list) else (),
        )

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(
            id=self.model_name, root=self.model_path, max_model_len=self.max_model_len
        )

    async def check_grammar(self, req: Any) -> None:
        """The request's structured-output spec, compiled on a thread (a 400 naming its
        field when it does not compile): a heavy schema takes a tenth of a second, which
        on the event loop would stall every other stream. Requests that bring the same
        spec at once share one compile; ``check_spec`` remembers specs that compiled, so
        later ones, and the checks that follow on the loop (``_job``), are lookups."""
        for name, spec in req.grammar_checks():
            key = (spec_key(spec), name)  # the error names the field
            pending = self._grammar_checks.get(key)
            if pending is None:
                pending = asyncio.ensure_future(asyncio.to_thread(check_spec, spec, name))
                self._grammar_checks[key] = pending
                pending.add_done_callback(lambda f, key=key: self._check_done(key, f))
            # Shielded: a client that hangs up does not cancel the others' compile.
            await asyncio.shield(pending)

    def _check_done(self, key: tuple[bytes, str], check: asyncio.Future[None]) -> None:
        self._grammar_checks.pop(key, None)
        if not check.cancelled():
            check.exception()  # retrieved: every waiter may have gone

    def _job(self, req: Any, prompt: ProcessedPrompt, request_id: str, first_choice: int) -> _Job:
        prompt = truncate_prompt(
            prompt, req.truncate_prompt_tokens, req.truncation_side, self.max_model_len
        )
        default_max = max(1, self.max_model_len - len(prompt.prompt_token_ids))
        default_max = min(default_max, self.sampling_defaults.get("max_tokens", default_max))
        params = req.sampling_params(default_max, self.sampling_defaults)
        # Checked here too (generate checks again) so a streaming request gets a 400 (or
        # a 503 for a rank that is dead) before the SSE response starts.
        self.engine.input_processor.check(prompt, params)
        check_rank = getattr(self.engine, "check_data_parallel_rank", None)  # not on doubles
        if check_rank is not None:
            check_rank(req.data_parallel_rank)
        return _Job(prompt, params, request_id, first_choice, req.data_parallel_rank)

    # -- engine iteration --

    def _generate(self, job: _Job, kind: OutputKind) -> Any:
        return self.engine.generate(
            job.prompt,
            job.params,
            job.request_id,
            output_kind=kind,
            data_parallel_rank=job.data_parallel_rank,
        )

    async def _final(self, job: _Job) -> _Final:
        """All of one job's choices, finished."""
        final = _Final()
        async with contextlib.aclosing(self._generate(job, OutputKind.FINAL_ONLY)) as gen:
            async for out in gen:
                for c in out.outputs:
                    final.outputs[c.index] = c
                if out.prompt_logprobs is not None:
                    final.prompt_logprobs = out.prompt_logprobs
                final.num_cached_tokens = max(final.num_cached_tokens, out.num_cached_tokens)
        return final

    async def collect(self, jobs: list[_Job]) -> list[_Final]:
        tasks = [asyncio.ensure_future(self._final(j)) for j in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            # Where one job failed, gather raised and left the others running: cancel them
            # (each closes its generate(), aborting its engine request), or they would
            # generate to max_tokens for nobody. No-op for the finished ones.
            for t in tasks:
                t.cancel()

    async def merged(
        self, jobs: list[_Job], drop_connection: Dropper = None
    ) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """DELTA outputs of all jobs as they come, as (job index, output).

        One producer task per job; closing this iterator cancels them, and a cancelled
        producer closes its ``generate`` iterator, which aborts the engine request.

        The consumer writes to the client, so it stops while the client does not read;
        the producers do not. A producer that finds ``max_stream_backlog`` of its outputs
        waiting (counted per job: one step of a batch of prompts brings an output for
        each) stops, aborting its engine request, and calls ``drop_connection``, which
        ends the stream (and so the other producers) without waiting for the client; this
        then raises ConnectionDropped. Without ``drop_connection`` the consumer gets the
        StreamBacklogExceeded, for an error event."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        waiting = [0] * len(jobs)  # outputs of each job in the queue

        async def produce(i: int, job: _Job) -> None:
            try:
                async with contextlib.aclosing(self._generate(job, OutputKind.DELTA)) as gen:
                    async for out in gen:
                        if waiting[i] >= self.max_stream_backlog:
                            raise StreamBacklogExceeded(job.request_id, self.max_stream_backlog)
                        waiting[i] += 1
                        queue.put_nowait((i, out))
                queue.put_nowait((i, _END))
            except StreamBacklogExceeded as e:
                logger.warning("%s", e)  # the client may never read the error event
                self.on_backlog_abort()
                queue.put_nowait((i, e))
                if drop_connection is not None:
                    drop_connection()
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(produce(i, j)) for i, j in enumerate(jobs)]
        try:
            remaining = len(jobs)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, StreamBacklogExceeded) and drop_connection is not None:
                    raise ConnectionDropped()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    waiting[i] -= 1
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    # -- /v1/completions --

    async def completion_jobs(self, req: P.CompletionRequest, request_id: str) -> list[_Job]:
        batch = self._completion_batch(req)
        tokenize = self.engine.input_processor.tokenize
        # Off the event loop: a long prompt must not stall the other streams.
        prompts = await asyncio.to_thread(lambda: [tokenize(p) for p in batch])
        n, multi = req.n or 1, len(prompts) > 1
        return [
            self._job(req, p, f"{request_id}-{i}" if multi else request_id, i * n)
            for i, p in enumerate(prompts)
        ]

    def _completion_batch(self, req: P.CompletionRequest) -> list[Any]:
        """A string, token ids, or a batch of either -> the list of prompts (prompts x n
        within the request limits)."""
        prompt = req.prompt
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        self.limits.check_sizes(n=req.n or 1, num_prompts=len(batch))
        return batch

    async def completion(self, req: P.CompletionRequest, request: Request) -> Response:
        rid, created = P.random_id("cmpl"), P.now_s()
        jobs = await self.completion_jobs(req, rid)
        if req.stream:
            stream = self._completion_stream(req, jobs, rid, created, connection_dropper(request))
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        finals = await until_disconnect(request, self.collect(jobs))
        choices = [
            self._completion_choice(req, job, c, echo=bool(req.echo), prompt_lps=f.prompt_logprobs)
            for job, f in zip(jobs, finals)
            for c in sorted(f.outputs.values(), key=lambda c: c.index)
        ]
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs.values())
        cached = sum(f.num_cached_tokens for f in finals)
        resp = P.CompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=P.UsageInfo.of(_prompt_tokens(jobs), completion_tokens, cached),
        )
        return JSONResponse(resp.model_dump())

    def _completion_choice(
        self,
        req: P.CompletionRequest,
        job: _Job,
        c: CompletionOutput,
        *,
        echo: bool,
        prompt_lps: PromptLogprobs | None = None,
        offset: int = 0,
        first: bool = True,
    ) -> P.CompletionChoice:
        """One choice (or one streamed delta of it); ``echo`` prepends the prompt;
        ``offset`` is the number of characters of this choice already sent;
        ``prompt_lps`` are reported (vLLM's ``prompt_logprobs``) where the request
        asked for them; ``first``: the choice's first chunk, which carries the prompt's
        ids under ``return_token_ids``."""
        text, ids = c.text, list(c.token_ids)
        steps: PromptLogprobs = list(c.logprobs or [])
        if echo:
            n = len(job.prompt.prompt_token_ids)
            text = self._prompt_text(job.prompt) + text
            ids = job.prompt.prompt_token_ids + ids
            steps = (list(prompt_lps or []) + [None] * n)[:n] + steps
        lps = None
        as_ids, with_ids = bool(req.return_tokens_as_token_ids), bool(req.return_token_ids)
        if job.params.logprobs is not None:
            lps = P.completion_logprobs(
                ids, steps, job.params.logprobs, self.tokenizer, offset, as_ids
            )
        return P.CompletionChoice(
            index=job.first_choice + c.index,
            text=text,
            logprobs=lps,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=_prompt_logprobs(req, prompt_lps),
            prompt_token_ids=job.prompt.prompt_token_ids if with_ids and first else None,
            token_ids=list(c.token_ids) if with_ids else None,
        )

    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.prompt is not None:
            return prompt.prompt
        return self.tokenizer.decode(prompt.prompt_token_ids)

    async def _completion_stream(
        self,
        req: P.CompletionRequest,
        jobs: list[_Job],
        rid: str,
        created: int,
        drop_connection: Dropper,
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice index -> characters already sent
        tokens: dict[int, int] = {}  # choice index -> tokens already sent
        prompt_lps: dict[int, PromptLogprobs] = {}  # job -> prompt logprobs (first output)
        cached: dict[int, int] = {}  # job -> prompt tokens found in the prefix cache

        def chunk(choices: list[P.CompletionChoice], usage: bool) -> str:
            u = None
            if usage:
                u = P.UsageInfo.of(_prompt_tokens(jobs), sum(tokens.values()), sum(cached.values()))
            resp = P.CompletionResponse(
                id=rid, created=created, model=self.model_name, choices=choices, usage=u
            )
            return _sse(resp)

        def delta(i: int, c: CompletionOutput) -> P.CompletionChoice:
            idx = jobs[i].first_choice + c.index
            first = idx not in offsets
            choice = self._completion_choice(
                req,
                jobs[i],
                c,
                echo=bool(req.echo) and first,
                prompt_lps=prompt_lps.get(i) if first else None,
                offset=offsets.get(idx, 0),
                first=first,
            )
            offsets[idx] = offsets.get(idx, 0) + len(choice.text)
            tokens[idx] = tokens.get(idx, 0) + len(c.token_ids)
            return choice

        try:
            async with contextlib.aclosing(self.merged(jobs, drop_connection)) as outputs:
                async for i, out in outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = out.prompt_logprobs
                    cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                    for c in out.outputs:
                        yield chunk([delta(i, c)], req.continuous_usage)
            if req.include_usage:
                yield chunk([], True)
        except ConnectionDropped:
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
            yield _sse(classify_error(e, self.engine).body())
        yield _DONE

    # -- /v1/chat/completions --

    async def chat_job(self, req: P.ChatCompletionRequest, request_id: str) -> _Job:
        job = self._job(req, await self.render_chat(req), request_id, 0)
        self._grammar_after_thinking(job)
        job.parse_output = self._output_parsing(req, req.tool_mode, job)
        return job

    async def render_chat(self, req: Any) -> ProcessedPrompt:
        """The prompt of a chat request (``ChatCompletionRequest``, or anything with its
        ``messages``, template and generation-prompt fields: ``/tokenize``'s)."""
        if req.chat_template is not None and self.template_sandbox is None:
            raise APIError(
                400,
                "chat_template: request-supplied chat templates are disabled on this server "
                "(start it with --trust-request-chat-template to allow them)",
                param="chat_template",
            )
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = [m.to_template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if isinstance(req, P.ChatCompletionRequest):  # /tokenize's request has no tools
            mode = req.tool_mode
            if mode is ToolMode.AUTO:
                if self.tool_parser is None:
                    raise APIError(
                        400,
                        "tool_choice: 'auto' (the default when tools are given) needs the server "
                        "started with --tool-call-parser; send 'required', a named function or "
                        "'none' instead",
                        param="tool_choice",
                    )
                # Formats whose markers are special tokens must see them in the text.
                req.skip_special_tokens = False
            if req.tools:
                kwargs["tools"] = req.template_tools
        processor = self.engine.input_processor
        processor.check_chat(messages, kwargs)  # roles, reserved kwargs: before any rendering
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        add_gen = bool(req.add_generation_prompt) and not req.continue_final_message
        try:
            if req.chat_template is None:
                # Off the event loop, like tokenization.
                prompt = await asyncio.to_thread(
                    processor.apply_chat_template, messages, add_gen, None, **kwargs
                )
            else:
                sandbox = self.template_sandbox
                if sandbox is None:  # refused above, before any work
                    raise SandboxUnavailable("chat_template: per-request templates are off")
                text, ids = await sandbox.render(
                    messages,
                    chat_template=req.chat_template,
                    add_generation_prompt=add_gen,
                    kwargs=kwargs,
                )
                prompt = ProcessedPrompt(text, ids)
        except (ValueError, SandboxUnavailable):
            raise  # a 400 with its own message; a broken sandbox is the server's fault (500)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return prompt

    def _grammar_after_thinking(self, job: _Job) -> None:
        """A constrained reply that starts inside the thinking is constrained once the
        thinking ends (as vLLM does): the grammar starts after the end marker's tokens."""
        rp, spec = self.reasoning_parser, job.params.structured_outputs
        if rp is None or spec is None or not rp.starts_in_reasoning(job.prompt.prompt):
            return
        _, ids = self._thinking_marker_ids
        job.params.structured_outputs = msgspec.structs.replace(spec, starts_after=ids)

    @functools.cached_property
    def _thinking_marker_ids(self) -> tuple[list[int], list[int]]:
        """The reasoning parser's start and end markers as the tokenizer spells them."""
        rp = self.reasoning_parser
        assert rp is not None
        encode = self.tokenizer.encode
        return encode(rp.start, add_special_tokens=False), encode(rp.end, add_special_tokens=False)

    def reasoning_tokens(self, job: _Job, token_ids: Sequence[int]) -> int:
        """How many of a chat output's tokens are thinking (0 without a reasoning parser)."""
        rp = self.reasoning_parser
        if rp is None:
            return 0
        start, end = self._thinking_marker_ids
        thinking = rp.starts_in_reasoning(job.prompt.prompt)
        return count_reasoning_tokens(token_ids, thinking, start, end)

    def _output_parsing(
        self, req: P.ChatCompletionRequest, mode: ToolMode, job: _Job
    ) -> Callable[[], ChatOutputStream] | None:
        """What splits the request's outputs, if anything does."""
        rp, parser, prompt = self.reasoning_parser, self.tool_parser, job.prompt.prompt
        choice = req.tool_choice
        max_calls = None if _or_true(req.parallel_tool_calls) else 1

        def tools() -> ToolStream | None:
            match mode:
                case ToolMode.NONE:
                    return None
                case ToolMode.AUTO:
                    assert parser is not None  # refused in chat_job otherwise
                    return MarkupToolStream(parser, max_calls)
                case ToolMode.REQUIRED:
                    return ForcedToolStream(None)
                case ToolMode.NAMED:
                    assert isinstance(choice, P.NamedToolChoice)
                    return ForcedToolStream(choice.function.name)
                case _:
                    assert_never(mode)

        if rp is None and mode is ToolMode.NONE:
            return None
        return lambda: ChatOutputStream(
            None if rp is None else ReasoningStream(rp, prompt), tools()
        )

    async def chat(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        rid, created = P.random_id("chatcmpl"), P.now_s()
        job = await self.chat_job(req, rid)
        if req.stream:
            stream = self._chat_stream(req, job, rid, created, connection_dropper(request))
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        (final,) = await until_disconnect(request, self.collect([job]))
        outs = sorted(final.outputs.values(), key=lambda c: c.index)
        with_ids = bool(req.return_token_ids)
        choices = [
            P.ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._chat_logprobs(req, job, c),
                finish_reason=finish,
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if with_ids else None,
            )
            for c in outs
            for message, finish in [_chat_message(job, c)]
        ]
        usage = P.UsageInfo.of(
            _prompt_tokens([job]), sum(len(c.token_ids) for c in outs), final.num_cached_tokens
        )
        resp = P.ChatCompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=_prompt_logprobs(req, final.prompt_logprobs),
            prompt_token_ids=job.prompt.prompt_token_ids if with_ids else None,
        )
        return JSONResponse(resp.model_dump())

    def _chat_logprobs(
        self, req: P.ChatCompletionRequest, job: _Job, c: CompletionOutput
    ) -> P.ChatLogProbs | None:
        if job.params.logprobs is None:
            return None
        as_ids = bool(req.return_tokens_as_token_ids)
        return P.chat_logprobs(
            c.token_ids, c.logprobs or [], job.params.logprobs, self.tokenizer, as_ids
        )

    async def _chat_stream(
        self,
        req: P.ChatCompletionRequest,
        job: _Job,
        rid: str,
        created: int,
        drop_connection: Dropper,
    ) -> AsyncIterator[str]:
        tokens: dict[int, int] = {}
        cached = 0  # prompt tokens found in the prefix cache
        parsers: dict[int, ChatOutputStream] = {}  # choice index -> its output's split
        with_ids = bool(req.return_token_ids)

        def chunk(
            choices: list[P.ChatStreamChoice],
            usage: bool,
            prompt_ids: list[int] | None = None,
            prompt_lps: P.PromptLogprobsOut | None = None,
        ) -> str:
            u = None
            if usage:
                u = P.UsageInfo.of(_prompt_tokens([job]), sum(tokens.values()), cached)
            resp = P.ChatCompletionChunk(
                id=rid,
                created=created,
                model=self.model_name,
                choices=choices,
                usage=u,
                prompt_token_ids=prompt_ids,
                prompt_logprobs=prompt_lps,
            )
            return _sse(resp)

        def delta(c: CompletionOutput) -> P.ChatStreamChoice:
            tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
            message, finish = P.DeltaMessage(content=c.text), c.finish_reason
            if job.parse_output is not None:
                parser = parsers.get(c.index)
                if parser is None:
                    parser = parsers[c.index] = job.parse_output()
                d = parser.feed(c.text, final=c.finish_reason is not None)
                message = P.DeltaMessage(
                    content=d.content or None,
                    reasoning_content=d.reasoning or None,
                    tool_calls=[_delta_call(t) for t in d.tool_calls] or None,
                )
                finish = _finish_reason(c, parser.called)
            return P.ChatStreamChoice(
                index=c.index,
                delta=message,
                logprobs=self._chat_logprobs(req, job, c),
                finish_reason=finish,
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if with_ids else None,
            )

        try:
            # OpenAI opens every choice with a role-only delta (content null where the
            # reply may be only tool calls or thinking); vLLM's prompt ids go with it.
            first = "" if job.parse_output is None else None
            prompt_ids = job.prompt.prompt_token_ids if with_ids else None
            for i in range(job.params.n):
                role = P.DeltaMessage(role="assistant", content=first)
                choice = P.ChatStreamChoice(index=i, delta=role)
                yield chunk([choice], req.continuous_usage, prompt_ids)
            async with contextlib.aclosing(self.merged([job], drop_connection)) as outputs:
                async for _, out in outputs:
                    cached = max(cached, out.num_cached_tokens)
                    # The prompt's logprobs come with the first output (once).
                    prompt_lps = _prompt_logprobs(req, out.prompt_logprobs)
                    for c in out.outputs:
                        yield chunk([delta(c)], req.continuous_usage, None, prompt_lps)
                        prompt_lps = None
            if req.include_usage:
                yield chunk([], True)
        except ConnectionDropped:
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
            yield _sse(classify_error(e, self.engine).body())
        yield _DONE


def truncate_prompt(
    prompt: ProcessedPrompt, keep: int | None, side: str | None, max_model_len: int
) -> ProcessedPrompt:
    """vLLM's ``truncate_prompt_tokens``: keep ``keep`` tokens (-1: the context length),
    the last ones unless ``side`` is "right". A cut prompt's text is dropped (echo
    decodes the kept tokens)."""
    if keep is None:
        return prompt
    limit = max_model_len if keep == -1 else keep
    if not 1 <= limit <= max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the context "
            f"length), got {keep}"
        )
    ids = prompt.prompt_token_ids
    if len(ids) <= limit:
        return prompt
    return ProcessedPrompt(None, ids[:limit] if side == "right" else ids[-limit:])


def _prompt_logprobs(req: Any, lps: PromptLogprobs | None) -> P.PromptLogprobsOut | None:
    """What a response reports as ``prompt_logprobs``: null unless the request asked."""
    if req.prompt_logprobs is None or lps is None:
        return None
    return P.prompt_logprobs_out(lps)


def _or_true(value: bool | None) -> bool:
    return True if value is None else value


def _finish_reason(c: CompletionOutput, called: bool) -> str | None:
    # OpenAI's: an output that ended by calling tools (not one cut by length) says so.
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def _chat_message(job: _Job, c: CompletionOutput) -> tuple[P.ChatMessageOut, str | None]:
    """A finished choice's message and finish reason (its text parsed, where the request
    parses it, as its stream would be)."""
    if job.parse_output is None:
        return P.ChatMessageOut(content=c.text), c.finish_reason
    parser = job.parse_output()
    d = parser.feed(c.text, final=True)
    calls = assemble(d.tool_calls)
    message = P.ChatMessageOut(
        content=d.content or None if (calls or d.reasoning) else d.content,
        reasoning_content=d.reasoning or None,
        tool_calls=[
            P.ToolCallOut(id=t.id, function=P.FunctionCallOut(name=t.name, arguments=t.arguments))
            for t in calls
        ]
        or None,
    )
    return message, _finish_reason(c, parser.called)


def _delta_call(t: ToolCallDelta) -> P.DeltaToolCall:
    return P.DeltaToolCall(
        index=t.index,
        id=t.id,
        type="function" if t.id is not None else None,
        function=P.DeltaFunctionCall(name=t.name, arguments=t.arguments),
    )


def _num_prompts(prompt: Any) -> int:
    """Prompts in a raw ``prompt`` value: a batch is a list of strings or of id lists."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _prompt_tokens(jobs: list[_Job]) -> int:
    # Counted once per prompt, not once per choice (n), like OpenAI.
    return sum(len(j.prompt.prompt_token_ids) for j in jobs)


def add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.engine

    async def handle(request: Request, model: type[BaseModel], run: Callable) -> Response:
        try:
            req = await read_json(request, model, serving.check_sizes)
            serving.check_model(req.model)
            serving.check_alive()
            await serving.check_grammar(req)
            return await run(req, request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests were aborted
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return classify_error(e, engine).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, P.CompletionRequest, serving.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, P.ChatCompletionRequest, serving.chat)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(P.ModelList(data=[serving.model_card()]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        serving.check_model(model_id)
        return JSONResponse(serving.model_card().model_dump())
