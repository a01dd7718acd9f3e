"""Structured outputs with xgrammar (docs/architecture.md#structured-outputs).

- ``check_spec(spec, field)``: parses a ``StructuredOutputs`` into a grammar without the
  tokenizer (cheap, memoised): the frontend's 400 naming ``field``, and the engine's re-check.
- ``GrammarBackend``: compiles grammars against the model's vocabulary on a thread pool,
  one ``Future`` per spec in an LRU cache (equal specs share one compile). Nothing here
  blocks the busy loop: the first request also loads the tokenizer on that pool.
- ``RequestGrammar``: one request's matcher. It is kept equal to the request's output
  tokens (``sync``): advanced with each accepted token, rolled back or replayed when they
  differ (a resumed request's carried-over outputs, a preempted one's).

Bitmasks are ``[ceil(V / 32)] int32`` rows (bit ``t % 32`` of word ``t // 32`` set: token
``t`` allowed), as xgrammar fills them; the scheduler ships them to the sampler as bytes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import msgspec

from tidal.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept (their matchers share them; a large vocabulary's token-mask
# tables can take megabytes each); a spec past this is compiled again when it comes back.
_CACHE_SIZE = 64
# JSON without free whitespace: a model cannot pad it forever, and the text is the same
# as json.dumps' (", " and ": " separators).
_ANY_WHITESPACE = False


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


def spec_key(spec: StructuredOutputs) -> bytes:
    """The cache key of a spec: its wire form (equal specs, equal bytes)."""
    return msgspec.msgpack.encode(spec)


# Keys of specs known to parse; a failing spec is not remembered (its error is re-raised).
_checked_keys: OrderedDict[bytes, None] = OrderedDict()
_checked_lock = threading.Lock()


def check_spec(spec: StructuredOutputs, field: str = "structured_outputs") -> None:
    """ValueError naming ``field`` when the schema, regex or grammar does not parse."""
    key = spec_key(spec)
    with _checked_lock:
        if key in _checked_keys:
            _checked_keys.move_to_end(key)
            return
    try:
        _grammar(spec)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for each kind
        raise ValueError(f"{field}: {_describe(spec)} does not compile: {first_line(e)}") from None
    with _checked_lock:
        _checked_keys[key] = None
        while len(_checked_keys) > _CACHE_SIZE:
            _checked_keys.popitem(last=False)


def _grammar(spec: StructuredOutputs) -> Any:
    """The tokenizer-free xgrammar ``Grammar`` of ``spec``."""
    import xgrammar as xgr

    match spec.kind:
        case "json":
            assert spec.json is not None
            try:
                json.loads(spec.json)
            except ValueError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            grammar = xgr.Grammar.from_json_schema(spec.json, any_whitespace=_ANY_WHITESPACE)
            return _json_strings_without_control_chars(grammar)
        case "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=_ANY_WHITESPACE
            )
        case "regex":
            assert spec.regex is not None
            return xgr.Grammar.from_regex(spec.regex)
        case "choice":
            assert spec.choice is not None
            # One alternative per choice, each a literal (JSON escapes are EBNF's too).
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            )
        case "grammar":
            assert spec.grammar is not None
            return xgr.Grammar.from_ebnf(spec.grammar)
        case other:
            raise AssertionError(f"unknown structured output kind {other!r}")


# xgrammar (0.2.9) writes a length-bounded string's characters as this class, which
# admits the control characters JSON forbids in strings (its unbounded strings exclude
# them): a model could write a raw U+0002 into a "valid" output no JSON parser takes.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_strings_without_control_chars(grammar: Any) -> Any:
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _describe(spec: StructuredOutputs) -> str:
    return {
        "json": "the JSON schema",
        "json_object": "the JSON object grammar",
        "regex": "the regex",
        "choice": "the choice list",
        "grammar": "the EBNF grammar",
    }[spec.kind]


def first_line(e: BaseException) -> str:
    """``e``'s message for a request's error: its first line, without the timestamp and
    C++ source location xgrammar prefixes its messages with."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarBackend:
    """Compiles specs for one model's vocabulary, off the caller's thread."""

    def __init__(
        self,
        tokenizer: str | Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_workers: int = 1,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        """``tokenizer``: a Hugging Face tokenizer or its path (loaded on the pool);
        ``vocab_size``: the model's logits width (may exceed the tokenizer's);
        ``stop_token_ids``: what ends a complete output (the model's EOS ids)."""
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Future[Any]] = OrderedDict()
        self._tokenizer = tokenizer
        self._stop_ids = list(stop_token_ids)
        # Made by the first compile (loading the tokenizer costs an engine that never
        # sees a structured request nothing).
        self._compiler: Future[Any] | None = None
        self.num_compiles = 0  # specs compiled (cache misses), for tests and stats

    def compile(self, spec: StructuredOutputs) -> Future[Any]:
        """The compiled grammar of ``spec``, shared by equal specs (a done or pending
        future; a spec that fails to compile is a future raising ValueError)."""
        key = spec_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._compiler is None:
                self._compiler = self._pool.submit(
                    _make_compiler, self._tokenizer, self.vocab_size, self._stop_ids
                )
            fut = self._pool.submit(self._compile, self._compiler, spec)
            self._cache[key] = fut
            self.num_compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    @staticmethod
    def _compile(compiler_future: Future[Any], spec: StructuredOutputs) -> Any:
        compiler = compiler_future.result()
        try:
            return compiler.compile_grammar(_grammar(spec))
        except Exception as e:  # noqa: BLE001 - any failure is this spec's
            raise ValueError(f"{_describe(spec)} does not compile: {first_line(e)}") from None

    def request_grammar(
        self, spec: StructuredOutputs, stop_token_ids: Sequence[int] = ()
    ) -> RequestGrammar:
        """A matcher for one request; ``stop_token_ids``: the tokens that end that request
        (its EOS and stop ids), the only ones its grammar allows once complete. Empty: the
        backend's (the model's EOS ids)."""
        # Compiled without starts_after: specs differing only there share one grammar.
        compiled = self.compile(msgspec.structs.replace(spec, starts_after=None))
        return RequestGrammar(compiled, self.words, stop_token_ids, spec.starts_after or ())

    def bitmasks(self, grammars: Sequence[RequestGrammar]) -> list[bytes | Exception]:
        """Each grammar's next-token bitmask row as bytes (``[words]`` int32), or the
        error of a grammar that cannot say what comes next."""
        import xgrammar as xgr

        buf = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)  # [B, words] int32
        errors: dict[int, Exception] = {}
        for i, g in enumerate(grammars):
            try:
                g.fill_bitmask(buf, i)
            except Exception as e:  # noqa: BLE001 - this request's grammar, not the step's
                errors[i] = e
        raw = buf.numpy().tobytes()
        width = self.words * 4
        return [errors.get(i, raw[i * width : (i + 1) * width]) for i in range(len(grammars))]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _make_compiler(tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Any:
    """``tokenizer``: a Hugging Face tokenizer, or the path to load one from."""
    import xgrammar as xgr

    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None
    )
    # The backend's LRU of futures is the one cache: xgrammar's own would keep a second
    # copy of every compiled grammar, unbounded.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class NoTokenAllowed(ValueError):
    """The grammar allows no token of the model's vocabulary next (a vocabulary without
    the characters it needs): the request's own input, not the engine's fault."""


