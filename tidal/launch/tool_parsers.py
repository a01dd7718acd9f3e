"""Tool calls in chat outputs (docs/operations.md#tool-calling-and-reasoning).

How a request's tools are called (``ToolMode``, from ``tool_choice``):

- ``AUTO``: the model decides, in its own format; ``--tool-call-parser`` picks the parser
  of that format from ``TOOL_PARSERS`` (text between markers, ``MarkupToolStream``).
- ``REQUIRED`` and ``NAMED``: a grammar forces the output (``forced_tool_schema``, a JSON
  schema compiled like any structured output): a JSON array of ``{"name", "parameters"}``
  calls, or the named function's arguments alone; ``ForcedToolStream`` reads them back.

Every parser is a stream fed the output's text delta by delta: a call is sent (its id and
name) as soon as it is known to be one, then its arguments as they are written (a JSON
text, checked as it comes by ``JsonCallScan``). It holds back only what may still become
a marker, or a call's first text until that is known; each decision is taken at the
first character that allows it, so a streamed output yields the same content and calls
as its whole text however it is split (the non-streaming path feeds the text once).
``ChatOutputStream`` puts the reasoning split (``tidal.launch.reasoning``) in front of
the tool parser.
"""

from __future__ import annotations

import enum
import json
import re
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, assert_never

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


# ---- calls read out of JSON text as it is written ------------------------------------


@dataclass
class _Call:
    """A call found in JSON text: its name and the offsets of its arguments' value."""

    name: str | None = None
    bad_name: bool = False  # its "name" is not a string: not a call
    args_start: int | None = None
    args_end: int | None = None
    args_string: bool = False  # the arguments are a string: the JSON text they hold
    announced: bool = False  # its first piece (id and name) was sent
    sent: int = 0  # text offset up to which its arguments were sent
    id: str = field(default_factory=tool_call_id)


class _Expect(enum.Enum):
    """What a JSON container (or the top level) expects next."""

    VALUE = enum.auto()
    VALUE_OR_CLOSE = enum.auto()  # an array's first value, or its ]
    KEY = enum.auto()
    KEY_OR_CLOSE = enum.auto()  # an object's first key, or its }
    COLON = enum.auto()
    AFTER = enum.auto()  # a value ended: , or the container's close


_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
# A prefix of a number (checked as each character comes; _SCALAR checks the whole).
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9]\d*)?(?:\.\d*)?(?:[eE][+-]?\d*)?")
_LITERALS = ("true", "false", "null")


