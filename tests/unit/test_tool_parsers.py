"""Tool-call and reasoning parsers (tidal/launch/tool_parsers.py, tidal/launch/reasoning.py):
each fed an output whole, character by character and in random pieces must give the same
split, and output that is not a call stays content as written."""

from __future__ import annotations

import json
import random
import typing

import jsonschema
import pytest

from tidal.config import FrontendConfig
from tidal.frontend.processor import load_chat_template
from tidal.launch.engine_args import EngineArgs
from tidal.launch.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningStream,
    count_reasoning_tokens,
)
from tidal.launch.tool_parsers import (
    TOOL_PARSERS,
    ChatOutputStream,
    DeepSeekV3ToolParser,
    ForcedToolStream,
    HermesToolParser,
    JsonCallScan,
    MarkupToolStream,
    ToolCallDelta,
    ToolStream,
    assemble,
    forced_tool_schema,
)


def _pieces(text: str, how: str, rng: random.Random) -> list[str]:
    match how:
        case "whole":
            return [text]
        case "chars":
            return list(text)
        case _:
            out, i = [], 0
            while i < len(text):
                n = rng.randint(1, 7)
                out.append(text[i : i + n])
                i += n
            return out


FEEDS = ["whole", "chars", "random"]


def _run_tools(make: typing.Callable[[], ToolStream], text: str, how: str):
    stream, content, deltas = make(), [], []
    for piece in _pieces(text, how, random.Random(0)):
        c, d = stream.feed(piece)
        content.append(c)
        deltas += d
    c, d = stream.feed("", final=True)
    content.append(c)
    deltas += d
    calls = assemble(deltas)
    assert len({call.id for call in calls}) == len(calls)  # ids are unique
    return "".join(content), [(call.name, json.loads(call.arguments)) for call in calls]


HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "}{"]}}\n'
    "</tool_call>"
)


@pytest.mark.parametrize("how", FEEDS)
def test_hermes_calls_and_content(how):
    content, calls = _run_tools(lambda: MarkupToolStream(HermesToolParser()), HERMES, how)
    assert content == "Let me check. "
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "}{"]})]


@pytest.mark.parametrize("how", FEEDS)
@pytest.mark.parametrize(
    "text",
    [
        "no calls here, just < and <tool and </tool_call>",
        "x <tool_call>{oops}</tool_call> y",  # not JSON
        'x <tool_call>{"arguments": {}}</tool_call>',  # no name
        'x <tool_call>{"name": 5, "arguments": {}}</tool_call>',  # a name that is no string
        'x <tool_call>{"name": "f", "argu</tool_call> y',  # ended before its arguments
        "<tool_call>[1]</tool_call>",
        'cut off <tool_call>{"name": "f", "argu',  # the output ended before the arguments
        "ends with a marker's start <tool_ca",
    ],
)
def test_hermes_malformed_output_stays_content(how, text):
    content, calls = _run_tools(lambda: MarkupToolStream(HermesToolParser()), text, how)
    assert (content, calls) == (text, [])


def _raw_calls(make: typing.Callable[[], ToolStream], text: str, how: str):
    """(content, [(name, arguments text)]) without parsing the arguments."""
    stream, content, deltas = make(), [], []
    for piece in [*_pieces(text, how, random.Random(0)), None]:
        c, d = stream.feed("", final=True) if piece is None else stream.feed(piece)
        content.append(c)
        deltas += d
    return "".join(content), [(c.name, c.arguments) for c in assemble(deltas)]


@pytest.mark.parametrize("how", FEEDS)
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Cut by the token limit inside the arguments: the call keeps what was written.
        ('x <tool_call>{"name": "f", "arguments": {"a": [1, tr', ("x ", '{"a": [1, tr')),
        # Bad JSON once the arguments began: they stop where it stops being JSON.
        ('<tool_call>{"name": "f", "arguments": {"a": 1 oops}}</tool_call> y', (" y", '{"a": 1 ')),
        ('x <tool_call>{"name": "f", "arguments": {</tool_call> y', ("x  y", "{")),
        # Other spellings: arguments first, "parameters", a JSON string, none at all.
        ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', ("", '{"a": 1}')),
        ('<tool_call>\n {"name": "f", "parameters": [1, {}]}\n</tool_call>', ("", "[1, {}]")),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', ("", '{"a": 1}')),
        ('<tool_call>{"name": "f"}</tool_call>', ("", "{}")),
    ],
)
def test_hermes_arguments_as_written(how, text, expected):
    content, calls = _raw_calls(lambda: MarkupToolStream(HermesToolParser()), text, how)
    assert (content, calls) == (expected[0], [("f", expected[1])])


