"""Tool calls in chat outputs (docs/operations.md#tool-calling-and-reasoning).

How a request's tools are called (``ToolMode``, from ``tool_choice``):

- ``AUTO``: the model decides, in its own format; ``--tool-call-parser`` picks the parser
  of that format from ``TOOL_PARSERS`` (text between markers, ``MarkupToolStream``).
- ``REQUIRED`` and ``NAMED``: a grammar forces the output (``forced_tool_schema``, a JSON
  schema compiled like any structured output): a JSON array of ``{"name", "parameters"}``
  calls, or the named function's arguments alone; ``ForcedToolStream`` reads them back.

Every parser is a stream fed the output's text delta by delta; it holds back only what
may still become a marker, so a streamed output yields the same calls as its whole text
(the non-streaming path feeds the text once). ``ChatOutputStream`` puts the reasoning
split (``tidal.launch.reasoning``) in front of the tool parser.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tidal.launch.reasoning import ReasoningStream, held_prefix


class ToolMode(enum.Enum):
    NONE = "none"  # tools only inform the template; the output is content
    AUTO = "auto"  # parsed by the server's --tool-call-parser
    REQUIRED = "required"  # one or more calls, forced by a grammar
    NAMED = "named"  # one call of the named function, forced by a grammar


_NON_SPACE = re.compile(r"\S")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of the call at ``index``: its first piece has the id and the name, the
    others continue ``arguments`` (a JSON text, as OpenAI's ``function.arguments``)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def assemble(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their pieces, by index (as the openai SDK assembles a stream)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None, d
            calls[d.index] = ToolCall(d.id, d.name, "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


class ToolStream(ABC):
    """One output's tool calls, fed its text delta by delta."""

    @abstractmethod
    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call pieces) of ``text`` given what came before; ``final``: nothing
        follows, so nothing is held back."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Calls started so far."""


# ---- auto: each model family's own format ---------------------------------------------


class ToolParser(ABC):
    """A model family's tool-call format: a section opened by ``start`` (and closed by
    ``end``, where the format has one) holding calls between ``call_begin`` and
    ``call_end``; ``parse_call`` reads one call's text."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str | None]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    @abstractmethod
    def parse_call(self, body: str) -> tuple[str, str] | None:
        """(function name, arguments as JSON text) of the text between ``call_begin`` and
        ``call_end``; None when it is not a call (it is then kept as content)."""


def _arguments_text(args: Any) -> str:
    # A string is taken as the JSON text of the arguments (some models write it so).
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """Hermes and Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one block per call."""

    name = "hermes"
    start = "<tool_call>"
    end = None
    call_begin = "<tool_call>"
    call_end = "</tool_call>"

    def parse_call(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return obj["name"], _arguments_text(obj.get("arguments", obj.get("parameters", {})))


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3: a section ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` of
    calls ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced JSON block of
    the arguments + ``<｜tool▁call▁end｜>``. These markers are special tokens: the
    server keeps them in the text of a request it parses."""

    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    def parse_call(self, body: str) -> tuple[str, str] | None:
        kind, sep, rest = body.partition(self.sep)
        name, _, args = rest.partition("\n")
        args = args.strip()
        if not sep or kind.strip() != "function" or not name.strip():
            return None
        if not (args.startswith("```json") and args.endswith("```")):
            return None
        try:
            parsed = json.loads(args[len("```json") : -len("```")])
        except ValueError:
            return None
        return name.strip(), _arguments_text(parsed)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, DeepSeekV3ToolParser)
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"--tool-call-parser: unknown parser {name!r}; one of {', '.join(TOOL_PARSERS)}"
        ) from None