class JsonCallScan:
    """Calls in JSON text, scanned as it comes (each character once). Every object at
    nesting ``depth`` is a call: its ``"name"`` string names it, the value of the first of
    ``arg_keys`` is its arguments, whose offsets in the text say what is written of them
    so far. ``depth`` 0: the text is one value, the arguments of a call named elsewhere.

    The text is checked as JSON: ``error`` is set at the first character that no JSON
    text may have there (the scan stops before it), so the arguments written up to it are
    always the start of some JSON text. ``done``: the top-level value ended."""

    def __init__(self, depth: int, arg_keys: tuple[str, ...]) -> None:
        self.depth = depth
        self.arg_keys = arg_keys
        self.calls: list[_Call] = [_Call()] if depth == 0 else []
        self.pos = 0  # text scanned up to here
        self.error = False
        self.done = False
        self._stack: list[list[Any]] = []  # per open container: [its bracket, _Expect]
        self._top = _Expect.VALUE  # the top level's
        self._in_str = False
        self._escape = False
        self._hex = 0  # hex digits still owed to a \u escape
        self._str_start = 0
        self._scalar_start: int | None = None
        self._key: str | None = arg_keys[0] if depth == 0 else None  # at the call level
        self._in_args = False  # the value being written is a call's arguments

    def scan(self, text: str, end: int) -> None:
        """Scans ``text`` up to ``end`` (the text before ``pos`` must not change)."""
        while self.pos < end and not (self.error or self.done):
            i, c = self.pos, text[self.pos]
            if self._in_str:
                if c < " " or not self._string_char(c):
                    self.error = True  # a control character or a bad escape
                    return
                self.pos += 1
                if c == '"' and not self._in_str:
                    self._string_end(text, i)
                continue
            if self._scalar_start is not None:
                if not (c.isspace() or c in ",}]"):
                    token = text[self._scalar_start : i + 1]
                    if not _scalar_prefix(token):
                        self.error = True
                        return
                    self.pos += 1
                    continue
                if not _SCALAR.fullmatch(text[self._scalar_start : i]):
                    self.error = True
                    return
                self._scalar_start = None
                self._value_end(i)
                if self.done:
                    return
            if not c.isspace() and not self._structure(text, i, c):
                self.error = True
                return
            self.pos += 1

    def _string_char(self, c: str) -> bool:
        """One character inside a string (ends it at its closing quote); False: not JSON."""
        if self._hex:
            self._hex -= 1
            return c in string.hexdigits
        if self._escape:
            self._escape = False
            if c == "u":
                self._hex = 4
            return c in '"\\/bfnrtu'
        if c == "\\":
            self._escape = True
        elif c == '"':
            self._in_str = False
        return True

    def _expect(self) -> _Expect:
        return self._stack[-1][1] if self._stack else self._top

    def _set(self, e: _Expect) -> None:
        if self._stack:
            self._stack[-1][1] = e
        else:
            self._top = e

    def _structure(self, text: str, i: int, c: str) -> bool:
        """One character outside strings and scalars; False: not JSON."""
        e = self._expect()
        if e in (_Expect.VALUE, _Expect.VALUE_OR_CLOSE):
            if c == "]" and e is _Expect.VALUE_OR_CLOSE:
                return self._close(i)
            return self._value_start(text, i, c)
        if e in (_Expect.KEY, _Expect.KEY_OR_CLOSE):
            if c == "}" and e is _Expect.KEY_OR_CLOSE:
                return self._close(i)
            if c != '"':
                return False
            self._in_str, self._str_start = True, i
            return True
        if e is _Expect.COLON:
            self._set(_Expect.VALUE)
            return c == ":"
        assert e is _Expect.AFTER
        if not self._stack:
            return False  # a second top-level value
        bracket = self._stack[-1][0]
        if c == ",":
            self._set(_Expect.KEY if bracket == "{" else _Expect.VALUE)
            return True
        if c == ("}" if bracket == "{" else "]"):
            return self._close(i)
        return False

    def _at_call(self) -> bool:
        """The value starting or ending now is a call's member (or the depth-0 value)."""
        if self.depth == 0:
            return not self._stack
        return len(self._stack) == self.depth and self._stack[-1][0] == "{"

    def _value_start(self, text: str, i: int, c: str) -> bool:
        if self.depth == 1 and not self._stack and c != "{":
            return False  # the text is one call object
        if self._at_call():
            call = self.calls[-1]
            if self._key == "name" and c != '"':
                call.bad_name = True
            if self._key in self.arg_keys and call.args_start is None:
                call.args_start, call.args_string = i, c == '"'
                self._in_args = True
        if c == '"':
            self._in_str, self._str_start = True, i
            self._set(_Expect.AFTER)  # once the string ends
        elif c in "{[":
            self._set(_Expect.AFTER)  # once the container closes
            self._stack.append([c, _Expect.KEY_OR_CLOSE if c == "{" else _Expect.VALUE_OR_CLOSE])
            if c == "{" and self.depth > 0 and len(self._stack) == self.depth:
                self.calls.append(_Call())
                self._key = None
        elif c == "-" or c.isdigit() or c in "tfn":
            self._scalar_start = i
            self._set(_Expect.AFTER)
        else:
            return False
        return True

    def _string_end(self, text: str, i: int) -> None:
        e = self._expect()
        key = e in (_Expect.KEY, _Expect.KEY_OR_CLOSE)
        if key:
            self._set(_Expect.COLON)
        if not self._at_call():
            return
        raw = text[self._str_start : i + 1]
        if key:
            try:
                self._key = json.loads(raw)
            except ValueError:
                self.error = True
            return
        if self._key == "name" and self.calls[-1].name is None:
            try:
                self.calls[-1].name = json.loads(raw)
            except ValueError:
                self.error = True
                return
        self._value_end(i + 1)

    def _close(self, i: int) -> bool:
        self._stack.pop()
        if self._at_call() or (self.depth == 0 and not self._stack):
            self._value_end(i + 1)
        elif not self._stack:
            self.done = True
        return True

    def _value_end(self, end: int) -> None:
        """A value at the call level (or the depth-0 value) ended at ``end``."""
        if not self._at_call():
            if not self._stack:
                self.done = True
            return
        if self._in_args:
            self.calls[-1].args_end = end
            self._in_args = False
        if not self._stack:
            self.done = True

    def take_args(self, call: _Call, text: str) -> str:
        """The arguments of ``call`` written since the last take: a JSON value's text as
        written, piece by piece; a string whole once it ends, decoded (the JSON text a
        model wrote as a string)."""
        if call.args_start is None:
            return ""
        end = call.args_end
        if end is None and not call.args_string and call is self.calls[-1] and self._in_args:
            end = self.pos  # all scanned so far is the value's (a scan stops at an error)
        if end is None or end <= call.sent:
            return ""
        start, call.sent = max(call.sent, call.args_start), end
        if not call.args_string:
            return text[start:end]
        raw = text[call.args_start : end]
        try:
            return json.loads(raw)  # a JSON string: the text it holds
        except ValueError:
            return raw