@pytest.mark.parametrize("how", FEEDS)
def test_hermes_text_after_calls_and_one_call_only(how):
    text = HERMES + "\nDone."
    content, calls = _run_tools(lambda: MarkupToolStream(HermesToolParser()), text, how)
    assert content == "Let me check. \nDone." and len(calls) == 2
    # parallel_tool_calls false: the first call only.
    _, calls = _run_tools(lambda: MarkupToolStream(HermesToolParser(), max_calls=1), text, how)
    assert calls == [("get_weather", {"city": "Paris"})]


DS = DeepSeekV3ToolParser
DEEPSEEK = (
    f"Sure.{DS.start}{DS.call_begin}function{DS.sep}get_weather\n```json\n"
    f'{{"city": "Tokyo"}}\n```{DS.call_end}\n{DS.call_begin}function{DS.sep}now\n```json\n'
    f"{{}}\n```{DS.call_end}{DS.end}"
)


@pytest.mark.parametrize("how", FEEDS)
def test_deepseek_v3_calls(how):
    content, calls = _run_tools(lambda: MarkupToolStream(DS()), DEEPSEEK, how)
    assert content == "Sure."
    assert calls == [("get_weather", {"city": "Tokyo"}), ("now", {})]
    content, calls = _run_tools(lambda: MarkupToolStream(DS()), DEEPSEEK + " after", how)
    assert content == "Sure. after" and len(calls) == 2


@pytest.mark.parametrize("how", FEEDS)
@pytest.mark.parametrize(
    "body",
    [
        "tool{sep}f\n```json\n{{}}\n```",  # not "function"
        "function{sep}\n```json\n{{}}\n```",  # no name
        "function{sep}f\n{{}}",  # no fence
        "function{sep}f\n```json\n",  # ended before the arguments
    ],
)
def test_deepseek_v3_malformed_stays_content(how, body):
    bad = f"a{DS.start}{DS.call_begin}{body.format(sep=DS.sep)}{DS.call_end} b"
    content, calls = _run_tools(lambda: MarkupToolStream(DS()), bad, how)
    assert (content, calls) == (bad, [])


@pytest.mark.parametrize("how", FEEDS)
def test_deepseek_v3_cut_calls_keep_what_was_written(how):
    cut = DEEPSEEK[: DEEPSEEK.index("Tokyo")]
    assert _raw_calls(lambda: MarkupToolStream(DS()), cut, how) == (
        "Sure.",
        [("get_weather", '{"city": "')],
    )
    bad = f"{DS.start}{DS.call_begin}function{DS.sep}f\n```json\n{{oops\n```{DS.call_end}"
    assert _raw_calls(lambda: MarkupToolStream(DS()), bad, how) == ("", [("f", "{")])


# Every split of these outputs streams as their whole text parses.
SPLIT_CASES = [
    (HermesToolParser, HERMES + "\nDone."),
    (HermesToolParser, 'a <tool_call>{"name": "f", "arguments": {"s": "x\\"}</tool_call>"}}'),
    (HermesToolParser, 'a <tool_call>{"name": "f", "arguments": {"n": -1.5e3, "t": [true]}'),
    (HermesToolParser, 'a <tool_call>{oops</tool_call> <tool_call>{"name": "g"}</tool_call>'),
    (DS, DEEPSEEK + " after"),
    (DS, DEEPSEEK[: DEEPSEEK.index("Tokyo") + 3]),
]


def _stream(parser: type, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    stream, content, deltas = MarkupToolStream(parser()), [], []
    for piece in [*pieces, None]:
        c, d = stream.feed("", final=True) if piece is None else stream.feed(piece)
        content.append(c)
        deltas += d
    return "".join(content), deltas


def _splits(text: str) -> typing.Iterator[list[str]]:
    yield list(text)  # character by character: every token boundary is one of these
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(5)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(("parser", "text"), SPLIT_CASES)
def test_every_split_streams_as_the_whole_text_parses(parser, text):
    whole, deltas = _stream(parser, [text])
    expected = (whole, [(c.name, c.arguments) for c in assemble(deltas)])
    for pieces in _splits(text):
        content, deltas = _stream(parser, pieces)
        assert (content, [(c.name, c.arguments) for c in assemble(deltas)]) == expected, pieces
        # Each call opens with its id, type and name and no arguments; the rest are
        # arguments only.
        seen: set[int] = set()
        for d in deltas:
            assert (d.index not in seen) == (d.id is not None) == (d.name is not None), d
            assert d.index in seen or d.arguments == ""
            seen.add(d.index)


def test_arguments_stream_as_they_are_written():
    """Fed as a model writes it, content comes before the call is complete, a tag's
    start is held back, and the arguments come in many pieces."""
    stream, sent = MarkupToolStream(HermesToolParser()), []
    for ch in HERMES:
        content, deltas = stream.feed(ch)
        sent.append((content, deltas))
        assert "<" not in content  # a possible tag is held until decided
    first_call = next(i for i, (_, d) in enumerate(sent) if d)
    assert "".join(c for c, _ in sent[:first_call]) == "Let me check. "
    pieces = [d.arguments for _, ds in sent for d in ds if d.index == 0 and d.id is None]
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "Paris"}'
    # The call was named before its arguments were complete.
    header = sent[first_call][1][0]
    assert header.name == "get_weather" and header.arguments == "" and header.id
    assert first_call < HERMES.index("Paris")


