"""Reasoning parsers: split a chat output's ``<think>`` text from its answer
(docs/operations.md#tool-calling-and-reasoning).

``--reasoning-parser`` picks one from ``REASONING_PARSERS``. A parser says where the
thinking starts and ends; ``ReasoningStream`` applies it to an output as its text comes,
holding back only the characters that may be the start of a marker, so a streamed
output splits exactly as the whole text does (the non-streaming path feeds it once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar


class ReasoningParser(ABC):
    """Where one model family's thinking starts and ends."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    @abstractmethod
    def starts_in_reasoning(self, prompt: str | None) -> bool:
        """Whether the output begins inside the thinking, before any marker of its own
        (a template may end the prompt with the opening marker)."""

    def prompt_opens_thinking(self, prompt: str | None) -> bool:
        """The prompt's last opening marker is not closed after it."""
        if not prompt:
            return False
        i = prompt.rfind(self.start)
        return i >= 0 and prompt.find(self.end, i) < 0


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output thinks when it opens with ``<think>`` or when the prompt left a
    ``<think>`` open; otherwise it is all answer (``enable_thinking: false`` templates
    close an empty block in the prompt)."""

    name = "qwen3"

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        return self.prompt_opens_thinking(prompt)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: every output starts thinking (its template opens ``<think>`` in the
    prompt, and the model may write it again); the answer follows ``</think>``. An
    output that never closes it is all reasoning."""

    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        return True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"--reasoning-parser: unknown parser {name!r}; one of {', '.join(REASONING_PARSERS)}"
        ) from None


def count_reasoning_tokens(
    token_ids: Sequence[int], thinking: bool, start_ids: Sequence[int], end_ids: Sequence[int]
) -> int:
    """How many of an output's tokens are its thinking (its markers not counted):
    ``thinking`` when it starts inside it (``starts_in_reasoning``), or from an opening
    marker (``start_ids``) it starts with, up to the end marker (``end_ids``) or the
    output's end. The ids are the markers as the tokenizer spells them: one special
    token each in Qwen3 and DeepSeek-R1, as ``ReasoningStream`` finds them in the text."""
    ids = list(token_ids)
    i = 0
    if start_ids and ids[: len(start_ids)] == list(start_ids):
        i, thinking = len(start_ids), True
    if not thinking:
        return 0
    n = len(end_ids)
    for j in range(i, len(ids) - n + 1 if n else i):
        if ids[j : j + n] == list(end_ids):
            return j - i
    return len(ids) - i


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (a marker split
    across deltas): those characters wait for the next delta."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One output's split into (reasoning, content), fed delta by delta."""

    def __init__(self, parser: ReasoningParser, prompt: str | None) -> None:
        self.parser = parser
        self.thinking = parser.starts_in_reasoning(prompt)
        # Before any text: the output may still open with the start marker (dropped).
        self._at_start = True
        self._done = False  # past the end marker: the rest is content
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of ``text``, given everything fed before; ``final``:
        nothing follows, so nothing is held back."""
        if self._done:
            return "", self._buf_flush() + text
        self._buf += text
        reasoning, content = [], []
        p = self.parser
        if self._at_start:
            if p.start.startswith(self._buf) and not final:
                return "", ""  # may still become the opening marker
            self._at_start = False
            if self._buf.startswith(p.start):
                self._buf = self._buf[len(p.start) :]
                self.thinking = True
        if not self.thinking:
            self._done = True
            return "", self._buf_flush()
        i = self._buf.find(p.end)
        if i >= 0:
            reasoning.append(self._buf[:i])
            content.append(self._buf[i + len(p.end) :])
            self._buf, self._done = "", True
        else:
            keep = 0 if final else held_prefix(self._buf, p.end)
            reasoning.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
        return "".join(reasoning), "".join(content)

    def _buf_flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
