"""``POST /v1/responses``: OpenAI's Responses API for text, streamed or not
(docs/operations.md#api-surface).

A request becomes a chat completion: ``instructions`` a system message first, ``input`` a
user message (a string) or the listed messages (text parts only), ``max_output_tokens``
the token limit, ``text.format`` the structured-output ``response_format``; it is then
rendered, checked and generated exactly as ``/v1/chat/completions`` does. The answer is a
``response`` object holding one assistant ``message`` with one ``output_text`` part;
``status`` is ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the
token limit cut it.

Streaming sends the events the ``openai`` SDK consumes, each ``event: <type>`` plus its
JSON with a ``sequence_number``: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per output, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then
``response.completed`` (or ``response.incomplete``); a failure after the start is an
``error`` event. Nothing is stored: ``previous_response_id`` and the other fields that
need stored state or tools are refused with a 400 naming them, as are non-text inputs.
"""

from __future__ import annotations

import contextlib
import enum
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from tidal.frontend.outputs import CompletionOutput
from tidal.launch import openai_models as P
from tidal.launch.errors import APIError, classify_error, validation_message
from tidal.launch.http_limits import read_json
from tidal.launch.serving import (
    SSE_HEADERS,
    ClientGone,
    ConnectionDropped,
    OpenAIServing,
    connection_dropper,
    until_disconnect,
)

# Fields of OpenAI's request this server gives no meaning, with the values that ask for
# nothing; any other value is a 400 naming the field. Tools wait for tool calling.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "reasoning": (None,),
    "include": (None, []),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
_HEAD = re.compile(r"[A-Za-z_]+")
# Fields handed to the chat completion as they are (vLLM's sampling extras included).
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema
    inline (not nested as in chat's ``response_format``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None  # accepted; nothing is kept
    parallel_tool_calls: bool | None = None
    user: str | None = None
    # Sampling (OpenAI's two, then vLLM's extras).
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    # Refused unless they ask for nothing (_UNSUPPORTED).
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    prompt: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    def to_chat(self) -> P.ChatCompletionRequest:
        """The chat completion this request is (ValueError naming the field)."""
        for name, asks_nothing in _UNSUPPORTED.items():
            if getattr(self, name) not in asks_nothing:
                raise ValueError(f"{name} is not supported by this server")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [_message(i, item) for i, item in enumerate(self.input)]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream,
            **{name: getattr(self, name) for name in _SAMPLING},
        }
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ValueError("text: format.schema is required for type json_schema")
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        try:
            return P.ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # of the messages, which came from input
            msg, _ = validation_message(e)
            raise ValueError(f"input: {msg}") from None


def _message(i: int, item: Any) -> dict[str, Any]:
    """``input[i]`` (a message: a role and a string or text parts) as a chat message."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"input[{i}]: item type {kind!r} is not supported (only messages)")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ValueError(f"input[{i}]: content part type {kind!r} is not supported")
            texts.append(str(part.get("text") or ""))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"input[{i}].content must be a string or a list of text parts")
    return {"role": item.get("role"), "content": content}


# ---- the response object -------------------------------------------------------------------


@enum.unique
class Status(enum.StrEnum):
    """A response's (and its message's) ``status``."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # the token limit cut it


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Status
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"
    tools: list[Any] = Field(default_factory=list)
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    truncation: str = "disabled"
    user: str | None = None


class _Build:
    """One response's ids and echoed request fields, for its snapshots and events."""

    def __init__(self, serving: OpenAIServing, req: ResponsesRequest) -> None:
        self.req, self.model = req, serving.model_name
        self.id, self.msg_id = P.random_id("resp"), P.random_id("msg")
        self.created = P.now_s()
        self.sequence = 0

    def response(
        self,
        status: Status,
        output: list[OutputMessage],
        usage: ResponseUsage | None = None,
    ) -> ResponseObject:
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            model=self.model,
            status=status,
            output=output,
            usage=usage,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens")
                if status is Status.INCOMPLETE
                else None
            ),
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            text=text or {"format": {"type": "text"}},
            metadata=req.metadata,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            user=req.user,
        )

    def message(self, text: str, status: Status) -> OutputMessage:
        content = [] if status is Status.IN_PROGRESS else [OutputText(text=text)]
        return OutputMessage(id=self.msg_id, status=status, content=content)

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event: ``event:`` its type, ``data:`` its JSON with a sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_json(data)}\n\n"


def _json(data: dict[str, Any]) -> str:
    return json.dumps(
        {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()},
        ensure_ascii=False,
        separators=(",", ":"),
    )


def _status(c: CompletionOutput) -> Status:
    return Status.INCOMPLETE if c.finish_reason == "length" else Status.COMPLETED


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=output_tokens,
        total_tokens=prompt_tokens + output_tokens,
    )


# ---- serving -------------------------------------------------------------------------------


async def create(serving: OpenAIServing, req: ResponsesRequest, request: Request) -> Response:
    try:
        chat = req.to_chat()
        await serving.check_grammar(chat)
    except ValueError as e:
        # A structured-output error names chat's field; this request calls it text.format.
        msg = str(e).replace("response_format", "text.format", 1)
        head = _HEAD.match(msg)
        param = head.group() if head and head.group() in ResponsesRequest.model_fields else None
        raise APIError(400, msg, param=param) from None
    build = _Build(serving, req)
    job = await serving.chat_job(chat, build.id)
    prompt_tokens = len(job.prompt.prompt_token_ids)
    if req.stream:
        events = _stream(serving, build, job, request, prompt_tokens)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    (final,) = await until_disconnect(request, serving.collect([job]))
    (c,) = final.outputs.values()
    status = _status(c)
    usage = _usage(prompt_tokens, len(c.token_ids), final.num_cached_tokens)
    resp = build.response(status, [build.message(c.text, status)], usage)
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(
    serving: OpenAIServing, build: _Build, job: Any, request: Request, prompt_tokens: int
) -> AsyncIterator[str]:
    part = {"item_id": build.msg_id, "output_index": 0, "content_index": 0}
    started = build.response(Status.IN_PROGRESS, [])
    yield build.event("response.created", response=started)
    yield build.event("response.in_progress", response=started)
    yield build.event(
        "response.output_item.added", output_index=0, item=build.message("", Status.IN_PROGRESS)
    )
    yield build.event("response.content_part.added", **part, part=OutputText(text=""))
    text, tokens, cached, last = "", 0, 0, None
    try:
        outputs = serving.merged([job], connection_dropper(request))
        async with contextlib.aclosing(outputs) as outs:
            async for _, out in outs:
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    text, tokens, last = text + c.text, tokens + len(c.token_ids), c
                    if c.text:
                        yield build.event(
                            "response.output_text.delta", **part, delta=c.text, logprobs=[]
                        )
    except ConnectionDropped:
        return
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
        err = classify_error(e, serving.engine)
        yield build.event("error", code=err.code, message=err.message, param=err.param)
        return
    status = Status.COMPLETED if last is None else _status(last)
    yield build.event("response.output_text.done", **part, text=text, logprobs=[])
    yield build.event("response.content_part.done", **part, part=OutputText(text=text))
    yield build.event("response.output_item.done", output_index=0, item=build.message(text, status))
    final = build.response(
        status, [build.message(text, status)], _usage(prompt_tokens, tokens, cached)
    )
    yield build.event(f"response.{status}", response=final)


def add_responses_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        try:
            req = await read_json(request, ResponsesRequest, serving.check_sizes)
            serving.check_model(req.model)
            serving.check_alive()
            return await create(serving, req, request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return classify_error(e, serving.engine).response()