class MarkupToolStream(ToolStream):
    """An output in a ``ToolParser``'s format: text outside the call section is content,
    each complete call one piece (id, name and all its arguments). A call that does not
    parse, and an unfinished one at the end, stay content, as written."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # 1 with parallel_tool_calls false: later calls dropped
        self._buf = ""
        self._in_section = False
        self._opened = ""  # the section's start marker, when consumed (content if it fails)
        self._calls = 0
        self._searched = 0  # where the search for the open call's end resumes

    @property
    def num_calls(self) -> int:
        return self._calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        p = self.parser
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._in_section:
                i = self._buf.find(p.start)
                if i < 0:
                    keep = 0 if final else held_prefix(self._buf, p.start)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:i])
                # A format whose section is its calls keeps the marker: it opens the call.
                skip = len(p.start) if p.start != p.call_begin else 0
                self._opened = self._buf[i : i + skip]
                self._buf = self._buf[i + skip :]
                self._in_section = True
                continue
            m = _NON_SPACE.search(self._buf)
            k = len(self._buf) if m is None else m.start()
            if p.end is not None and self._buf.startswith(p.end, k):
                self._buf, self._in_section = self._buf[k + len(p.end) :], False
                self._opened = ""
                continue
            if self._buf.startswith(p.call_begin, k):
                body = k + len(p.call_begin)
                # Searched from where the last feed's search stopped: a long call's
                # text is scanned once, not once per delta.
                j = self._buf.find(p.call_end, max(body, self._searched))
                if j < 0:
                    self._searched = max(body, len(self._buf) - len(p.call_end) + 1)
                    if final:  # cut off inside a call: what was written is content
                        content.append(self._opened + self._buf)
                        self._buf = ""
                    break
                raw = self._buf[k : j + len(p.call_end)]
                parsed = p.parse_call(self._buf[body:j])
                self._buf, self._searched = self._buf[j + len(p.call_end) :], 0
                if parsed is None:
                    content.append(self._opened + raw)
                elif self.max_calls is None or self._calls < self.max_calls:
                    calls.append(ToolCallDelta(self._calls, parsed[1], tool_call_id(), parsed[0]))
                    self._calls += 1
                self._opened = ""
                continue
            rest = self._buf[k:]
            may_continue = p.call_begin.startswith(rest) or (
                p.end is not None and p.end.startswith(rest)
            )
            if not final and may_continue:
                break  # whitespace or the start of a marker: wait for more
            if final and not rest:
                self._buf = ""  # whitespace after the calls is not content
                break
            # Text after the calls: content again (it may open another section).
            content.append(self._opened)
            self._in_section, self._opened = False, ""
            if final and may_continue:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(content), calls


# ---- required and named: forced by a grammar -------------------------------------------


def forced_tool_schema(
    tools: Sequence[tuple[str, dict[str, Any] | None]], named: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON schema an output must follow. ``tools``: (name, parameters schema) of each
    function; ``named``: the function tool_choice names (its arguments alone), None for
    ``required`` (an array of one call, or of one or more with ``parallel``)."""
    params = {name: p if p is not None else {"type": "object"} for name, p in tools}
    if named is not None:
        return params[named]
    calls = [
        {
            "type": "object",
            # "name" first: a stream can name the call before its arguments come.
            "properties": {"name": {"const": name}, "parameters": p},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, p in params.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class _Call:
    name: str | None = None
    args_start: int | None = None  # offsets of the "parameters" value in the text
    args_end: int | None = None
    sent: int = -1  # text offset up to which arguments were sent; -1: no header yet
    id: str = field(default_factory=tool_call_id)


class ForcedToolStream(ToolStream):
    """An output forced by ``forced_tool_schema``. Named: the whole text is the
    arguments of the one call. Required: a JSON array scanned as it comes, each call
    named once its ``"name"`` string is complete, its ``"parameters"`` text sent as
    it is written (the pieces join to the exact text of that JSON value)."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self._text = ""
        self._calls: list[_Call] = []
        # The scanner: position, nesting depth, string state, and inside a call object
        # (depth 2) what is expected next.
        self._pos = 0
        self._depth = 0
        self._in_str = False
        self._escape = False
        self._str_start = 0
        self._state = "key"  # key | colon | value | string | container | scalar | after
        self._key: str | None = None
        self._value_start = 0

    @property
    def num_calls(self) -> int:
        if self.named is not None:
            return len(self._calls)
        return sum(c.sent >= 0 for c in self._calls)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self.named is not None:
            if not self._calls:
                if not text:  # e.g. still thinking: the call has not begun
                    return "", []
                self._calls.append(_Call(self.named))
                return "", [ToolCallDelta(0, text, self._calls[0].id, self.named)]
            return "", [ToolCallDelta(0, text)] if text else []
        self._text += text
        self._scan()
        out = []
        for i, call in enumerate(self._calls):
            if call.name is None:
                break  # calls are named in order
            if call.sent < 0:
                out.append(ToolCallDelta(i, "", call.id, call.name))
                call.sent = call.args_start if call.args_start is not None else 0
            if call.args_start is None:
                continue
            end = call.args_end if call.args_end is not None else len(self._text)
            start = max(call.sent, call.args_start)
            if end > start:
                out.append(ToolCallDelta(i, self._text[start:end]))
                call.sent = end
        if final and self.num_calls == 0:
            return self._text, []  # not a call at all (a cut-off output): content
        return "", out

    def _scan(self) -> None:
        text = self._text
        while self._pos < len(text):
            i, c = self._pos, text[self._pos]
            self._pos += 1
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 2:
                        self._end_string(i)
                continue
            if c == '"':
                self._in_str, self._str_start = True, i
                if self._depth == 2 and self._state == "value":
                    self._start_value(i)
                    self._state = "string"
            elif c in "{[":
                if self._depth == 1 and c == "{":
                    self._calls.append(_Call())
                    self._state = "key"
                elif self._depth == 2 and self._state == "value":
                    self._start_value(i)
                    self._state = "container"
                self._depth += 1
            elif c in "}]":
                if self._depth == 2 and self._state == "scalar":
                    self._end_value(i)
                self._depth -= 1
                if self._depth == 2 and self._state == "container":
                    self._end_value(i + 1)
            elif self._depth == 2:
                if c == ":" and self._state == "colon":
                    self._state = "value"
                elif c == ",":
                    if self._state == "scalar":
                        self._end_value(i)
                    self._state = "key"
                elif not c.isspace() and self._state == "value":
                    self._start_value(i)
                    self._state = "scalar"

    def _end_string(self, i: int) -> None:
        raw = self._text[self._str_start : i + 1]
        if self._state == "key":
            self._key = json.loads(raw)
            self._state = "colon"
        elif self._state == "string":
            if self._key == "name" and self._calls:
                self._calls[-1].name = json.loads(raw)
            self._end_value(i + 1)

    def _start_value(self, i: int) -> None:
        self._value_start = i
        if self._key == "parameters" and self._calls:
            self._calls[-1].args_start = i

    def _end_value(self, end: int) -> None:
        if self._key == "parameters" and self._calls:
            self._calls[-1].args_end = len(self._text[:end].rstrip())
        self._state = "after"


# ---- reasoning, then tools -----------------------------------------------------------


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutputStream:
    """One chat choice's text split into reasoning, content and tool calls: the reasoning
    parser first, the tool parser on what follows the thinking."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        out = ChatDelta(content=text)
        if self.reasoning is not None:
            out.reasoning, out.content = self.reasoning.feed(text, final)
        if self.tools is not None:
            out.content, out.tool_calls = self.tools.feed(out.content, final)
        return out

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0
