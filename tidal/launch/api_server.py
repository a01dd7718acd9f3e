"""OpenAI-compatible HTTP server: FastAPI app around an ``AsyncLLM``, served by uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health``, ``/ping``, ``/version``, ``/metrics`` (prometheus text), ``/stats`` (JSON),
``/dashboard``. Every error is OpenAI's ``{"error": {message, type, param, code}}``: 400 bad
input, 401 bad API key, 404 unknown model or route, 413 body too large, 503 dead engine,
500 bug. The server keeps serving after any of them.

Input is checked where it enters, in layers, each stopping what the next cannot handle:
the body's size (``BodyLimitMiddleware``, before it is read), its encoding, JSON syntax,
nesting depth and every number in it (``decode_json_body``: UTF-8, no NaN/Infinity, ints
within int64, finite floats, at most ``MAX_JSON_DEPTH`` levels), the request's shape
(pydantic), each sampling field (``SamplingParams``' own table), and what the model and the
deployment allow (``InputProcessor.check``, shared with ``LLM`` and ``AsyncLLM``). Body
parsing, tokenization and chat templates run off the event loop, so one huge request does
not stall the other streams.

The engine is duck-typed (see ``AsyncLLM``): this module imports no torch and starts no
process, so it can be tested against a fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tidal
from tidal.config import FrontendConfig
from tidal.frontend.outputs import CompletionOutput, OutputKind, PromptLogprobs, RequestOutput
from tidal.frontend.processor import ProcessedPrompt
from tidal.frontend.template_sandbox import SandboxUnavailable, TemplateSandbox
from tidal.launch import protocol as P
from tidal.launch.dashboard import dashboard_html
from tidal.launch.metrics import CONTENT_TYPE, ServerMetrics
from tidal.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"


# ---- errors ------------------------------------------------------------------------------


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with this HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> P.ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "server_error")
        info = P.ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return P.ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def _is_engine_dead_error(exc: BaseException) -> bool:
    # By name: EngineDeadError lives with the engine client, whose import pulls the whole
    # engine stack (torch); this module stays light and tests run against a fake engine.
    return any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__)


# Request fields and SamplingParams fields: a ValueError message starting with one of
# these names (``stop_token_ids[2] must ...``, ``messages[0].role ...``) is about it.
_PARAMS = (
    set(P.CompletionRequest.model_fields)
    | set(P.ChatCompletionRequest.model_fields)
    | set(SamplingParams.__struct_fields__)
)
_HEAD = re.compile(r"[A-Za-z_]+")


def _bad_value(exc: ValueError) -> APIError:
    msg = str(exc)
    head = _HEAD.match(msg)
    param = head.group() if head is not None and head.group() in _PARAMS else None
    return APIError(400, msg, param=param)


def _classify(exc: BaseException, engine: Any) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if _is_engine_dead_error(exc) or engine.is_dead:
        return APIError(503, f"engine is dead: {exc}", code="engine_dead")
    if isinstance(exc, ValueError):
        return _bad_value(exc)
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first error as "field.path: message", and its top-level field as param."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first['msg']}" if where else first["msg"]), (loc[0] if loc else None)


# ---- auth --------------------------------------------------------------------------------


# Static pages, served without the API key: they hold no data and ask the user for the
# key, which their own fetches then send as a header (a key in the URL would end up in
# history, logs and Referer headers).
PUBLIC_PAGES = frozenset({"/dashboard"})


class BearerAuthMiddleware:
    """Pure ASGI middleware: every HTTP route needs ``Authorization: Bearer <api_key>``,
    except GET/HEAD of the static ``PUBLIC_PAGES``.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect
    cancellation pass through untouched.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or self._public(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key", code="invalid_api_key")
        await err.response()(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return secrets.compare_digest(value, self.expected)
        return False

    @staticmethod
    def _public(scope: dict) -> bool:
        return scope["method"] in ("GET", "HEAD") and scope["path"] in PUBLIC_PAGES


# ---- request bodies ----------------------------------------------------------------------


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"request body is larger than {limit} bytes (the server's --max-request-body-bytes)",
            code="request_too_large",
        )


class BodyLimitMiddleware:
    """Pure ASGI middleware: a body over ``max_bytes`` gets 413 without being read.

    A Content-Length over the limit is refused before the app runs; a chunked body is
    counted as it streams and refused at the first chunk past the limit, so nothing over
    the limit is ever buffered. uvicorn discards the rest of a refused body itself (the
    response carries a Content-Length and keeps the connection), so the client reads the
    413 instead of a reset."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # an APIError: handlers answer it as is
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses these before we see them
    return None


# OpenAI requests nest fewer than ten levels (tools' JSON schemas included); anything much
# deeper only exercises recursion in the parser, pydantic and the chat template.
MAX_JSON_DEPTH = 64


def decode_json_body(body: bytes) -> Any:
    """The request body as JSON, or APIError 400 saying what is wrong with it: not UTF-8,
    not JSON (NaN and Infinity included: not JSON, and not a number any field takes),
    nested deeper than ``MAX_JSON_DEPTH``, or a number no field can hold (an int outside
    int64, a float that overflows to infinity). Checked for every field of every route at
    once, before any field's own checks."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # the C parser's own depth guard (about 1000 levels)
        raise APIError(400, _TOO_DEEP) from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    _check_json_values(data)
    return data


_TOO_DEEP = f"JSON body is nested deeper than {MAX_JSON_DEPTH} levels"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _check_json_values(data: Any) -> None:
    """Depth and numbers, iteratively (a recursive walk would itself hit the recursion
    limit); the error names the path of the value, like pydantic's errors do."""
    if not isinstance(data, (dict, list)):
        _check_number(data, ())
        return
    stack: list[tuple[dict | list, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise APIError(400, _TOO_DEEP, param=_top(path))
        for key, v in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(v, (dict, list)):
                stack.append((v, (*path, key)))
            else:
                _check_number(v, (*path, key))


def _check_number(v: Any, path: tuple[str | int, ...]) -> None:
    if isinstance(v, bool):
        return
    if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:
        problem = f"{v} is out of range (integers must fit in 64 bits)"
    elif isinstance(v, float) and not math.isfinite(v):
        problem = "number is too large"
    else:
        return
    where = ".".join(map(str, path)) or "body"
    raise APIError(400, f"{where}: {problem}", param=_top(path))


def _top(path: tuple[str | int, ...]) -> str | None:
    return path[0] if path and isinstance(path[0], str) else None


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """Body bytes -> request model, or APIError 400 (runs in a worker thread)."""
    data = decode_json_body(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param) from None


# ---- request plumbing --------------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()  # bounded by BodyLimitMiddleware
    return await asyncio.to_thread(parse_request, body, model)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client hangs up first; then cancel it (which aborts the
    engine requests it iterates) and raise _ClientGone. The request body must be read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # no-op once done; cancelling unwinds its generate() iterators
    if task not in done:
        raise _ClientGone()
    return task.result()


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


@dataclass
class _Final:
    """A finished job: its choices by index within the job, and the prompt's logprobs."""

    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None


_END = object()


# ---- the serving logic -------------------------------------------------------------------


class OpenAIServing:
    """Turns OpenAI requests into ``engine.generate`` calls and outputs into responses."""

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.model_path = engine.config.model.model
        self.max_model_len = engine.config.model.max_model_len
        self.tokenizer = engine.tokenizer
        self.limits: FrontendConfig = engine.config.frontend
        # Request-supplied chat templates: refused unless the flag allows them, and then
        # rendered in a killable worker (started by the first such request).
        self.template_sandbox: TemplateSandbox | None = None
        if self.limits.trust_request_chat_template:
            self.template_sandbox = TemplateSandbox(
                engine.config.model.tokenizer, max_chars=self.limits.max_request_body_bytes
            )

    # -- checks --

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.model_path):
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, "engine is dead", code="engine_dead")

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(
            id=self.model_name, root=self.model_path, max_model_len=self.max_model_len
        )

    def _job(self, req: Any, prompt: ProcessedPrompt, request_id: str, first_choice: int) -> _Job:
        default_max = max(1, self.max_model_len - len(prompt.prompt_token_ids))
        params = req.sampling_params(default_max)
        # Checked here too (generate checks again) so a streaming request gets a 400
        # before the SSE response starts.
        self.engine.input_processor.check(prompt, params)
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
        return final

    async def _collect(self, jobs: list[_Job]) -> list[_Final]:
        return list(await asyncio.gather(*(self._final(j) for j in jobs)))

    async def _merged(self, jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """DELTA outputs of all jobs as they come, as (job index, output).

        One producer task per job; closing this iterator cancels them, and a cancelled
        producer closes its ``generate`` iterator, which aborts the engine request."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def produce(i: int, job: _Job) -> None:
            try:
                async with contextlib.aclosing(self._generate(job, OutputKind.DELTA)) as gen:
                    async for out in gen:
                        queue.put_nowait((i, out))
                queue.put_nowait((i, _END))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(produce(i, j)) for i, j in enumerate(jobs)]
        try:
            remaining = len(jobs)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    # -- /v1/completions --

    async def completion_jobs(self, req: P.CompletionRequest, request_id: str) -> list[_Job]:
        batch = self._completion_batch(req.prompt)
        tokenize = self.engine.input_processor.tokenize
        # Off the event loop: a long prompt must not stall the other streams.
        prompts = await asyncio.to_thread(lambda: [tokenize(p) for p in batch])
        n, multi = req.n or 1, len(prompts) > 1
        return [
            self._job(req, p, f"{request_id}-{i}" if multi else request_id, i * n)
            for i, p in enumerate(prompts)
        ]

    def _completion_batch(self, prompt: Any) -> list[Any]:
        """A string, token ids, or a batch of either -> the list of prompts."""
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        if len(prompt) > self.limits.max_prompts_per_request:
            raise ValueError(
                f"prompt: at most {self.limits.max_prompts_per_request} prompts per request "
                f"(--max-prompts-per-request), got {len(prompt)}"
            )
        return prompt

    async def completion(self, req: P.CompletionRequest, request: Request) -> Response:
        rid, created = P.random_id("cmpl"), P.now_s()
        jobs = await self.completion_jobs(req, rid)
        if req.stream:
            stream = self._completion_stream(req, jobs, rid, created)
            return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE_HEADERS)
        finals = await _until_disconnect(request, self._collect(jobs))
        choices = [
            self._completion_choice(req, job, c, echo=bool(req.echo), prompt_lps=f.prompt_logprobs)
            for job, f in zip(jobs, finals)
            for c in sorted(f.outputs.values(), key=lambda c: c.index)
        ]
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs.values())
        resp = P.CompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=P.UsageInfo.of(_prompt_tokens(jobs), completion_tokens),
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
    ) -> P.CompletionChoice:
        """One choice (or one streamed delta of it); ``echo`` prepends the prompt;
        ``offset`` is the number of characters of this choice already sent."""
        text, ids, steps = c.text, list(c.token_ids), list(c.logprobs or [])
        if echo:
            n = len(job.prompt.prompt_token_ids)
            text = self._prompt_text(job.prompt) + text
            ids = job.prompt.prompt_token_ids + ids
            steps = (list(prompt_lps or []) + [None] * n)[:n] + steps
        lps = None
        if job.params.logprobs is not None:
            lps = P.completion_logprobs(ids, steps, job.params.logprobs, self.tokenizer, offset)
        return P.CompletionChoice(
            index=job.first_choice + c.index,
            text=text,
            logprobs=lps,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.prompt is not None:
            return prompt.prompt
        return self.tokenizer.decode(prompt.prompt_token_ids)

    async def _completion_stream(
        self, req: P.CompletionRequest, jobs: list[_Job], rid: str, created: int
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice index -> characters already sent
        tokens: dict[int, int] = {}  # choice index -> tokens already sent
        prompt_lps: dict[int, PromptLogprobs] = {}  # job -> prompt logprobs (first output)

        def chunk(choices: list[P.CompletionChoice], usage: bool) -> str:
            u = P.UsageInfo.of(_prompt_tokens(jobs), sum(tokens.values())) if usage else None
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
                prompt_lps=prompt_lps.get(i),
                offset=offsets.get(idx, 0),
            )
            offsets[idx] = offsets.get(idx, 0) + len(choice.text)
            tokens[idx] = tokens.get(idx, 0) + len(c.token_ids)
            return choice

        try:
            async with contextlib.aclosing(self._merged(jobs)) as outputs:
                async for i, out in outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        yield chunk([delta(i, c)], req.continuous_usage)
            if req.include_usage:
                yield chunk([], True)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
            yield _sse(_classify(e, self.engine).body())
        yield _DONE

    # -- /v1/chat/completions --

    async def chat_job(self, req: P.ChatCompletionRequest, request_id: str) -> _Job:
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
                text, ids = await self.template_sandbox.render(
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
        return self._job(req, prompt, request_id, 0)

    async def chat(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        rid, created = P.random_id("chatcmpl"), P.now_s()
        job = await self.chat_job(req, rid)
        if req.stream:
            stream = self._chat_stream(req, job, rid, created)
            return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE_HEADERS)
        (final,) = await _until_disconnect(request, self._collect([job]))
        outs = sorted(final.outputs.values(), key=lambda c: c.index)
        choices = [
            P.ChatChoice(
                index=c.index,
                message=P.ChatMessageOut(content=c.text),
                logprobs=self._chat_logprobs(job, c),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in outs
        ]
        usage = P.UsageInfo.of(_prompt_tokens([job]), sum(len(c.token_ids) for c in outs))
        resp = P.ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, choices=choices, usage=usage
        )
        return JSONResponse(resp.model_dump())

    def _chat_logprobs(self, job: _Job, c: CompletionOutput) -> P.ChatLogProbs | None:
        if job.params.logprobs is None:
            return None
        return P.chat_logprobs(c.token_ids, c.logprobs or [], job.params.logprobs, self.tokenizer)

    async def _chat_stream(
        self, req: P.ChatCompletionRequest, job: _Job, rid: str, created: int
    ) -> AsyncIterator[str]:
        tokens: dict[int, int] = {}

        def chunk(choices: list[P.ChatStreamChoice], usage: bool) -> str:
            u = P.UsageInfo.of(_prompt_tokens([job]), sum(tokens.values())) if usage else None
            resp = P.ChatCompletionChunk(
                id=rid, created=created, model=self.model_name, choices=choices, usage=u
            )
            return _sse(resp)

        def delta(c: CompletionOutput) -> P.ChatStreamChoice:
            tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
            return P.ChatStreamChoice(
                index=c.index,
                delta=P.DeltaMessage(content=c.text),
                logprobs=self._chat_logprobs(job, c),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )

        try:
            # OpenAI opens every choice with a role-only delta.
            for i in range(job.params.n):
                role = P.DeltaMessage(role="assistant", content="")
                yield chunk([P.ChatStreamChoice(index=i, delta=role)], req.continuous_usage)
            async with contextlib.aclosing(self._merged([job])) as outputs:
                async for _, out in outputs:
                    for c in out.outputs:
                        yield chunk([delta(c)], req.continuous_usage)
            if req.include_usage:
                yield chunk([], True)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
            yield _sse(_classify(e, self.engine).body())
        yield _DONE


def _prompt_tokens(jobs: list[_Job]) -> int:
    # Counted once per prompt, not once per choice (n), like OpenAI.
    return sum(len(j.prompt.prompt_token_ids) for j in jobs)


# ---- the app -----------------------------------------------------------------------------


def build_app(
    engine: AsyncLLM,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    metrics: ServerMetrics | None = None,
    shutdown_engine: bool = True,
    routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """The FastAPI app. ``metrics`` is registered as the engine's stat logger; on
    lifespan shutdown (SIGTERM/SIGINT under uvicorn) ``engine.shutdown()`` is awaited
    unless ``shutdown_engine`` is False. ``routers`` (admin, dashboard) are included as
    they are; the API key protects them too. Handlers find the engine and metrics on
    ``request.app.state``."""
    metrics = metrics if metrics is not None else ServerMetrics()
    engine.add_stat_logger(metrics)
    serving = OpenAIServing(engine, served_model_name or engine.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if serving.template_sandbox is not None:
                await serving.template_sandbox.close()
            if shutdown_engine:
                logger.info("shutting down the engine")
                await engine.shutdown()

    app = FastAPI(title="Tidal", version=tidal.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    # Added last, so outermost: an oversized body is refused before anything else runs.
    app.add_middleware(BodyLimitMiddleware, max_bytes=serving.limits.max_request_body_bytes)
    _add_error_handlers(app)
    _add_openai_routes(app, serving)
    _add_admin_routes(app, serving, metrics)
    for router in routers:
        app.include_router(router)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return APIError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.engine

    async def handle(request: Request, model: type[BaseModel], run: Callable) -> Response:
        try:
            req = await _parse(request, model)
            serving.check_model(req.model)
            serving.check_alive()
            return await run(req, request)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests were aborted
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return _classify(e, engine).response()

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


def _add_admin_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    engine = serving.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        serving.check_alive()
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": tidal.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if getattr(engine, "has_expert_load", False) and not engine.is_dead:
            try:
                metrics.record_expert_load(await engine.get_expert_load())
            except Exception:  # noqa: BLE001 - metrics must render even if a rank is busy
                logger.warning("expert load unavailable for /metrics", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        # Public (see PUBLIC_PAGES): the page asks for the API key and never caches.
        return Response(
            dashboard_html(), media_type="text/html", headers={"Cache-Control": "no-store"}
        )

    @app.get("/stats")
    async def stats() -> JSONResponse:
        serving.check_alive()
        try:
            return JSONResponse(await engine.get_stats())
        except Exception as e:  # noqa: BLE001
            return _classify(e, engine).response()


# ---- serving with uvicorn ----------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 picks a free port. Binding before
    the engines start reserves the port and lets the caller learn it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def make_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    timeout_keep_alive: int = 5,
    timeout_graceful_shutdown: float | None = 10.0,
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve(sockets=[sock])`` to run it on a
    pre-bound socket, set ``server.should_exit = True`` to stop it (uvicorn does on
    SIGTERM/SIGINT). Open streams get ``timeout_graceful_shutdown`` seconds to finish."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=timeout_keep_alive,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
    )
    return uvicorn.Server(config)


async def serve(
    engine: AsyncLLM,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    timeout_graceful_shutdown: float | None = 10.0,
    routers: Sequence[APIRouter] = (),
) -> None:
    """Serve until SIGTERM/SIGINT; the engine is shut down on the way out.

    uvicorn restores the previous signal handlers and re-raises the signal after a
    graceful shutdown, so a caller's own SIGTERM handler still runs afterwards."""
    app = build_app(engine, api_key=api_key, served_model_name=served_model_name, routers=routers)
    server = make_server(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
    )
    await server.serve(sockets=[sock] if sock is not None else None)


def run_server(make_engine: Callable[[], Any], **kwargs: Any) -> None:
    """Blocking entry point. ``make_engine`` (sync or async, no arguments) is called inside
    the server's event loop, since AsyncLLM's queues and sockets belong to that loop.
    ``kwargs`` are ``serve``'s."""

    async def main() -> None:
        engine = make_engine()
        if asyncio.iscoroutine(engine):
            engine = await engine
        await serve(engine, **kwargs)

    asyncio.run(main())