def _random_json(rng: random.Random, depth: int = 0) -> object:
    match rng.randint(0, 6 if depth < 3 else 3):
        case 0:
            return rng.choice([True, False, None])
        case 1:
            return rng.choice([0, -1, 12, 1.5, -0.25, 1e21, 3e-7])
        case 2 | 3:
            return "".join(rng.choice('ab"\\}{][,: é\n\u0001') for _ in range(rng.randint(0, 5)))
        case 4:
            return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        case _:
            return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_json_scan_takes_json_and_nothing_else():
    """The scanner's check: any JSON value (any spacing) is read whole, in any pieces;
    a value it accepts after a random character was put in parses."""
    rng = random.Random(7)
    for _ in range(400):
        text = json.dumps(_random_json(rng), ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1]))  # fmt: skip
        scan, cut = JsonCallScan(0, ("arguments",)), rng.randrange(len(text) + 1)
        scan.scan(text, cut)
        scan.scan(text + " ", len(text) + 1)
        call = scan.calls[0]
        assert scan.done and not scan.error and text[call.args_start : call.args_end] == text
        i = rng.randrange(len(text))
        bad = text[:i] + rng.choice(',:{}[]"x1 \\') + text[i:]
        scan = JsonCallScan(0, ("arguments",))
        scan.scan(bad + " ", len(bad) + 1)
        if scan.done and not scan.error:
            call = scan.calls[0]
            json.loads(bad[call.args_start : call.args_end])


TOOLS = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer"}}}),
    ("anything", None),
]


@pytest.mark.parametrize("how", FEEDS)
def test_forced_required_array_is_read_back_exactly(how):
    rng = random.Random(1)
    schema = forced_tool_schema(TOOLS, None, parallel=True)
    for _ in range(20):
        calls = []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(["get_weather", "add", "anything"])
            params: dict = {
                "get_weather": {"city": "".join(rng.choice('ab}{][",:\\é ') for _ in range(6))},
                "add": {"a": rng.randint(-5, 5)},
                "anything": {"x": [{"y": None}, True, 1.5]},
            }[name]
            calls.append({"name": name, "parameters": params})
        jsonschema.validate(calls, schema)
        # As xgrammar writes JSON (", " and ": "), and as any other spacing would come.
        for text in (json.dumps(calls, ensure_ascii=False), json.dumps(calls, indent=1)):
            content, got = _run_tools(lambda: ForcedToolStream(None), text, how)
            assert content == ""
            assert got == [(c["name"], c["parameters"]) for c in calls]


def test_forced_required_arguments_are_the_written_text():
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "f", "parameters": 7}]'
    stream = ForcedToolStream(None)
    deltas = [d for ch in text for d in stream.feed(ch)[1]] + stream.feed("", True)[1]
    assert [(c.name, c.arguments) for c in assemble(deltas)] == [("add", '{"a": 1}'), ("f", "7")]
    # The name comes first, the arguments in pieces after it.
    assert deltas[0].name == "add" and deltas[0].id and deltas[0].arguments == ""
    assert all(d.name is None and d.id is None for d in deltas[1:] if d.index == 0)
    assert len([d for d in deltas if d.index == 0]) > 2


def test_forced_schemas():
    required = forced_tool_schema(TOOLS, None, parallel=False)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], required)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "add", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    assert forced_tool_schema(TOOLS, "add", parallel=True) == TOOLS[1][1]
    assert forced_tool_schema(TOOLS, "anything", parallel=True) == {"type": "object"}


@pytest.mark.parametrize("how", FEEDS)
def test_forced_named_and_cut_off_outputs(how):
    content, calls = _run_tools(lambda: ForcedToolStream("add"), '{"a": 3}', how)
    assert (content, calls) == ("", [("add", {"a": 3})])
    # Nothing written yet (a reply still thinking): no call; none at all if it never is.
    assert ForcedToolStream("add").feed("") == ("", [])
    assert ForcedToolStream("add").feed("", final=True) == ("", [])
    # A required output cut before any call was named is content.
    content, calls = _run_tools(lambda: ForcedToolStream(None), '[{"na', how)
    assert (content, calls) == ('[{"na', [])


