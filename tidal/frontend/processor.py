"""Prompt -> engine request: tokenization, chat templates, the model-dependent checks, fan-out
for n.

``InputProcessor.check`` is the one place for checks that need the model or the
deployment's limits (vocabulary, context length, ``max_logprobs``, and the sizes of
``FrontendConfig.check_sizes``: ``n``, stop strings and ids); the HTTP server, ``LLM`` and
``AsyncLLM`` all call it, so they refuse the same inputs with the same messages.
Field-by-field bounds live in ``SamplingParams`` itself.
"""

from __future__ import annotations

import inspect
import operator
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from tidal.config import FrontendConfig, ModelConfig
from tidal.engine_core.structured import check_spec
from tidal.protocol.messages import EngineCoreRequest
from tidal.sampling_params import SamplingParams, wrap_int64

PromptType = str | dict[str, Any] | list[int]

# OpenAI's roles ("function" is its deprecated predecessor of "tool"). Anything else is a
# client error (OpenAI and vLLM answer 400), not something for the template to guess at.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")

# Parameters of ``apply_chat_template`` that are template inputs rather than switches of
# the call itself; every other parameter name is refused in ``chat_template_kwargs``
# (e.g. ``chat_template`` would swap the template, ``tokenize`` the return type).
_TEMPLATE_INPUTS = frozenset({"tools", "documents"})


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer in ``path``. Code the folder ships (``auto_map``) runs only with
    ``trust_remote_code`` (``--trust-remote-code``); without it such a tokenizer is an error."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ValueError(
                f"tokenizer: {path!r} needs Python code shipped with it (auto_map); "
                "start with --trust-remote-code to run it"
            ) from e
        raise


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself where it is a Jinja
    template (it has a ``{{`` or ``{%``); anything else is an error naming the flag."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template cannot be read from {value!r}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"chat_template must be a file or a Jinja template; {value!r} is neither "
        "(no such file, and no {{ or {% in it)"
    )


def eos_token_id_for(model_config: ModelConfig, tokenizer: Any) -> int | None:
    ids = model_config.eos_token_ids
    if ids:
        return ids[0]
    return getattr(tokenizer, "eos_token_id", None)


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any, limits: FrontendConfig | None = None
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.limits = limits if limits is not None else FrontendConfig()
        self.eos_token_id = eos_token_id_for(model_config, tokenizer)
        # Other EOS ids (generation_config.json) act as stop tokens, as in transformers.
        self.extra_eos_ids = [i for i in model_config.eos_token_ids if i != self.eos_token_id]
        self.vocab_size = int(model_config.hf_config.vocab_size)
        self.reserved_template_kwargs = _call_parameters(tokenizer) - _TEMPLATE_INPUTS
        # --chat-template: the operator's, used wherever a call brings none of its own.
        self.chat_template = load_chat_template(self.limits.chat_template)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return ProcessedPrompt(None, _token_ids(prompt))
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def check_chat(self, messages: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        """Messages are dicts with a known role; template kwargs only feed the template."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be an object with a role and content")
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                    f"got {m.get('role')!r}"
                )
        bad = sorted(set(template_kwargs or ()) & self.reserved_template_kwargs)
        if bad:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(bad)} (parameters of the "
                "template call, not inputs of the template)"
            )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> ProcessedPrompt:
        """Render with the tokenizer (its own template unless ``chat_template`` is given:
        trusted callers only; the HTTP server renders request templates in a sandbox) and
        tokenize. ``kwargs`` are template inputs (``chat_template_kwargs``) plus
        ``continue_final_message``."""
        template_kwargs = {k: v for k, v in kwargs.items() if k != "continue_final_message"}
        self.check_chat(messages, template_kwargs)
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template if chat_template is not None else self.chat_template,
            **kwargs,
        )
        return ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    def check(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """What the model and the deployment allow (ValueError naming the field -> HTTP 400).
        ``params`` already passed its own field table; this adds the bounds that depend on
        the vocabulary, the context length and the request limits."""
        vocab, limits = self.vocab_size, self.limits
        limits.check_sizes(n=params.n, stop=params.stop, stop_token_ids=params.stop_token_ids)
        if params.top_k > vocab:
            raise ValueError(
                f"top_k must be <= the vocabulary size ({vocab}), or -1/0 to disable; "
                f"got {params.top_k}"
            )
        max_lp = min(limits.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_lp:
                raise ValueError(
                    f"{name} must be <= {max_lp} (max_logprobs, --max-logprobs, and the "
                    f"vocabulary size), got {k}"
                )
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is out of range for vocab size {vocab}")
        id_fields = {
            "allowed_token_ids": params.allowed_token_ids or (),
            "logit_bias": params.logit_bias or (),
            "bad_words_token_ids": [t for w in params.bad_words_token_ids for t in w],
        }
        for name, ids in id_fields.items():
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is out of range for vocab size {vocab}")
        if params.structured_outputs is not None:
            check_spec(params.structured_outputs)  # memoised: free after the HTTP layer's
        self._check_prompt(prompt.prompt_token_ids, params)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        n, limit = len(ids), self.model_config.max_model_len
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens"
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens."
            )
        vocab = self.vocab_size
        # type() is int: bool is an int subclass, and a float id would pass the range test.
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            if type(bad) is not int:
                raise ValueError(f"prompt token ids must be integers, got {bad!r}")
            raise ValueError(f"prompt token id {bad} is out of range for vocab size {vocab}")

    def make_requests(
        self,
        child_ids: list[str],
        prompt: ProcessedPrompt,
        params: SamplingParams,
        data_parallel_rank: int | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per child; child i of a seeded request uses seed + i (wrapped
        into int64, so a seed near the top of the range stays representable).

        The children share one stop-id list and carry no stop strings: those are matched
        here, by the detokenizer, and the engine never reads them, so ``n`` children do
        not send ``n`` copies of them."""
        now = time.time()
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [i for i in self.extra_eos_ids if i not in stop_ids]
        bad_words_ids = params.bad_words_token_ids or self.bad_words_token_ids(params.bad_words)
        reqs = []
        for i, cid in enumerate(child_ids):
            seed = None if params.seed is None else wrap_int64(params.seed + i)
            child = msgspec.structs.replace(
                params,
                n=1,
                seed=seed,
                stop=[],
                stop_token_ids=stop_ids,
                bad_words=[],
                bad_words_token_ids=bad_words_ids,
            )
            reqs.append(
                EngineCoreRequest(
                    request_id=cid,
                    prompt_token_ids=prompt.prompt_token_ids,
                    sampling_params=child,
                    eos_token_id=self.eos_token_id,
                    arrival_time=now,
                    data_parallel_rank=data_parallel_rank,
                )
            )
        return reqs

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word as written (leading spaces
        stripped), and also with one leading space when that spells it with different
        tokens of the same count (as the word appears after a space in a BPE text)."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                continue
            out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        vocab = self.vocab_size
        bad = next((t for w in out for t in w if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"bad_words: token id {bad} is out of range for vocab size {vocab}")
        return out


def _token_ids(ids: Any) -> list[int]:
    """A list of plain ints (numpy ints and the like converted), or ValueError."""
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):  # an int to Python, never a token id
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r}") from None
    return out


def _call_parameters(tokenizer: Any) -> frozenset[str]:
    """Named parameters of ``tokenizer.apply_chat_template`` (none when it has no signature)."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in named)