def _scalar_prefix(token: str) -> bool:
    """``token`` may still become a JSON number or literal."""
    return any(w.startswith(token) for w in _LITERALS) or bool(_NUMBER_PREFIX.fullmatch(token))


# ---- auto: each model family's own format ---------------------------------------------


class CallVerdict(enum.Enum):
    UNDECIDED = enum.auto()  # the text so far may still be a call, or not
    CALL = enum.auto()  # named, its arguments begun: sent from now on
    NOT_A_CALL = enum.auto()  # its text is content, as written


class CallReader(ABC):
    """One call's text (what follows ``call_begin``), read as it comes: whether it is a
    call, then its name and its arguments as they are written. Its decisions depend only
    on the text, never on how it was split: each is taken at the first character that
    allows it."""

    verdict: CallVerdict = CallVerdict.UNDECIDED
    name: str | None = None  # once a call

    @abstractmethod
    def read(self, body: str, end: int) -> None:
        """Reads ``body`` up to ``end`` (what may be the start of ``call_end`` is not
        read yet); ``body`` only grows."""

    @abstractmethod
    def arguments(self, body: str) -> str:
        """The call's arguments written since the last time (JSON text)."""


class ToolParser(ABC):
    """A model family's tool-call format: a section opened by ``start`` (and closed by
    ``end``, where the format has one) holding calls between ``call_begin`` and
    ``call_end``; ``reader`` reads one call's text."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str | None]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    @abstractmethod
    def reader(self) -> CallReader: ...


class _JsonObjectReader(CallReader):
    """A call written as one JSON object ``{"name": ..., "arguments": {...}}``: a call
    once its name is read and its arguments have begun (or it ended without any: ``{}``);
    not one if it is not such an object before that."""

    def __init__(self) -> None:
        self.scan = JsonCallScan(1, ("arguments", "parameters"))
        self._empty_sent = False

    def read(self, body: str, end: int) -> None:
        s = self.scan
        s.scan(body, end)
        if self.verdict is not CallVerdict.UNDECIDED:
            return
        call = s.calls[0] if s.calls else None
        if call is not None and call.name is not None and (call.args_start is not None or s.done):
            self.verdict, self.name = CallVerdict.CALL, call.name
        elif s.error or s.done or (call is not None and call.bad_name):
            self.verdict = CallVerdict.NOT_A_CALL

    def arguments(self, body: str) -> str:
        call = self.scan.calls[0]
        if call.args_start is None:
            if self.scan.done and not self._empty_sent:  # no arguments: none needed
                self._empty_sent = True
                return "{}"
            return ""
        return self.scan.take_args(call, body)


class HermesToolParser(ToolParser):
    """Hermes and Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one block per call."""

    name = "hermes"
    start = "<tool_call>"
    end = None
    call_begin = "<tool_call>"
    call_end = "</tool_call>"

    def reader(self) -> CallReader:
        return _JsonObjectReader()


_FENCE = "```json"


class _DeepSeekV3Reader(CallReader):
    """``function<｜tool▁sep｜>NAME`` + newline + a fenced JSON block of the arguments: a
    call once the block's value begins; the value is read as JSON (what follows it, the
    closing fence, is not)."""

    def __init__(self, sep: str) -> None:
        self.sep = sep
        self.scan: JsonCallScan | None = None

    def read(self, body: str, end: int) -> None:
        if self.verdict is CallVerdict.UNDECIDED:
            self._head(body[:end])
        if self.scan is not None:
            self.scan.scan(body, end)

    def _head(self, s: str) -> None:
        k = s.find(self.sep)
        if k < 0:
            return
        if s[:k].strip() != "function":
            self.verdict = CallVerdict.NOT_A_CALL
            return
        nl = s.find("\n", k + len(self.sep))
        if nl < 0:
            return
        name = s[k + len(self.sep) : nl].strip()
        rest = s[nl + 1 :]
        fence = rest.lstrip()
        if not name or not (fence.startswith(_FENCE) or _FENCE.startswith(fence)):
            self.verdict = CallVerdict.NOT_A_CALL
            return
        m = _NON_SPACE.search(fence, len(_FENCE))
        if m is None:
            return
        self.verdict, self.name = CallVerdict.CALL, name
        self.scan = JsonCallScan(0, ("arguments",))
        self.scan.pos = len(s) - len(fence) + m.start()

    def arguments(self, body: str) -> str:
        if self.scan is None:
            return ""
        return self.scan.take_args(self.scan.calls[0], body)


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

    def reader(self) -> CallReader:
        return _DeepSeekV3Reader(self.sep)


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


class _At(enum.Enum):
    """Where a ``MarkupToolStream`` is in its output."""

    CONTENT = enum.auto()  # outside the calls
    BETWEEN = enum.auto()  # in the call section, between calls
    HEAD = enum.auto()  # a call's first text: held until it is known to be a call
    ARGS = enum.auto()  # a call's arguments: sent as they are written
    SKIP = enum.auto()  # a block that is not a call: content, up to its end marker


class MarkupToolStream(ToolStream):
    """An output in a ``ToolParser``'s format: text outside the call section is content;
    a call is sent once its reader knows it is one (its id and name), then its arguments
    as they are written. Text that may still become a marker, or a call's text before it
    is known to be one, is held back; a block that is not a call stays content, as
    written. An output cut inside a call's arguments keeps the call, with what was
    written of them (as OpenAI's replies cut by their token limit)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # 1 with parallel_tool_calls false: later calls dropped
        self._buf = ""  # text not yet sent; in a call, all of it since call_begin
        self._at = _At.CONTENT
        # The section's start marker while no call of it was sent, then the whitespace
        # and the call_begin of the call being read: content if it is not a call.
        self._held = ""
        self._reader: CallReader | None = None
        self._index: int | None = None  # the call's index; None: dropped (max_calls)
        self._calls = 0
        self._searched = 0  # where the search for the call's end resumes

    @property
    def num_calls(self) -> int:
        return self._calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            match self._at:
                case _At.CONTENT:
                    going = self._content(content, final)
                case _At.BETWEEN:
                    going = self._between(content, final)
                case _At.HEAD | _At.ARGS:
                    going = self._call(content, calls, final)
                case _At.SKIP:
                    going = self._skip(content, final)
                case _:
                    assert_never(self._at)
            if not going:
                return "".join(content), calls

    def _content(self, content: list[str], final: bool) -> bool:
        p = self.parser
        i = self._buf.find(p.start)
        if i < 0:
            keep = 0 if final else held_prefix(self._buf, p.start)
            content.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        content.append(self._buf[:i])
        # A format whose section is its calls keeps the marker: it opens the call.
        skip = len(p.start) if p.start != p.call_begin else 0
        self._held = self._buf[i : i + skip]
        self._buf = self._buf[i + skip :]
        self._at = _At.BETWEEN
        return True

    def _between(self, content: list[str], final: bool) -> bool:
        p = self.parser
        m = _NON_SPACE.search(self._buf)
        k = len(self._buf) if m is None else m.start()
        if p.end is not None and self._buf.startswith(p.end, k):
            self._buf, self._held, self._at = self._buf[k + len(p.end) :], "", _At.CONTENT
            return True
        if self._buf.startswith(p.call_begin, k):
            self._held += self._buf[: k + len(p.call_begin)]
            self._buf = self._buf[k + len(p.call_begin) :]
            self._reader, self._searched, self._at = p.reader(), 0, _At.HEAD
            return True
        rest = self._buf[k:]
        may_continue = p.call_begin.startswith(rest) or (
            p.end is not None and p.end.startswith(rest)
        )
        if not final and may_continue:
            return False  # whitespace or the start of a marker: wait for more
        if final and not rest:
            self._buf = ""  # whitespace after the calls is not content
            return False
        # Text after the calls: content again (it may open another section).
        content.append(self._held)
        self._held, self._at = "", _At.CONTENT
        return True

    def _call(self, content: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        p, reader = self.parser, self._reader
        assert reader is not None
        # Searched from where the last feed's search stopped: a long call's text is
        # scanned once, not once per delta.
        j = self._buf.find(p.call_end, self._searched)
        if j >= 0:
            end = j
        else:
            end = len(self._buf) if final else len(self._buf) - held_prefix(self._buf, p.call_end)
            self._searched = max(0, len(self._buf) - len(p.call_end) + 1)
        reader.read(self._buf, end)
        if self._at is _At.HEAD:
            verdict = reader.verdict
            if verdict is CallVerdict.NOT_A_CALL or (
                verdict is CallVerdict.UNDECIDED and (j >= 0 or final)
            ):
                content.append(self._held)  # then the rest of the block, as written
                self._held, self._at = "", _At.SKIP
                return True
            if verdict is CallVerdict.UNDECIDED:
                return False
            assert reader.name is not None
            self._held, self._at, self._index = "", _At.ARGS, None
            if self.max_calls is None or self._calls < self.max_calls:
                self._index, self._calls = self._calls, self._calls + 1
                calls.append(ToolCallDelta(self._index, "", tool_call_id(), reader.name))
        args = reader.arguments(self._buf)
        if args and self._index is not None:
            calls.append(ToolCallDelta(self._index, args))
        if j < 0:
            if final:
                self._buf = ""  # cut off inside the call: it keeps what was written
            return False
        self._buf, self._reader, self._at = self._buf[j + len(p.call_end) :], None, _At.BETWEEN
        return True

    def _skip(self, content: list[str], final: bool) -> bool:
        end = self.parser.call_end
        j = self._buf.find(end)
        if j < 0:
            keep = 0 if final else held_prefix(self._buf, end)
            content.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        content.append(self._buf[: j + len(end)])
        self._buf, self._at = self._buf[j + len(end) :], _At.BETWEEN
        return True


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


class ForcedToolStream(ToolStream):
    """An output forced by ``forced_tool_schema``. Named: the whole text is the
    arguments of the one call. Required: a JSON array scanned as it comes, each call
    named once its ``"name"`` string is complete, its ``"parameters"`` text sent as
    it is written (the pieces join to the exact text of that JSON value)."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self._text = ""
        self._named_started = False
        self._scan = JsonCallScan(2, ("parameters",))  # [{"name", "parameters"}, ...]

    @property
    def num_calls(self) -> int:
        if self.named is not None:
            return int(self._named_started)
        return sum(c.announced for c in self._scan.calls)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self.named is not None:
            if not self._named_started:
                if not text:  # e.g. still thinking: the call has not begun
                    return "", []
                self._named_started = True
                return "", [ToolCallDelta(0, text, tool_call_id(), self.named)]
            return "", [ToolCallDelta(0, text)] if text else []
        self._text += text
        self._scan.scan(self._text, len(self._text))
        out = []
        for i, call in enumerate(self._scan.calls):
            if call.name is None:
                break  # calls are named in order
            if not call.announced:
                out.append(ToolCallDelta(i, "", call.id, call.name))
                call.announced = True
            args = self._scan.take_args(call, self._text)
            if args:
                out.append(ToolCallDelta(i, args))
        if final and self.num_calls == 0:
            return self._text, []  # not a call at all (a cut-off output): content
        return "", out


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
