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


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
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

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens to ``output_text``; return the stop string that matched, if any.
        On a match the text is truncated there and no further updates may be made."""
        for tok in new_token_ids:
            self.ids.append(tok)
            start = len(self.output_text)
            self.output_text += self._decode_step()
            matched = self._match_stop(start)
            if matched is not None:
                return matched
        return None

    @property
    def holdback(self) -> int:
        """Characters a stream must hold back: they may still become part of a stop string."""
        return max(0, self._max_stop_len - 1)

    def _decode_step(self) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def _match_stop(self, delta_start: int) -> str | None:
        if not self.stop:
            return None
        # Only the new text (plus an overlap for stops spanning the boundary) can match.
        lo = max(0, delta_start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
        return s

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
