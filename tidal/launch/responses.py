"""``POST /v1/responses``: OpenAI's Responses API for text and function calls, streamed or
not (docs/operations.md#api-surface).

A request becomes a chat completion: ``instructions`` a system message first, ``input`` a
user message (a string) or the listed items (messages with text parts; ``function_call``
items become the assistant's ``tool_calls``, ``function_call_output`` items ``tool``
messages; ``reasoning`` items are dropped, as templates drop past thinking),
``max_output_tokens`` the token limit, ``text.format`` the structured-output
``response_format``, ``tools`` (the flat function shape) and ``tool_choice`` chat's; it
is then rendered, checked, generated and parsed exactly as ``/v1/chat/completions`` does
(the same tool and reasoning parsers). The answer is a ``response`` object whose
``output`` holds the parsed reply's items in order: a ``reasoning`` item (the
``--reasoning-parser``'s thinking), a ``message`` with one ``output_text`` part, one
``function_call`` item per call; the last is ``incomplete`` (and the response, with
``incomplete_details.reason: max_output_tokens``) when the token limit cut it.

Streaming sends the events the ``openai`` SDK consumes, each ``event: <type>`` plus its
JSON with a ``sequence_number``: ``response.created``, ``response.in_progress``, then per
item ``response.output_item.added``, its deltas (``response.content_part.added``,
``response.output_text.delta``..., ``.done``, ``response.content_part.done`` for a
message; the same with ``response.reasoning_text.*`` for reasoning;
``response.function_call_arguments.delta``... and ``.done`` for a call) and
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete``);
a failure after the start is an ``error`` event. Nothing is stored:
``previous_response_id`` and the other fields that need stored state or hosted tools are
refused with a 400 naming them, as are non-text inputs.
"""

from __future__ import annotations

import contextlib
import enum
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, assert_never

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
from tidal.launch.tool_parsers import ChatDelta, ToolCallDelta

# Fields of OpenAI's request this server gives no meaning, with the values that ask for
# nothing; any other value is a 400 naming the field.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
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
# Fields handed to the chat completion as they are (vLLM's extras included).
_AS_CHAT = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "chat_template_kwargs",
)  # fmt: skip


class FunctionTool(BaseModel):
    """A ``tools`` entry: the Responses API's flat function shape (chat nests the same
    fields under ``function``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: any object)
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"})}


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
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's (enable_thinking...)
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # checked by to_chat (_tool_choice)
    # Refused unless they ask for nothing (_UNSUPPORTED).
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
            messages += _history(self.input)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream,
            "tools": [t.to_chat() for t in self.tools] if self.tools else None,
            "tool_choice": _tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            **{name: getattr(self, name) for name in _AS_CHAT},
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


def _tool_choice(choice: Any) -> Any:
    """``tool_choice`` as chat takes it: a named function's name nests under ``function``."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str):
            return {"type": "function", "function": {"name": name}}
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        f"{{'type': 'function', 'name': ...}}, got {choice!r}"
    )


def _history(items: list[Any]) -> list[dict[str, Any]]:
    """``input``'s items as chat messages: calls join the assistant message before them
    (one turn's text and calls are one chat message), outputs are ``tool`` messages."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        match kind:
            case "message":
                messages.append(_message(i, item))
            case "function_call":
                call = {
                    "id": _text_field(i, item, "call_id"),
                    "type": "function",
                    "function": {
                        "name": _text_field(i, item, "name"),
                        "arguments": _text_field(i, item, "arguments"),
                    },
                }
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            case "function_call_output":
                call_id = _text_field(i, item, "call_id")
                output = _content(i, item.get("output"), "output")
                messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            case "reasoning":
                pass  # earlier thinking: chat templates leave it out of the prompt
            case _:
                shown = kind if kind is not None else type(item).__name__
                raise ValueError(f"input[{i}]: item type {shown!r} is not supported")
    return messages


def _text_field(i: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{name} must be a string (a {item['type']} item)")
    return value


def _content(i: int, content: Any, name: str) -> str:
    """A string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].{name} must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"input[{i}]: content part type {kind!r} is not supported")
        texts.append(str(part.get("text") or ""))
    return "\n".join(texts)


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """``input[i]`` (a message: a role and a string or text parts) as a chat message."""
    return {"role": item.get("role"), "content": _content(i, item.get("content"), "content")}


# ---- the response object -------------------------------------------------------------------