def _run_reasoning(parser, prompt, text, how):
    stream, r, c = ReasoningStream(parser, prompt), [], []
    for piece in [*_pieces(text, how, random.Random(2)), None]:
        a, b = stream.feed("", True) if piece is None else stream.feed(piece)
        r.append(a)
        c.append(b)
    return "".join(r), "".join(c)


@pytest.mark.parametrize("how", FEEDS)
@pytest.mark.parametrize(
    ("parser", "prompt", "text", "expected"),
    [
        (Qwen3ReasoningParser(), "", "<think>plan</think>\n\nanswer", ("plan", "\n\nanswer")),
        (Qwen3ReasoningParser(), "<think>\n", "plan</think>answer", ("plan", "answer")),
        (Qwen3ReasoningParser(), "<think>\n\n</think>\n\n", "plan</think>x", ("", "plan</think>x")),
        (Qwen3ReasoningParser(), "", "no thinking", ("", "no thinking")),
        (Qwen3ReasoningParser(), "", "<thin", ("", "<thin")),
        (Qwen3ReasoningParser(), "", "<think>never closed </thi", ("never closed </thi", "")),
        (DeepSeekR1ReasoningParser(), "", "plan</think>answer", ("plan", "answer")),
        (DeepSeekR1ReasoningParser(), "", "<think>plan</think>answer", ("plan", "answer")),
        (DeepSeekR1ReasoningParser(), "", "all thinking", ("all thinking", "")),
    ],
)
def test_reasoning_split(how, parser, prompt, text, expected):
    assert _run_reasoning(parser, prompt, text, how) == expected


@pytest.mark.parametrize(
    ("ids", "thinking", "expected"),
    [
        ([1, 5, 6, 2, 7], False, 2),  # <think> a b </think> c: opened by the output
        ([5, 6, 2, 7], True, 2),  # the prompt opened it
        ([5, 6, 2, 7], False, 0),  # no thinking at all
        ([1, 5, 6], False, 2),  # never closed: all thinking
        ([2, 7], True, 0),  # closed at once
        ([], True, 0),
    ],
)
def test_reasoning_token_count(ids, thinking, expected):
    assert count_reasoning_tokens(ids, thinking, [1], [2]) == expected
    # Markers of several tokens (a tokenizer without them as special tokens).
    spell = {1: [1, 1], 2: [2, 3]}
    long_ids = [t for i in ids for t in spell.get(i, [i])]
    assert count_reasoning_tokens(long_ids, thinking, [1, 1], [2, 3]) == expected


@pytest.mark.parametrize("how", FEEDS)
def test_reasoning_then_tool_calls(how):
    text = "<think>call it</think>" + HERMES
    make = lambda: ChatOutputStream(  # noqa: E731
        ReasoningStream(Qwen3ReasoningParser(), ""), MarkupToolStream(HermesToolParser())
    )
    stream, parts = make(), []
    for piece in [*_pieces(text, how, random.Random(3)), None]:
        parts.append(stream.feed("", True) if piece is None else stream.feed(piece))
    assert "".join(p.reasoning for p in parts) == "call it"
    assert "".join(p.content for p in parts) == "Let me check. "
    assert [c.name for c in assemble([d for p in parts for d in p.tool_calls])] == [
        "get_weather",
        "add",
    ]
    assert stream.called


def test_flag_choices_are_the_registries():
    hints = typing.get_type_hints(FrontendConfig)
    literal = lambda h: {a for m in typing.get_args(h) for a in typing.get_args(m)}  # noqa: E731
    assert literal(hints["tool_call_parser"]) == set(TOOL_PARSERS)
    assert literal(hints["reasoning_parser"]) == set(REASONING_PARSERS)


def test_chat_template_flag(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="^chat_template must be a file or a Jinja"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    # At start, before the model is read: the CLI names the flag.
    with pytest.raises(ValueError, match="^chat_template must be"):
        EngineArgs(model="/no/such/model", chat_template="missing.jinja").create_engine_config()


@pytest.mark.parametrize("how", FEEDS)
def test_thinking_then_a_forced_call(how):
    """A forced call's grammar starts after the thinking: its stream sees only the rest."""
    stream, parts = (
        ChatOutputStream(ReasoningStream(DeepSeekR1ReasoningParser(), ""), ForcedToolStream("add")),
        [],
    )
    for piece in [*_pieces('plan</think>{"a": 1}', how, random.Random(4)), None]:
        parts.append(stream.feed("", True) if piece is None else stream.feed(piece))
    assert "".join(p.reasoning for p in parts) == "plan"
    assert "".join(p.content for p in parts) == ""
    calls = assemble([d for p in parts for d in p.tool_calls])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
