"""Incremental detokenization and stop-string matching.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens)
and for tokenizers whose spacing depends on the previous token, so we decode a small
sliding window: text = decode(ids[prefix:]) minus decode(ids[prefix:read]), and only
emit once the tail is not an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output token decodes with its spacing.
_CONTEXT_TOKENS = 5
# A character is at most 4 UTF-8 bytes, so at most 4 byte tokens: tokens still decoding to
# an incomplete character after this many are invalid bytes for good, and are emitted as
# U+FFFD (as a full decode shows them) rather than kept in an ever longer window.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Stop strings end nothing within the first min_tokens tokens (as EOS and stop ids
        # do not, in the sampler); one that lies wholly in their text is not matched later
        # either (vLLM's rule).
        self.min_tokens = min_tokens
        self.num_output_tokens = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens to ``output_text``; return the stop string that matched, if any.
        On a match the text is truncated there and no further updates may be made.
        ``stop_terminated``: the engine ended the request on the last of these tokens
        (EOS or a stop token id); its text is left out unless include_stop_str_in_output,
        as vLLM does (the id stays in the output's token ids)."""
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        for tok in new_token_ids:
            self.ids.append(tok)
            self.num_output_tokens += 1
            start = len(self.output_text)
            self.output_text += self._decode_step()
            if self.num_output_tokens <= self.min_tokens:
                continue
            matched = self._match_stop(start)
            if matched is not None:
                return matched
        return None

    @property
    def holdback(self) -> int:
        """Characters a stream must hold back: they may still become part of a stop string."""
        return max(0, self._max_stop_len - 1)

    def _decode_step(self) -> str:
        """The text the pending tokens (``ids[read_offset:]``) add. The window decoded
        each step stays a few tokens long whatever the model emits: tokens that add no
        text leave it, and invalid bytes are emitted after ``_MAX_PENDING`` tokens. (A
        window that grew with each such token would make a long request decode
        quadratically many tokens on the event loop, stalling every stream.)"""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if full == prefix:  # no text (a skipped special token): the window need not keep it
            del self.ids[self.read_offset :]
            return ""
        complete = len(full) > len(prefix) and not full.endswith("\ufffd")
        if not complete and len(self.ids) - self.read_offset <= _MAX_PENDING:
            return ""  # a character split over tokens: wait for its last byte
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _match_stop(self, delta_start: int) -> str | None:
        if not self.stop:
            return None
        # Only the new text (plus, per stop string, an overlap for one spanning the
        # boundary) can match.
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, max(0, delta_start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
        return s

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