@enum.unique
class Status(enum.StrEnum):
    """A response's (and its items') ``status``."""

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


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking the ``--reasoning-parser`` split off (its text, no summary)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the client's function_call_output names
    name: str
    arguments: str  # JSON text
    status: Status


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # nothing is billed for writing the prefix cache


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
    output: list[OutputItem]
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
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    truncation: str = "disabled"
    user: str | None = None


class _Build:
    """One response's ids and echoed request fields, for its snapshots and events."""

    def __init__(self, serving: OpenAIServing, req: ResponsesRequest) -> None:
        self.req, self.model = req, serving.model_name
        self.id = P.random_id("resp")
        self.created = P.now_s()
        self.sequence = 0

    def response(
        self,
        status: Status,
        output: list[OutputItem],
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
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=req.tools or [],
            user=req.user,
        )

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event: ``event:`` its type, ``data:`` its JSON with a sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_json(data)}\n\n"


@enum.unique
class _Kind(enum.Enum):
    REASONING = "reasoning"
    MESSAGE = "message"
    CALL = "function_call"


@dataclass
class _OpenItem:
    """The item being written: its text (thinking, answer, or a call's arguments)."""

    kind: _Kind
    id: str
    index: int  # its output_index
    text: str = ""
    call_id: str = ""
    name: str = ""

    def item(self, status: Status) -> OutputItem:
        match self.kind:
            case _Kind.REASONING:
                parts = [] if status is Status.IN_PROGRESS else [ReasoningText(text=self.text)]
                return ReasoningItem(id=self.id, content=parts, status=status)
            case _Kind.MESSAGE:
                texts = [] if status is Status.IN_PROGRESS else [OutputText(text=self.text)]
                return OutputMessage(id=self.id, content=texts, status=status)
            case _Kind.CALL:
                args = "" if status is Status.IN_PROGRESS else self.text
                return FunctionCallItem(
                    id=self.id, call_id=self.call_id, name=self.name, arguments=args, status=status
                )
            case _:
                assert_never(self.kind)


class OutputItems:
    """A reply's output items, built from its parsed pieces (``ChatDelta``) in the order
    they come: a piece of another kind, or a new call, ends the open item. Each method
    returns the stream events of what it did (the unstreamed path drops them)."""

    def __init__(self, event: Any) -> None:
        self._event = event  # _Build.event
        self.items: list[OutputItem] = []
        self._open: _OpenItem | None = None

    def feed(self, d: ChatDelta) -> list[str]:
        events = []
        if d.reasoning:
            events += self._text(_Kind.REASONING, d.reasoning)
        if d.content:
            events += self._text(_Kind.MESSAGE, d.content)
        for call in d.tool_calls:
            events += self._call(call)
        return events

    def finish(self, status: Status) -> list[str]:
        """Closes the last item with the reply's status; a reply of nothing is an empty
        message."""
        events = [] if self.items or self._open else self._start(_Kind.MESSAGE)
        return events + self._close(status)

    def _text(self, kind: _Kind, text: str) -> list[str]:
        events = []
        if self._open is None or self._open.kind is not kind:
            events = self._close(Status.COMPLETED) + self._start(kind)
        item = self._open
        assert item is not None
        item.text += text
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind is _Kind.MESSAGE:
            events.append(
                self._event("response.output_text.delta", **where, delta=text, logprobs=[])
            )
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _call(self, d: ToolCallDelta) -> list[str]:
        events = []
        if d.id is not None:  # a call's first piece: its id and name
            events = self._close(Status.COMPLETED) + self._start(_Kind.CALL, d)
        item = self._open
        assert item is not None and item.kind is _Kind.CALL, d
        if d.arguments:
            item.text += d.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=d.arguments,
                )
            )
        return events

    def _start(self, kind: _Kind, call: ToolCallDelta | None = None) -> list[str]:
        index = len(self.items)
        match kind:
            case _Kind.REASONING:
                item = _OpenItem(kind, P.random_id("rs"), index)
            case _Kind.MESSAGE:
                item = _OpenItem(kind, P.random_id("msg"), index)
            case _Kind.CALL:
                assert call is not None and call.id is not None and call.name is not None
                item = _OpenItem(kind, P.random_id("fc"), index, "", call.id, call.name)
            case _:
                assert_never(kind)
        self._open = item
        added = item.item(Status.IN_PROGRESS)
        events = [self._event("response.output_item.added", output_index=index, item=added)]
        if kind is not _Kind.CALL:
            part = _part(kind, "")
            events.append(self._event("response.content_part.added", **_where(item), part=part))
        return events

    def _close(self, status: Status) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        match item.kind:
            case _Kind.REASONING | _Kind.MESSAGE:
                prefix = "output_text" if item.kind is _Kind.MESSAGE else "reasoning_text"
                extra = {"logprobs": []} if item.kind is _Kind.MESSAGE else {}
                part = _part(item.kind, item.text)
                events = [
                    self._event(f"response.{prefix}.done", **_where(item), text=item.text, **extra),
                    self._event("response.content_part.done", **_where(item), part=part),
                ]
            case _Kind.CALL:
                events = [
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item.id,
                        output_index=item.index,
                        arguments=item.text,
                    )
                ]
            case _:
                assert_never(item.kind)
        done = item.item(status)
        self.items.append(done)
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events


