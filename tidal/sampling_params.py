"""Per-request sampling parameters, and the one table of what each field may hold.

``SamplingParams`` is a msgspec Struct and is itself what crosses the wire inside
``EngineCoreRequest`` (no hand-copied twin). Each field's bounds are declared once, as
``msgspec.Meta`` on its annotation below, and that table is enforced at every entry:

- Python construction (``SamplingParams(top_k=5)``: ``LLM``, ``AsyncLLM`` callers, the HTTP
  server after its pydantic parse). msgspec checks nothing on ``__init__``, so
  ``__post_init__`` walks the same annotations (read back with ``msgspec.inspect``) and
  raises ``ValueError`` naming the field, which frontends turn into an HTTP 400 unchanged.
- The engine: msgspec checks the constraints while decoding an ``EngineCoreRequest`` and
  then runs ``__post_init__`` again, so a frame the frontend would have refused is refused
  there too, without a second list of rules to keep in step.

The bounds here are what the engine can represent (every int fits int64: torch tensors
and msgpack; every float is finite) and what makes sense for any model. Bounds that
depend on the model or the deployment (top_k and token ids against the vocabulary,
``n <= max_n``, ``logprobs <= max_logprobs``, prompt length) are checked in one place,
``InputProcessor.check``, which every entry point calls.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# A float bound of +-FLOAT_MAX admits every finite value and rejects +-inf; NaN fails every
# comparison. So "finite" is expressible as a msgspec constraint the decoder enforces.
FLOAT_MAX = sys.float_info.max

_GREEDY_EPS = 1e-5
# OpenAI's range for logit_bias values.
LOGIT_BIAS_MAX = 100.0


class StructuredOutputs(msgspec.Struct, omit_defaults=True, array_like=True, frozen=True):
    """A constraint on the output (docs/architecture.md#structured-outputs): exactly one of

    - ``json``: a JSON schema, kept as its JSON text (a dict is serialised with sorted keys,
      so equal schemas are equal specs and share one compiled grammar);
    - ``json_object``: any JSON object;
    - ``regex``: the output matches this regular expression;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF (GBNF) grammar with a ``root`` rule.

    ``starts_after``: token ids (a reasoning model's end-of-thinking marker) the output
    writes freely up to and including their first occurrence; the constraint applies to
    what follows them (none: from the first token).

    The struct is its own wire form and cache key. Whether a schema, regex or grammar
    compiles is checked where xgrammar is available (``tidal.engine_core.structured``)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    starts_after: list[int] | None = None

    def __post_init__(self) -> None:
        if self.starts_after is not None:
            ids = self.starts_after
            if (
                not isinstance(ids, (list, tuple))
                or not ids
                or not all(type(t) is int and t >= 0 for t in ids)
            ):
                raise ValueError(
                    "structured_outputs.starts_after must be a non-empty list of token ids"
                )
            msgspec.structs.force_setattr(self, "starts_after", list(ids))
        if self.json is not None and not isinstance(self.json, str):
            # A dict from the Python API (documented as text, accepted as a schema object).
            msgspec.structs.force_setattr(self, "json", json_schema_text(self.json))
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            msgspec.structs.force_setattr(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(set_) or 'none'}"
            )

    @property
    def kind(self) -> str:
        """The one constraint set (its field name)."""
        if self.json_object:
            return "json_object"
        return next(
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None
        )


def json_schema_text(schema: str | dict[str, Any]) -> str:
    """A JSON schema as ``StructuredOutputs.json`` holds it: text as given, an object
    serialised with sorted keys (equal schemas, one cache entry)."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json: not a JSON schema: {e}") from None


class SamplingParams(msgspec.Struct, omit_defaults=True, array_like=True):
    """How to pick tokens and when to stop.

    Every invalid value raises ``ValueError`` whose message starts with the field name.
    """

    n: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] = 0  # 0 or -1 = disabled
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=FLOAT_MAX)] = 1.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = 16
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    stop_token_ids: list[Annotated[int, Meta(ge=0, le=INT64_MAX)]] = []
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False: outputs carry token ids only (empty text, logprobs without decoded tokens),
    # as vLLM's flag; the frontend then spends nothing on the tokenizer per step.
    detokenize: bool = True
    # Token id -> added to its logit before any other processing but the masks below.
    logit_bias: (
        dict[
            Annotated[int, Meta(ge=0, le=INT64_MAX)],
            Annotated[float, Meta(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)],
        ]
        | None
    ) = None
    # Only these tokens may be sampled (None: every token).
    allowed_token_ids: (
        Annotated[list[Annotated[int, Meta(ge=0, le=INT64_MAX)]], Meta(min_length=1)] | None
    ) = None
    # Words never to complete: the frontend tokenizes them into ``bad_words_token_ids``
    # (InputProcessor.make_requests), which is what the engine reads.
    bad_words: list[Annotated[str, Meta(min_length=1)]] = []
    bad_words_token_ids: list[
        Annotated[list[Annotated[int, Meta(ge=0, le=INT64_MAX)]], Meta(min_length=1)]
    ] = []
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Conveniences of the Python API, normalised before the table is applied.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        for name, ftype in _FIELD_TYPES:
            setattr(self, name, _checked(name, ftype, getattr(self, name)))
        # A repeated stop id stops nothing more: kept once (in order), before every child
        # of ``n`` carries them to the engine.
        if len(self.stop_token_ids) > 1:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        # Likewise an allowed id: the sampler's work per step is the list's length.
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > 1:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.top_k == -1:
            self.top_k = 0
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched in the text: they need detokenize=True")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_logits_masks(self) -> bool:
        """Whether any of logit_bias, allowed_token_ids, bad words or a grammar applies."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or self.structured_outputs is not None
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def wrap_int64(value: int) -> int:
    """``value`` wrapped into int64 two's-complement range (derived seeds such as
    ``seed + i`` for child i of an n > 1 request stay representable and distinct)."""
    return (value - INT64_MIN) % (1 << 64) + INT64_MIN


# ---- the table, read back from the annotations -------------------------------------------

_SAMPLING_INFO = mi.type_info(SamplingParams)
assert isinstance(_SAMPLING_INFO, mi.StructType)  # a Struct's info lists its fields
_FIELD_TYPES: tuple[tuple[str, mi.Type], ...] = tuple(
    (f.name, f.type) for f in _SAMPLING_INFO.fields
)


def _checked(name: str, t: mi.Type, v: Any) -> Any:
    """``v`` as field type ``t`` wants it (ints as int, floats as float, tuples as lists),
    or ValueError naming ``name``. Mirrors what msgspec's decoder enforces for ``t``."""
    if isinstance(t, mi.UnionType):  # only ``X | None`` occurs in the table
        if v is None:
            return None
        (t,) = [x for x in t.types if not isinstance(x, mi.NoneType)]
    if isinstance(t, mi.BoolType):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a boolean, got {v!r}")
        return v
    if isinstance(t, mi.StrType):
        if not isinstance(v, str):
            raise ValueError(f"{name} must be a string, got {v!r}")
        if t.min_length is not None and len(v) < t.min_length:
            raise ValueError(f"{name} must not be empty")
        return v
    if isinstance(t, mi.StructType):  # StructuredOutputs: its own __post_init__ checks it
        if isinstance(v, dict):
            v = t.cls(**v)
        if not isinstance(v, t.cls):
            raise ValueError(f"{name} must be a {t.cls.__name__}, got {type(v).__name__}")
        return v
    if isinstance(t, mi.DictType):
        if not isinstance(v, dict):
            raise ValueError(f"{name} must be a mapping, got {type(v).__name__}")
        return {
            _checked(f"{name} key", t.key_type, k): _checked(f"{name}[{k!r}]", t.value_type, x)
            for k, x in v.items()
        }
    if isinstance(t, mi.ListType):
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {type(v).__name__}")
        if t.min_length is not None and len(v) < t.min_length:
            raise ValueError(f"{name} must not be empty")
        if _plain_ints_in_bounds(t.item_type, v):
            return list(v)
        return [_checked(f"{name}[{i}]", t.item_type, x) for i, x in enumerate(v)]
    if isinstance(t, mi.IntType):
        # bool is an int to Python but not to JSON or msgspec: refuse it like they do.
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        v = int(v)
    elif isinstance(t, mi.FloatType):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{name} must be a number, got {v!r}")
        try:
            v = float(v)
        except OverflowError:  # an int beyond float range
            raise ValueError(f"{name} must be a finite number, got {v}") from None
        if not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
    else:  # a new field of a kind this walker does not know: fail loudly in tests
        raise TypeError(f"SamplingParams.{name}: unsupported field type {t!r}")
    _check_bounds(name, t, v)
    return v


def _plain_ints_in_bounds(t: mi.Type, v: list | tuple) -> bool:
    """Whether a list of an int field's items is valid as it is, checked at C speed
    (token-id lists are long; the engine re-checks every request it is handed). False
    sends the caller down the per-item path, whose error names the first bad item."""
    if not isinstance(t, mi.IntType) or not all(type(x) is int for x in v):
        return False
    lo, hi = min(v, default=0), max(v, default=0)
    return (
        (t.ge is None or lo >= t.ge)
        and (t.gt is None or lo > t.gt)
        and (t.le is None or hi <= t.le)
        and (t.lt is None or hi < t.lt)
    )


def _check_bounds(name: str, t: mi.IntType | mi.FloatType, v: float) -> None:
    # The +-FLOAT_MAX bounds only exclude infinities, refused above with a clearer message.
    if t.ge is not None and not v >= t.ge:
        raise ValueError(f"{name} must be >= {t.ge}, got {v}")
    if t.gt is not None and not v > t.gt:
        raise ValueError(f"{name} must be > {t.gt}, got {v}")
    if t.le is not None and not v <= t.le:
        raise ValueError(f"{name} must be <= {t.le}, got {v}")
    if t.lt is not None and not v < t.lt:
        raise ValueError(f"{name} must be < {t.lt}, got {v}")
