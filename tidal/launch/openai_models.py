"""OpenAI-compatible request/response models (pydantic) and their conversions.

Requests accept the OpenAI fields plus vLLM's sampling extras (``top_k``, ``min_p``, ...).
Every field may be ``null`` (clients send that for "unset"); defaults are resolved in
``sampling_params`` so the resolution rules live in one place. Unknown fields are
ignored, as OpenAI clients add new ones over time.

These models check shapes and types only. Ranges come from the one table in
``SamplingParams`` (each request becomes one before anything else happens), the limits
that depend on the model or the deployment from ``InputProcessor.check``, and the body as
a whole (size, depth, int64, finite floats) from the server's ``decode_json_body``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    create_model,
    field_serializer,
    model_serializer,
)

from tidal.frontend.outputs import Logprob
from tidal.launch.tool_parsers import ToolMode, forced_tool_schema
from tidal.sampling_params import SamplingParams, StructuredOutputs, json_schema_text

# Logprobs of -inf (masked tokens) are not valid JSON; clamp them like OpenAI does.
_MIN_LOGPROB = -9999.0
_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---- requests ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Fields OpenAI or vLLM give a meaning this server does not implement, with the values
# that ask for nothing. A request setting one otherwise is refused (a 400 naming it), not
# answered as if it had not (``extra="ignore"`` drops only fields nobody defines).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (None, False),
}
# One field for each, so that a request's value is kept and an error can name it.
_UNSUPPORTED_FIELDS: dict[str, Any] = {name: (Any, None) for name in _UNSUPPORTED}
_UnsupportedFields = create_model("_UnsupportedFields", **_UNSUPPORTED_FIELDS)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object: one of its constraints."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Every way a request can ask for structured outputs; at most one may be used.
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class _SamplingRequest(_UnsupportedFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    # Fields of ``_UNSUPPORTED`` this request kind implements (and redeclares).
    _implemented: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    n: StrictInt | None = 1
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    data_parallel_rank: StrictInt | None = Field(default=None, ge=0)
    prompt_logprobs: StrictInt | None = None
    # Keep this many prompt tokens (-1: the context length), cut on ``truncation_side``.
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Logprob tokens as "token_id:<id>": unique, where two tokens' texts may be equal.
    return_tokens_as_token_ids: bool | None = None
    # Each choice also carries its own token ids, and the response its prompt's (on
    # completions each choice its prompt's).
    return_token_ids: bool | None = None

    def _params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        defaults: Mapping[str, Any],
    ) -> SamplingParams:
        """Raises ValueError naming the field for invalid values. ``defaults``: what the
        checkpoint recommends for the sampling fields the request leaves unset.
        ``prompt_logprobs``: what the request needs besides its own ``prompt_logprobs``
        (completions' echo)."""
        for name, asks_nothing in _UNSUPPORTED.items():
            if name not in self._implemented and getattr(self, name) not in asks_nothing:
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        asked = _check_top(self.prompt_logprobs, "prompt_logprobs")
        if asked is not None or prompt_logprobs is not None:
            prompt_logprobs = max(asked or 0, prompt_logprobs or 0)
        structured = self.structured_spec()
        return SamplingParams(
            n=_or(self.n, 1),
            temperature=_or(self.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_or(self.top_k, defaults.get("top_k", 0)),
            min_p=_or(self.min_p, defaults.get("min_p", 0.0)),
            repetition_penalty=_or(
                self.repetition_penalty, defaults.get("repetition_penalty", 1.0)
            ),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=_or(self.min_tokens, 0),
            stop=_stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=_or(self.skip_special_tokens, True),
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            structured_outputs=None if structured is None else structured[1],
        )

    def structured_spec(self) -> tuple[str, StructuredOutputs] | None:
        """The one structured-output constraint the request asks for and the field it came
        from. Not compiled here: the server runs ``check_spec`` on a thread, as a heavy
        schema takes a tenth of a second to compile."""
        used = [n for n in _STRUCTURED_FIELDS if getattr(self, n) is not None]
        rf = self.response_format
        if rf is not None and rf.type == "text":
            used.remove("response_format")
        if len(used) > 1:
            raise ValueError(f"{used[1]}: only one of {', '.join(used)} may be set")
        if not used:
            return None
        field = used[0]
        try:
            return field, self._spec(field)
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(field) else f"{field}: {msg}") from None

    def grammar_checks(self) -> list[tuple[str, StructuredOutputs]]:
        """Each spec the server compiles (on a thread) before accepting the request, with
        the field its error names."""
        spec = self.structured_spec()
        return [] if spec is None else [spec]

    def _spec(self, field: str) -> StructuredOutputs:
        match field:
            case "response_format":
                rf = self.response_format
                assert rf is not None
                if rf.type == "json_object":
                    return StructuredOutputs(json_object=True)
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise ValueError(
                        "response_format.json_schema.schema is required for type json_schema"
                    )
                return StructuredOutputs(json=json_schema_text(rf.json_schema.schema_))
            case "structured_outputs":
                so = self.structured_outputs
                assert so is not None
                return StructuredOutputs(
                    json=None if so.json_ is None else json_schema_text(so.json_),
                    json_object=bool(so.json_object),
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                )
            case "guided_json":
                assert self.guided_json is not None
                return StructuredOutputs(json=json_schema_text(self.guided_json))
            case "guided_regex":
                return StructuredOutputs(regex=self.guided_regex)
            case "guided_choice":
                return StructuredOutputs(choice=self.guided_choice)
            case "guided_grammar":
                return StructuredOutputs(grammar=self.guided_grammar)
        raise AssertionError(field)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: ``continuous_usage_stats`` counts only with
        ``include_usage`` (as in vLLM)."""
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: StrictInt | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, Any] = _NO_DEFAULTS
    ) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != _or(self.n, 1):
            raise ValueError("best_of must equal n (best-of sampling is not supported)")
        lp = _check_top(self.logprobs, "logprobs")
        # Echo with logprobs needs the prompt's logprobs too.
        prompt_lp = lp if self.echo and lp is not None else None
        return self._params(_or(self.max_tokens, default_max_tokens), lp, prompt_lp, defaults)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(BaseModel):
    """An assistant message's earlier call, in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a chat template sees; text parts are joined by newlines (as vLLM
        joins them for templates that take a string), other parts rejected. A call's
        arguments are a JSON object there (templates write them with ``tojson``)."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise ValueError(f"messages: content part type {bad[0]!r} is not supported")
            content = "\n".join(p.text or "" for p in content)
        d = self.model_dump(exclude_none=True)
        d["content"] = content if content is not None else ""
        for call in d.get("tool_calls", ()):
            fn = call["function"]
            if isinstance(fn["arguments"], str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # not JSON: the template gets the text
        return d


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: any object)
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = None
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    _implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    def sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, Any] = _NO_DEFAULTS
    ) -> SamplingParams:
        max_tokens = _or(self.requested_max_tokens, default_max_tokens)
        return self._params(max_tokens, self.num_logprobs, None, defaults)

    @property
    def tool_mode(self) -> ToolMode:
        """How the tools are called (ValueError naming tool_choice when it cannot be)."""
        choice, tools = self.tool_choice, self.tools or []
        if choice is None:  # OpenAI's default
            choice = "auto" if tools else "none"
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice: function {choice.function.name!r} is not one of the "
                    f"request's tools ({', '.join(map(repr, names)) or 'none given'})"
                )
            return ToolMode.NAMED
        match choice:
            case "none":
                return ToolMode.NONE
            case "auto":
                return ToolMode.AUTO if tools else ToolMode.NONE
            case "required":
                if not tools:
                    raise ValueError("tool_choice: 'required' needs a non-empty tools list")
                return ToolMode.REQUIRED
        raise AssertionError(choice)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template takes them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured_spec(self) -> tuple[str, StructuredOutputs] | None:
        """A forced tool call's grammar (tool_choice required or named), else the
        request's structured-output field."""
        mode = self.tool_mode
        if mode not in (ToolMode.REQUIRED, ToolMode.NAMED):
            return super().structured_spec()
        used = [n for n in _STRUCTURED_FIELDS if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            used.remove("response_format")
        if used:
            raise ValueError(f"tool_choice: a forced tool call cannot be combined with {used[0]}")
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        schema = forced_tool_schema(
            [(t.function.name, t.function.parameters) for t in self.tools or []],
            named,
            parallel=_or(self.parallel_tool_calls, True),
        )
        return "tools", StructuredOutputs(json=json_schema_text(schema))

    def grammar_checks(self) -> list[tuple[str, StructuredOutputs]]:
        """With a forced tool call, each tool's parameters on its own first (the error
        names its tool), then the grammar of the call."""
        checks = super().grammar_checks()
        if self.tool_mode not in (ToolMode.REQUIRED, ToolMode.NAMED):
            return checks
        params = [
            (f"tools[{i}].function.parameters", t.function.parameters)
            for i, t in enumerate(self.tools or [])
            if t.function.parameters is not None
        ]
        own = [(f, StructuredOutputs(json=json_schema_text(p))) for f, p in params]
        return own + checks

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Engine top-k for ``logprobs: true`` (+ ``top_logprobs``), None when off."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            return None
        return _check_top(_or(self.top_logprobs, 0), "top_logprobs")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's JSON object of token id (a string) -> bias, keyed by int."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
    return out


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_top(k: int | None, name: str) -> int | None:
    # Named here so the error names the request's field; the upper bound is the
    # deployment's max_logprobs, checked by InputProcessor.check.
    if k is not None and k < 0:
        raise ValueError(f"{name} must be >= 0, got {k}")
    return k


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one token of one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: one entry per prompt token, the first null (nothing precedes
# it), the others token id -> PromptLogprob (the prompt's token plus the top-k).
PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # null unless asked (vLLM's shape)
    # With ``return_token_ids`` (the prompt's in a stream's first chunk of the choice).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _WithoutUnusedParts(BaseModel):
    # Keys left out while null: a reply without thinking or calls has none (OpenAI sends
    # none), nor a stream chunk vLLM's extras it does not carry.
    _omitted_when_null: ClassVar[tuple[str, ...]] = ("reasoning_content", "tool_calls")

    @model_serializer(mode="wrap")
    def _without_unused(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        d = dump(self)
        for key in self._omitted_when_null:
            if d.get(key) is None:
                d.pop(key, None)
        return d


class ChatMessageOut(_WithoutUnusedParts):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # null unless asked (vLLM's shape)
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first has its id, type and name; the others
    continue ``function.arguments`` (the openai SDK joins them by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_WithoutUnusedParts):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @field_serializer("tool_calls")
    def _pieces(self, calls: list[DeltaToolCall] | None) -> list[dict[str, Any]] | None:
        # Unset parts are left out, not null: the openai SDK's stream assembly takes a
        # later piece's null "type" as the call's type.
        return None if calls is None else [c.model_dump(exclude_none=True) for c in calls]


class ChatStreamChoice(_WithoutUnusedParts):
    _omitted_when_null = ("token_ids",)
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # this delta's, with return_token_ids


class ChatCompletionChunk(_WithoutUnusedParts):
    # vLLM's extras, each in one chunk only: the prompt's ids in each choice's first
    # (role) chunk, its logprobs in the first chunk with output.
    _omitted_when_null = ("prompt_token_ids", "prompt_logprobs")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "tidal"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- logprob conversions -----------------------------------------------------------------


def _clamp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of one position (the engine's top-k, by value)."""
    return sorted(step.items(), key=lambda kv: -kv[1].logprob)[:k]


def _text(tok: int, lp: Logprob | None, tokenizer: Any, as_ids: bool = False) -> str:
    """A logprob entry's token: its text, or "token_id:<id>" under
    ``return_tokens_as_token_ids`` (two tokens may decode to the same text)."""
    if as_ids:
        return f"token_id:{tok}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tok])


def prompt_logprobs_out(steps: list[dict[int, Logprob] | None]) -> PromptLogprobsOut:
    """The engine's prompt logprobs (decoded) in vLLM's JSON shape, -inf clamped."""
    return [
        None
        if step is None
        else {
            str(t): PromptLogprob(
                logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for t, lp in step.items()
        }
        for step in steps
    ]


def completion_logprobs(
    token_ids: list[int],
    steps: list[dict[int, Logprob] | None],
    k: int,
    tokenizer: Any,
    text_offset: int = 0,
    as_ids: bool = False,
) -> CompletionLogProbs:
    """OpenAI completions logprobs: per token its text, logprob, top-k dict and offset.

    ``steps[i]`` maps token id -> Logprob for position i (the chosen token and the
    top-k); None for a position without logprobs (the first prompt token under echo).
    The sampled token is always reported, so a top dict may hold k + 1 entries. The
    dicts are keyed by text, so tokens of equal text share an entry unless ``as_ids``.
    Offsets count the text, not the "token_id:" names.
    """
    out = CompletionLogProbs()
    for tok, step in zip(token_ids, steps):
        chosen = step.get(tok) if step else None
        text = _text(tok, chosen, tokenizer, as_ids)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(_text(tok, chosen, tokenizer) if as_ids else text)
        out.token_logprobs.append(None if chosen is None else _clamp(chosen.logprob))
        if step is None:
            out.top_logprobs.append(None)
            continue
        # The chosen token first (as vLLM orders it), then the most likely: a text that
        # repeats keeps its first entry.
        top: dict[str, float] = {}
        if chosen is not None:
            top[text] = _clamp(chosen.logprob)
        for t, lp in _top(step, k):
            top.setdefault(_text(t, lp, tokenizer, as_ids), _clamp(lp.logprob))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: list[int],
    steps: list[dict[int, Logprob]],
    k: int,
    tokenizer: Any,
    as_ids: bool = False,
) -> ChatLogProbs:
    """OpenAI chat logprobs: ``content`` entries with token, logprob, bytes, top_logprobs
    (tokens as "token_id:<id>" under ``as_ids``)."""
    content = []
    for tok, step in zip(token_ids, steps):
        chosen = step.get(tok)
        text = _text(tok, chosen, tokenizer, as_ids)
        entry = ChatLogprobEntry(
            token=text,
            logprob=_clamp(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
            bytes=list(text.encode("utf-8")),
        )
        for t, lp in _top(step, k):
            s = _text(t, lp, tokenizer, as_ids)
            entry.top_logprobs.append(
                ChatTokenLogprob(token=s, logprob=_clamp(lp.logprob), bytes=list(s.encode("utf-8")))
            )
        content.append(entry)
    return ChatLogProbs(content=content)