def _where(item: _OpenItem) -> dict[str, Any]:
    return {"item_id": item.id, "output_index": item.index, "content_index": 0}


def _part(kind: _Kind, text: str) -> BaseModel:
    return OutputText(text=text) if kind is _Kind.MESSAGE else ReasoningText(text=text)


def _json(data: dict[str, Any]) -> str:
    return json.dumps(
        {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()},
        ensure_ascii=False,
        separators=(",", ":"),
    )


def _status(c: CompletionOutput) -> Status:
    return Status.INCOMPLETE if c.finish_reason == "length" else Status.COMPLETED


def _usage(
    serving: OpenAIServing, job: Any, prompt_tokens: int, output_ids: list[int], cached: int
) -> ResponseUsage:
    output_tokens = len(output_ids)
    return ResponseUsage(
        input_tokens=prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=serving.reasoning_tokens(job, output_ids)
        ),
        total_tokens=prompt_tokens + output_tokens,
    )


def _parser(job: Any) -> Callable[[str, bool], ChatDelta]:
    """What splits the job's text (chat's parsers; none: all of it is the answer)."""
    if job.parse_output is None:
        return lambda text, final: ChatDelta(content=text)
    return job.parse_output().feed


# ---- serving -------------------------------------------------------------------------------


async def create(serving: OpenAIServing, req: ResponsesRequest, request: Request) -> Response:
    try:
        chat = req.to_chat()
        await serving.check_grammar(chat)
        build = _Build(serving, req)
        job = await serving.chat_job(chat, build.id)
    except Exception as e:  # noqa: BLE001 - chat's error, said in this request's words
        raise _as_responses_error(classify_error(e, serving.engine)) from None
    prompt_tokens = len(job.prompt.prompt_token_ids)
    if req.stream:
        events = _stream(serving, build, job, request, prompt_tokens)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    (final,) = await until_disconnect(request, serving.collect([job]))
    (c,) = final.outputs.values()
    status = _status(c)
    items = OutputItems(lambda kind, **fields: "")
    items.feed(_parser(job)(c.text, True))
    items.finish(status)
    usage = _usage(serving, job, prompt_tokens, list(c.token_ids), final.num_cached_tokens)
    resp = build.response(status, items.items, usage)
    return JSONResponse(resp.model_dump(mode="json"))


def _as_responses_error(e: APIError) -> APIError:
    """A chat error in this request's words: chat's ``response_format`` is
    ``text.format`` here, a tool's ``function.parameters`` its ``parameters``."""
    if e.status != 400:
        return e
    msg = e.message.replace("response_format", "text.format", 1).replace(".function.", ".", 1)
    head = _HEAD.match(msg)
    ours = head is not None and head.group() in ResponsesRequest.model_fields
    return APIError(400, msg, param=head.group() if ours and head else e.param, code=e.code)


async def _stream(
    serving: OpenAIServing, build: _Build, job: Any, request: Request, prompt_tokens: int
) -> AsyncIterator[str]:
    started = build.response(Status.IN_PROGRESS, [])
    yield build.event("response.created", response=started)
    yield build.event("response.in_progress", response=started)
    items, parse = OutputItems(build.event), _parser(job)
    ids: list[int] = []  # the output's tokens, for the usage
    cached, last = 0, None
    try:
        outputs = serving.merged([job], connection_dropper(request))
        async with contextlib.aclosing(outputs) as outs:
            async for _, out in outs:
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    ids += c.token_ids
                    last = c
                    for event in items.feed(parse(c.text, c.finish_reason is not None)):
                        yield event
    except ConnectionDropped:
        return
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
        err = classify_error(e, serving.engine)
        yield build.event("error", code=err.code, message=err.message, param=err.param)
        return
    status = Status.COMPLETED if last is None else _status(last)
    for event in items.finish(status):
        yield event
    final = build.response(status, items.items, _usage(serving, job, prompt_tokens, ids, cached))
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