class RequestGrammar:
    """One request's grammar state: the compile future, then a matcher kept equal to the
    request's output tokens (once ``sync``ed): ``outputs``. With ``starts_after`` the
    grammar is dormant (allows everything, ``active`` false) until the outputs contain
    those tokens; the matcher holds what follows their first occurrence."""

    def __init__(
        self,
        compiled: Future[Any],
        words: int,
        stop_token_ids: Sequence[int] = (),
        starts_after: Sequence[int] = (),
    ) -> None:
        self._compiled = compiled
        self._words = words
        self._stop_ids = list(stop_token_ids) or None
        self._after = list(starts_after)
        self._matcher: Any = None
        self.outputs: list[int] = []
        # Index in ``outputs`` where the grammar's tokens begin; None while dormant.
        self._start: int | None = None if self._after else 0

    @property
    def accepted(self) -> list[int]:
        """The tokens the matcher took (the outputs after ``starts_after``)."""
        return [] if self._start is None else self.outputs[self._start :]

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (it is not waiting for ``starts_after``)."""
        return self._start is not None

    @property
    def ready(self) -> bool:
        """The compile finished (successfully or not): the request may be scheduled."""
        return self._compiled.done()

    def wait_ready(self, timeout: float) -> bool:
        """Block until ``ready`` or ``timeout`` seconds pass; whether it is ready. For
        callers that drive steps themselves (tests, tools): the engine never waits."""
        futures_wait([self._compiled], timeout=timeout)
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot be used (only once ``ready``)."""
        e = self._compiled.exception() if self._compiled.done() else None
        return None if e is None else str(e)

    def _matcher_now(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(
                self._compiled.result(), override_stop_tokens=self._stop_ids
            )
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar refuses it."""
        if self._start is None:
            self.outputs.append(token)
            if self.outputs[-len(self._after) :] == self._after:
                self._start = len(self.outputs)
            return True
        if not self._matcher_now().accept_token(token):
            return False
        self.outputs.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` outputs (into the dormant part too)."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self.outputs):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.outputs)} tokens")
        grammar_tokens = len(self.accepted)
        if grammar_tokens:
            self._matcher_now().rollback(min(num_tokens, grammar_tokens))
        del self.outputs[-num_tokens:]
        if self._start is not None and len(self.outputs) < self._start:
            self._start = None  # the marker was undone: dormant again

    def sync(self, output_token_ids: Sequence[int]) -> bool:
        """Make the matcher's history ``output_token_ids``: roll back to the common
        prefix, then replay the rest. False if the grammar refuses one of them (the
        matcher then holds the longest accepted prefix)."""
        acc = self.outputs
        if len(acc) == len(output_token_ids) and acc == list(output_token_ids):
            return True
        common = 0
        for a, b in zip(acc, output_token_ids):
            if a != b:
                break
            common += 1
        self.rollback(len(acc) - common)
        return all(self.accept(t) for t in output_token_ids[common:])

    def fill_bitmask(self, out: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``out`` ([B, words] int32).
        ValueError once the grammar has accepted its end (nothing may follow it);
        ``NoTokenAllowed`` when it allows no token of the vocabulary."""
        if self.is_terminated:
            raise ValueError("the output is complete but the request did not end")
        if self._start is None:
            out[row].fill_(-1)  # dormant: every token allowed
            return
        self._matcher_now().fill_next_token_bitmask(out, row)
        if not bool(out[row].any()):
            # Sampling would take any token (all masked alike) and the grammar refuse it.
            raise NoTokenAllowed(
                f"the grammar allows no token of the model's vocabulary after "
                f"{len(self.outputs)} output token(s): this model cannot write what it "
                "describes"
            )

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()
