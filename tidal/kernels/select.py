"""Which path serves each CPU op: measured on this machine at load, cached on disk
(docs/architecture.md#moe-ep).

Why: the fastest path on one CPU is the slowest on another. The C++ kernels
tuned on an AMD EPYC ran 1.5-1.7x slower than plain torch on an Intel Xeon (their
software prefetch hint), and Tidal's default was slower than transformers there. So for
each op a model runs -- MoE experts, router, linear, decode attention, norm -- every
available path (the C++ kernels with each prefetch hint, oneDNN prepacked, plain torch)
runs a short timed trial on the model's own shapes, at three shape classes (``CLASSES``:
one decode row, a decode batch, a prefill chunk), and the fastest is kept per class. The
trials' timings are cached per machine fingerprint (CPU model
and flags, thread count, dtype, Tidal and torch versions, the kernels' build) and op shape,
so the next start decides from the cache without running anything.

The parts:

* ``decide``: pure -- candidates, their timings and the mode (``auto`` or a forced
  path) in, a ``Choice`` out. A path that holds weights keeps one layout per op (one copy
  of each weight), so such an op gets one path for every shape class (the
  one with the least summed slowdown against each decode class's best: ``LAYOUT_CLASSES``)
  and, within it, each class's fastest variant; ops without weights (norm, attention) choose per class freely.
  Candidates depend on the weights' dtype (``weight_candidates``): bf16 weights have the
  C++ shift kernel, the AVX512-BF16 dot kernel (``dot-`` variants) where the CPU has it,
  oneDNN bf16 and torch, and the experts and linears the AMX tile kernel (``amx``) where
  the CPU has AMX and the input width is whole tile steps (``amx_fits``); the cache fingerprint holds the dtype, so a float32 and a bf16
  model of one shape never share timings. FP8 weights (a quantized checkpoint) have the
  C++ FP8 kernels per hint (the fp16 decode; for bf16 activations also the FP8 dot kernel,
  ``dot-``, where the CPU has AVX512-BF16 and VBMI, and its decode with the products on
  AMX tiles, ``amx``, where it also has AMX) and torch (dequantize per call); their
  ops are keyed apart
  (``fp8_linear``, ``fp8_moe``, with the scales' block) from the model dtype's.
* ``measure``: the trial harness, candidates interleaved round by round (the machine's
  noise hits them alike), the best round per candidate; the clock is an argument, so the
  tests drive it.
* ``ChoiceCache``: the timings on disk, one JSON file per fingerprint.
* ``choose_paths``: walks a model's modules that offer CPU paths (``CpuPathsModule``),
  groups their ops by key, measures what the cache lacks, and hands each module its
  ``Choice``; returns the report the log and ``/stats`` show. With a ``SharedChoice``
  (a rank's tensor-parallel workers) only the leader measures and all serve by its
  choices.

Imports nothing of tidal (docs/architecture.md#layers): modules are found by duck typing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from tidal.kernels.cpu_ext import (
    AMX_VARIANT,
    DOT_PREFIX,
    PREFETCH_HINTS,
    amx_available,
    bf16_dot_available,
    fp8_amx_available,
    fp8_dot_available,
    kernel_available,
)
from tidal.kernels.fp8_torch import FP8_DTYPE
from tidal.kernels.onednn import onednn_available

logger = logging.getLogger(__name__)

PATHS = ("native", "onednn", "torch")  # preference order on an exact tie
MODES = ("auto", *PATHS)
# The shape classes, by rows per call: a decode step of one or a few sequences, a decode
# batch, and a prefill chunk (or a decode batch of hundreds). Paths rank differently in
# each: at a prefill a bf16 expert GEMM is compute-bound, and AMX tiles ran the 64-expert
# layer's 1024 rows 3.8x faster than the dot kernel that is fastest at 32.
CLASSES = ("decode", "batch", "prefill")
LAYOUT_CLASSES = ("decode", "batch")  # the classes that pick an op's weight layout
# The hints measured for the C++ kernels ("none", the hardware prefetcher alone, never won
# on either CPU measured and would cost trial time).
NATIVE_HINTS = ("nta", "t0")
# A call of ``rows`` rows is in the decode class when rows <= DECODE_MAX_ROWS, in the
# batch class up to BATCH_MAX_ROWS, else in the prefill class. The trials run 1 row,
# ``batch_rows`` (32) and ``prefill_rows`` (256); each boundary sits near the geometric
# mean of its neighbours' rows.
DECODE_MAX_ROWS = 4
BATCH_MAX_ROWS = 96
# Bump when a path's code or a trial changes in a way the kernels' build hash does not
# show (2: the experts trial routes each call anew; 3: trials stream the model's footprint).
CACHE_FORMAT = 3
WARM_UP = 2  # untimed-for-the-estimate calls of each trial (first touches, thread wake-ups)


@dataclass(frozen=True)
class Candidate:
    """One way to run an op: a path (the layout it holds) and a variant within it."""

    path: str  # native | onednn | torch
    variant: str = ""  # native: the prefetch hint

    @property
    def name(self) -> str:
        return f"{self.path}:{self.variant}" if self.variant else self.path

    @classmethod
    def parse(cls, name: str) -> Candidate:
        path, _, variant = name.partition(":")
        return cls(path, variant)


@dataclass(frozen=True)
class OpKey:
    """An op family and the shape it runs at: ops of equal keys share one choice."""

    op: str  # moe | biased_moe | router | router_logits | linear | attention | norm | fp8_linear | fp8_moe
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.op}[{'x'.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Choice:
    """The paths serving one op key, one per shape class: ``decode`` for calls of at most
    ``DECODE_MAX_ROWS`` rows, ``batch`` up to ``BATCH_MAX_ROWS``, ``prefill`` above;
    ``layout`` the path whose layout holds the weights (None for an op without weights)."""

    decode: Candidate
    batch: Candidate
    prefill: Candidate
    layout: str | None
    source: str = "measured"  # measured | cached | forced | only | default
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)

    @classmethod
    def fixed(cls, c: Candidate, layout: str | None, source: str = "forced") -> Choice:
        """``c`` at every shape class (a trial's stand-in, a forced or only path)."""
        return cls(c, c, c, layout, source)

    def for_rows(self, rows: int) -> Candidate:
        if rows <= DECODE_MAX_ROWS:
            return self.decode
        return self.batch if rows <= BATCH_MAX_ROWS else self.prefill

    def by_class(self) -> dict[str, Candidate]:  # CLASSES order
        return {"decode": self.decode, "batch": self.batch, "prefill": self.prefill}

    def as_dict(self) -> dict[str, Any]:
        return {
            **{cls: c.name for cls, c in self.by_class().items()},
            "layout": self.layout,
            "source": self.source,
            "timings_ms": self.timings_ms,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Choice:
        """The inverse of ``as_dict`` (a choice another process made, ``SharedChoice``)."""
        return cls(
            Candidate.parse(doc["decode"]),
            Candidate.parse(doc["batch"]),
            Candidate.parse(doc["prefill"]),
            doc.get("layout"),
            doc.get("source", "measured"),
            dict(doc.get("timings_ms") or {}),
        )


def default_choice(candidates: Iterable[Candidate], holds_weights: bool) -> Choice:
    """What serves before (or without) a measurement -- a trial past its deadline on a
    loaded machine: the first candidate in ``PATHS`` order (the C++ kernels where built),
    and among their variants ``_default_rank``'s first."""
    best = min(candidates, key=_default_rank)
    return Choice.fixed(best, best.path if holds_weights else None, source="default")


def _default_rank(c: Candidate) -> tuple[int, bool, bool, str]:
    """The AMX kernels first (experts and linears: the dot kernel at a few rows, several
    times it at a prefill), then the t0 hint before nta (on an Intel Xeon nta held the bf16 experts of
    the 64-expert layer to a third of t0's speed; an AMD EPYC measured them alike), the
    dot kernel before the shift one."""
    hint = c.variant.removeprefix(DOT_PREFIX)
    return PATHS.index(c.path), c.variant != AMX_VARIANT, hint == "nta", c.variant


def native_candidates(
    hints: Iterable[str] = NATIVE_HINTS,
    dtype: torch.dtype = torch.float32,
    act_dtype: torch.dtype | None = None,
    block_k: int = 128,
) -> list[Candidate]:
    """The C++ kernels for ``dtype`` weights, one candidate per prefetch hint (none where
    not built or for another dtype); bf16 adds the dot kernel's, where the CPU has it.
    ``float8_e4m3fn``: the FP8 kernels (``cpu_fp8.py``, decoded in registers), plus the FP8
    dot kernel's where the CPU has it, the activations (``act_dtype``) are bf16 -- it rounds
    them to bf16, so a float32 model keeps float32 products -- and the scales' ``block_k``
    is even (a k pair never straddles two scales), and with them the FP8 AMX kernel
    (``amx``: that decode, the products on AMX tiles) where the CPU has AMX."""
    if not kernel_available() or dtype not in (torch.float32, torch.bfloat16, FP8_DTYPE):
        return []
    hints = [h for h in hints if h in PREFETCH_HINTS]
    out = [Candidate("native", h) for h in hints]
    if dtype == torch.bfloat16 and bf16_dot_available():
        out += [Candidate("native", DOT_PREFIX + h) for h in hints]
    fp8_dot = act_dtype == torch.bfloat16 and block_k % 2 == 0 and fp8_dot_available()
    if dtype == FP8_DTYPE and fp8_dot:
        out += [Candidate("native", DOT_PREFIX + h) for h in hints]
        if fp8_amx_available():
            out.append(Candidate("native", AMX_VARIANT))
    return out


def weight_candidates(
    dtype: torch.dtype,
    act_dtype: torch.dtype | None = None,
    block_k: int = 128,
    *,
    amx_fits: bool = False,
) -> list[Candidate]:
    """The candidates of an op holding weights (linear, router, experts) for ``dtype``:
    the C++ kernels (float32: one per hint; bf16: the shift kernel per hint, the dot
    kernel per hint where the CPU has AVX512-BF16, and the AMX tile kernel
    (``native:amx``) where the op's shape takes it (``amx_fits``: ``cpu_ext.amx_fits``)
    and the CPU has AMX; FP8: the fp16 decode per hint, the dot kernel per hint for bf16
    activations where the CPU has AVX512-BF16 and VBMI, and with it the FP8 AMX kernel
    (``native:amx``) where the CPU has AMX), oneDNN prepacked where this
    torch has it for ``dtype`` (not FP8), and torch (every dtype; FP8: the
    dequantize-per-call reference). ``act_dtype`` and ``block_k``: FP8's activations and
    scale block (``native_candidates``)."""
    out = native_candidates(dtype=dtype, act_dtype=act_dtype, block_k=block_k)
    if dtype == torch.bfloat16 and amx_fits and amx_available():
        out.append(Candidate("native", AMX_VARIANT))
    if onednn_available(dtype):
        out.append(Candidate("onednn"))
    return [*out, Candidate("torch")]


def kernel_candidates(dtype: torch.dtype) -> list[Candidate]:
    """The candidates of an op without weights or hints (norm, decode attention): the C++
    kernel where built (float32, bfloat16, float16: float32 math), and torch."""
    ok = dtype in (torch.float32, torch.bfloat16, torch.float16)
    native = [Candidate("native")] if ok and kernel_available() else []
    return [*native, Candidate("torch")]


def _path_rank(c: Candidate) -> tuple[int, str]:
    return PATHS.index(c.path), c.variant


# ------------------------------------------------------------------------------ decide


def allowed(candidates: Iterable[Candidate], mode: str) -> list[Candidate]:
    """The candidates ``mode`` lets serve: all for ``auto``; a forced path's own, or, for
    an op that path does not serve, the torch path (every op has one)."""
    if mode not in MODES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(MODES)}; got {mode!r}")
    cands = list(candidates)
    if mode == "auto":
        return cands
    forced = [c for c in cands if c.path == mode]
    return forced or [c for c in cands if c.path == "torch"] or cands[:1]


def decide(
    candidates: Iterable[Candidate],
    timings_ms: Mapping[str, Mapping[str, float]],  # class -> candidate name -> ms per call
    mode: str = "auto",
    *,
    holds_weights: bool = True,
    source: str = "measured",
) -> Choice:
    """The choice for one op key. Candidates without a timing in a class (not measured,
    or failed) are never chosen for it unless nothing was measured at all."""
    cands = allowed(candidates, mode)
    if not cands:
        raise ValueError("no candidate to choose from")
    shown = {cls: dict(timings_ms.get(cls, {})) for cls in CLASSES}
    if len(cands) == 1:
        only = Choice.fixed(cands[0], _layout(cands[0], holds_weights), "only")
        return replace(only, timings_ms=shown)

    def best(pool: list[Candidate], cls: str) -> Candidate | None:
        timed = [c for c in pool if _finite(timings_ms.get(cls, {}).get(c.name))]
        return min(timed, key=lambda c: (timings_ms[cls][c.name], _path_rank(c)), default=None)

    if mode != "auto":
        source = "forced"
    def best_per_class(pool: list[Candidate]) -> dict[str, Candidate] | None:
        picks = {cls: best(pool, cls) for cls in CLASSES}
        complete = {cls: p for cls, p in picks.items() if p is not None}
        return complete if len(complete) == len(picks) else None

    overall = best_per_class(cands)
    if overall is None:
        return default_choice(cands, holds_weights)
    if not holds_weights:
        return Choice(**overall, layout=None, source=source, timings_ms=shown)
    # One layout per op: the path whose best variants lose least, summed over the decode
    # classes. A prefill only picks its variant within that layout: serving is mostly
    # decode steps, and a layout that wins prefills alone would slow every one of them.
    scores: dict[str, float] = {}
    for path in dict.fromkeys(c.path for c in cands):
        picks = best_per_class([c for c in cands if c.path == path])
        if picks is None:
            continue
        scores[path] = sum(
            timings_ms[cls][picks[cls].name] / timings_ms[cls][overall[cls].name]
            for cls in LAYOUT_CLASSES
        )
    path = min(scores, key=lambda p: (scores[p], PATHS.index(p)))
    picks = best_per_class([c for c in cands if c.path == path])
    assert picks is not None
    return Choice(**picks, layout=path, source=source, timings_ms=shown)


def _layout(c: Candidate, holds_weights: bool) -> str | None:
    return c.path if holds_weights else None


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0


# ------------------------------------------------------------------------------ measure


def measure(
    trials: Mapping[str, Callable[[], object]],
    *,
    budget_s: float = 0.012,
    rounds: int = 4,
    clock: Callable[[], float] = time.perf_counter,
    drop_slower: float = 3.0,
    skip_slower: float = 10.0,
    quantile: float = 0.0,
) -> dict[str, float]:
    """ms per call of each trial. Each warms up with ``WARM_UP`` calls (its fastest sizes
    its rounds), then ``rounds`` rounds in which each runs its share of ~``budget_s``
    worth of calls (at least one a round), interleaved so a burst of noise from elsewhere
    hits them alike. Every call is timed on its own and a trial's time is the
    ``quantile`` of its calls, by default the fastest: noise only ever adds time, and on 2
    shared cores most of a call's time can be a wait for its second thread to be
    scheduled (a C++ call of 50 us measured 8-16 ms at the median while another process
    held the other core; with one busy process beside it the 20th percentile of a 1024x1024
    linear's calls still read 5-6 ms where the fastest read 0.07-0.1), so the fast end of
    the distribution is the path's own speed. The stand-ins rotate over more weights than
    any cache holds, so the fastest call is not a cache-warm one. After two rounds a trial
    ``drop_slower`` x slower than the best stops being timed, and one whose fastest
    warm-up call took ``skip_slower`` x the fastest one's is not timed on. A trial that
    raises is left out (its candidate cannot serve here)."""
    times: dict[str, list[float]] = {}
    for name, fn in trials.items():
        try:
            for _ in range(WARM_UP):
                t = clock()
                fn()
                times.setdefault(name, []).append(max(clock() - t, 1e-9))
        except Exception as e:  # noqa: BLE001 - a path that fails here must not serve
            logger.warning("cpu kernel trial %s failed: %s", name, e)
            times.pop(name, None)
    first = {name: min(ts) for name, ts in times.items()}
    fastest_first = min(first.values(), default=0.0)
    live = [n for n in first if first[n] <= skip_slower * fastest_first]

    def estimate(name: str) -> float:
        ts = sorted(times[name])
        return ts[int(quantile * (len(ts) - 1))]

    for name in live:
        times[name] = []  # the warm-up calls are not the estimate where rounds follow
    share = budget_s / rounds  # each live trial's time a round
    for r in range(rounds):
        for name in live:
            fn = trials[name]
            began = clock()
            for _ in range(max(1, min(250, int(share / first[name])))):
                t = clock()
                fn()
                times[name].append(clock() - t)
                if t - began > 2 * share:  # noise stretched the calls: enough of them
                    break
        if r >= 1 and len(live) > 1:
            fastest = min(estimate(n) for n in live)
            live = [n for n in live if estimate(n) <= drop_slower * fastest]
    return {name: estimate(name) * 1e3 for name in times}


# ------------------------------------------------------------------------------ cache


def cpu_description() -> dict[str, str]:
    """The CPU's model name and its flags (Linux: /proc/cpuinfo), else what platform says."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine(), "flags": flags}


def fingerprint(threads: int, dtype: torch.dtype) -> dict[str, Any]:
    """What a cached timing is only valid for: this CPU, thread count, dtype, and the code
    that ran (Tidal's version, the kernels' build, torch's version)."""
    cpu = cpu_description()
    return {
        "cpu_model": cpu["model"],
        "cpu_flags": hashlib.sha256(" ".join(sorted(cpu["flags"].split())).encode()).hexdigest()[
            :16
        ],
        "threads": threads,
        "dtype": str(dtype).replace("torch.", ""),
        "tidal": _tidal_version(),
        "kernels": _kernel_build(),
        "torch": torch.__version__,
        "format": CACHE_FORMAT,
    }


def _tidal_version() -> str:
    try:
        return importlib.metadata.version("tidal")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _kernel_build() -> str:
    """A hash of the C++ extension's file (a rebuild after a kernel change is a new build)."""
    if not kernel_available():
        return "none"
    # The extension module's own file (``torch.ops.tidal_cpu.__file__`` is the string
    # "torch.ops", which named no file: every build hashed alike, as "unknown").
    path = _extension_path()
    if path is None:
        return "unknown"
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unknown"


def _extension_path() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("tidal.kernels._cpu_ops")
    return None if spec is None else spec.origin


class ChoiceCache:
    """Measured timings per op key, one JSON file per fingerprint under ``directory``
    (None or "": no disk, every start measures). A missing, unreadable or foreign file is
    an empty cache; writes replace the file atomically."""

    def __init__(self, directory: str | None, print_: Mapping[str, Any]) -> None:
        self.fingerprint = dict(print_)
        digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode())
        self.path = (
            os.path.join(directory, f"cpu-kernels-{digest.hexdigest()[:20]}.json")
            if directory
            else None
        )
        self._ops: dict[str, dict[str, dict[str, float]]] = self._read()

    def _read(self) -> dict[str, dict[str, dict[str, float]]]:
        if self.path is None or not os.path.exists(self.path):
            return {}
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict) or doc.get("fingerprint") != self.fingerprint:
            return {}
        ops = doc.get("ops")
        return ops if isinstance(ops, dict) else {}

    def get(
        self, key: OpKey, candidates: Iterable[Candidate]
    ) -> dict[str, dict[str, float]] | None:
        """The cached timings of ``key`` if they cover every candidate, else None."""
        timings = self._ops.get(key.name)
        if not isinstance(timings, dict):
            return None
        names = {c.name for c in candidates}
        for cls in CLASSES:
            got = timings.get(cls)
            if not isinstance(got, dict) or not names <= set(got):
                return None
        return timings

    def put(self, key: OpKey, timings: dict[str, dict[str, float]]) -> None:
        self._ops[key.name] = timings

    def save(self) -> None:
        if self.path is None:
            return
        tmp: str | None = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"fingerprint": self.fingerprint, "ops": self._ops}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: measured again next start, still correct
            logger.warning("cannot write the CPU kernel choices to %s: %s", self.path, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


# ------------------------------------------------------------------------------ modules


@dataclass(frozen=True)
class OpSpec:
    """One op a module runs on CPU: its key, its candidates, whether its path holds the
    weights (one layout per op), and the bytes of one instance's weights (how many
    instances a trial streams, so it reads from memory as the model does)."""

    key: OpKey
    candidates: tuple[Candidate, ...]
    holds_weights: bool
    weight_bytes: int = 0


@runtime_checkable
class CpuPathsModule(Protocol):
    """A module with CPU ops whose path is chosen (Linear, FusedMoE, RMSNorm, attention)."""

    def cpu_ops(self) -> dict[str, OpSpec]:
        """The module's ops by a name of its own (e.g. "experts", "router")."""
        ...

    def cpu_trial(
        self, op: str, candidate: Candidate, instances: int
    ) -> Callable[[int], Callable[[], object]]:
        """Stand-ins of this module's shape for ``op`` (``instances`` of them, synthetic
        weights, in ``candidate``'s layout), as ``rows -> thunk``: the thunk runs ``op`` of
        the next stand-in on ``rows`` rows, as the forward runs it."""
        ...

    def set_cpu_path(self, op: str, choice: Choice) -> None:
        """Serve ``op`` by ``choice`` (a path that holds weights packs them at the loader's
        ``pack_weights``, or at once when they are loaded already)."""
        ...


# The trials of one model stop after this long (then the defaults serve, uncached): a
# quiet 2-core machine measures the 1024-wide model in a few seconds, a loaded one in tens.
TRIAL_DEADLINE_S = 30.0
# A trial's stand-ins stream about this many bytes of weights per candidate, or the
# model's whole footprint where that is smaller: several times any L3 measured, so they
# come from memory where the model's weights do, and from cache where a small model's fit.
TRIAL_BYTES = 96 << 20
# ...in at most this many stand-ins (or one a layer): a small op's (the router's) stream
# stays in cache whatever its count, and thousands of modules would slow the start.
TRIAL_MAX_INSTANCES = 64


@dataclass
class SelectionReport:
    mode: str
    fingerprint: dict[str, Any]
    cache_file: str | None
    trial_s: float
    choices: dict[str, Choice]
    chosen_by: str | None = None  # None: this process; else the leader it took them from

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "cpu": self.fingerprint.get("cpu_model"),
            "threads": self.fingerprint.get("threads"),
            "cache_file": self.cache_file,
            "trial_s": round(self.trial_s, 3),
            "chosen_by": self.chosen_by,
            "ops": {k: c.as_dict() for k, c in self.choices.items()},
        }


@dataclass(frozen=True)
class SharedChoice:
    """Processes that must serve every op by the same path choose once, on the leader.

    Why: a rank's tensor-parallel workers each repeat some ops on the same values (the
    norms on the replicated hidden state, the router without EP, whose top-k picks which
    experts' slices every worker adds up); paths differ in their last bits, so workers
    choosing apart (their trials are noisy) could pick different experts on a near tie and
    sum slices of different experts. Their shards have the same shapes, so the leader's
    trials are theirs too; the others do not run trials (on shared cores they would only
    slow the leader's).

    ``exchange`` is a collective over the processes: the leader passes its choices
    (``{op key name: Choice.as_dict()}``), the others None, and every caller gets the
    leader's."""

    leader: bool
    exchange: Callable[[dict[str, Any] | None], dict[str, Any]]
    leader_name: str = "the leader"


def choose_paths(
    modules: Iterable[Any],
    *,
    mode: str = "auto",
    cache_dir: str | None = None,
    batch_rows: int = 32,
    prefill_rows: int = 256,
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,  # the trials' (tests pass a fake one)
    deadline_s: float = TRIAL_DEADLINE_S,
    share: SharedChoice | None = None,
) -> SelectionReport:
    """Choose and set the path of every CPU op of ``modules`` (e.g. ``model.modules()``).
    Ops still unmeasured ``deadline_s`` after the start (a machine so loaded that trials
    crawl) take the default path, uncached: the next start measures them. With ``share``
    one process (its leader) chooses for all of them."""
    if mode not in MODES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(MODES)}; got {mode!r}")
    start = clock()
    groups: dict[OpKey, list[tuple[Any, str, OpSpec]]] = {}
    for module in modules:
        if isinstance(module, CpuPathsModule):
            for op, spec in module.cpu_ops().items():
                groups.setdefault(spec.key, []).append((module, op, spec))
    print_ = fingerprint(torch.get_num_threads(), dtype)
    if share is not None and not share.leader:
        choices = _follow(groups, share.exchange(None), share.leader_name)
        report = SelectionReport(
            mode, print_, None, clock() - start, choices, chosen_by=share.leader_name
        )
    else:
        cache = ChoiceCache(cache_dir, print_)
        rows = trial_rows(batch_rows, prefill_rows)
        choices = _choose(groups, mode, cache, rows, clock, start, deadline_s)
        report = SelectionReport(mode, print_, cache.path, clock() - start, choices)
        if share is not None:
            share.exchange({name: c.as_dict() for name, c in choices.items()})
    for key, members in groups.items():
        for m, name, _ in members:
            m.set_cpu_path(name, choices[key.name])
    _log(report)
    return report


def _choose(
    groups: Mapping[OpKey, list[tuple[Any, str, OpSpec]]],
    mode: str,
    cache: ChoiceCache,
    rows: Mapping[str, int],  # class -> the trial's rows
    clock: Callable[[], float],
    start: float,
    deadline_s: float,
) -> dict[str, Choice]:
    """Each op key's choice, from the cache or a trial (cached unless the machine was busy)."""
    choices: dict[str, Choice] = {}
    measured = False
    # Every op's weights are read once a step: a stand-in is read again only after this
    # many bytes, so the trials stream what the model streams.
    footprint = sum(spec.weight_bytes for members in groups.values() for _, _, spec in members)
    window = cpu_sample()  # what else ran during the trials decides whether they are kept
    for key, members in groups.items():
        module, op, spec = members[0]
        cands = allowed(spec.candidates, mode)
        if len(cands) <= 1:
            choice = decide(cands, {}, mode, holds_weights=spec.holds_weights)
        else:
            timings = cache.get(key, cands)
            source = "cached"
            if timings is None and clock() - start > deadline_s:
                choice = default_choice(cands, spec.holds_weights)
                logger.warning("cpu kernels: trial deadline passed; %s takes the default", key.name)
            else:
                if timings is None:
                    timings = _trial(
                        module, op, spec, cands, rows, len(members), footprint, clock
                    )
                    cache.put(key, timings)
                    measured, source = True, "measured"
                choice = decide(
                    cands, timings, mode, holds_weights=spec.holds_weights, source=source
                )
        choices[key.name] = choice
    busy = oversubscribed(window) if measured else None
    if measured and busy is None:
        cache.save()
    elif measured:
        logger.warning(
            "cpu kernels: not caching this trial, the machine was oversubscribed (%s): "
            "the next start measures again",
            busy,
        )
    return choices


def trial_rows(batch_rows: int, prefill_rows: int) -> dict[str, int]:
    """The rows each class's trial runs, each inside its class's bounds."""
    batch = min(max(DECODE_MAX_ROWS + 1, batch_rows), BATCH_MAX_ROWS)
    return {"decode": 1, "batch": batch, "prefill": max(BATCH_MAX_ROWS + 1, prefill_rows)}


def _follow(
    groups: Mapping[OpKey, list[tuple[Any, str, OpSpec]]], doc: Mapping[str, Any], leader: str
) -> dict[str, Choice]:
    """The leader's choices for this process's op keys. A key the leader lacks, or a path
    this process cannot run, is an error: serving apart from the leader is what
    ``SharedChoice`` exists to prevent."""
    choices: dict[str, Choice] = {}
    for key, members in groups.items():
        got = doc.get(key.name)
        if got is None:
            raise RuntimeError(f"cpu kernels: {leader} chose no path for {key.name}")
        choice = Choice.from_dict(got)
        runnable = set(members[0][2].candidates)
        if not set(choice.by_class().values()) <= runnable:
            picked = "/".join(c.name for c in choice.by_class().values())
            raise RuntimeError(
                f"cpu kernels: {leader} chose {picked} (decode/batch/prefill) for "
                f"{key.name}, which this process cannot run"
            )
        choices[key.name] = choice
    return choices


# Other processes may use this much of the cores this process's threads do not (in cores,
# averaged over the trials) before the trials count as contended.
OTHERS_SLACK_CORES = 0.3


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used on the cores this process may run on (None: unknown) and by this
    process (all its threads), at one moment of the monotonic clock, and how many such
    cores there are."""

    machine_busy_s: float | None
    own_s: float
    at_s: float
    cores: int


def cpu_sample() -> CpuSample:
    cpus = _usable_cpus()
    return CpuSample(_busy_s(cpus), time.process_time(), time.monotonic(), len(cpus))


def _usable_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _busy_s(cpus: set[int]) -> float | None:
    """Busy CPU seconds since boot of the cores in ``cpus`` (/proc/stat's per-core lines:
    all but idle and iowait; steal counts, it is a hypervisor's other guest on our core),
    or None. Only this process's cores: a rank pinned to its own core beside another
    rank on the next one is not contended by it (counted machine-wide, two ranks pinned
    a core each saw each other's loading as 1.0 core of contention and every dp 2 start
    measured again)."""
    total = 0
    seen = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                name = fields[0]
                if name == "cpu" or int(name[3:]) not in cpus:
                    continue
                # user nice system idle iowait irq softirq steal
                ticks = [int(v) for v in fields[1:9]]
                if len(ticks) < 5:
                    return None
                total += sum(ticks) - ticks[3] - ticks[4]
                seen += 1
    except (OSError, ValueError):
        return None
    if seen != len(cpus):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def oversubscribed(since: CpuSample | None = None, threads: int | None = None) -> str | None:
    """Why timings taken since ``since`` should not be kept, or None.

    Other processes that ran meanwhile make any path look like any other: a parallel
    region waits for a descheduled thread, so a multi-threaded path's calls stretch while
    a single-threaded one's do not (measured with one other busy process on 2 cores: a
    1024x1024 linear at one row "took" 5-6 ms on the C++ path and 0.36 ms on torch's; its
    own speed is 0.07-0.1 ms against torch's 0.3-0.4). So the trials' window is judged by
    the CPU time others used in it on the cores this process may run on, from
    /proc/stat: more than the cores its ``threads`` leave free there (plus
    ``OTHERS_SLACK_CORES``) is contention -- ranks beside each other, each on its own
    share of the cores (pinned or not), are not. Without /proc/stat (or ``since``): a load
    average above the usable cores plus one. Such a choice serves this start only."""
    now = cpu_sample()
    cores = now.cores
    if since is not None and since.machine_busy_s is not None and now.machine_busy_s is not None:
        wall = now.at_s - since.at_s
        if wall <= 0:
            return None
        if since.cores != now.cores:  # counted over other cores at each end
            return "this process's cores changed during the trials"
        own = now.own_s - since.own_s
        others = max(0.0, (now.machine_busy_s - since.machine_busy_s) - own) / wall
        free = max(0, cores - (threads or torch.get_num_threads()))
        if others > free + OTHERS_SLACK_CORES:
            return f"other processes used {others:.1f} of {cores} cores during the trials"
        return None
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    if load > cores + 1:
        return f"load average {load:.1f} on {cores} cores"
    return None


def _trial(
    module: Any,
    op: str,
    spec: OpSpec,
    cands: list[Candidate],
    rows: Mapping[str, int],
    count: int,  # the model's modules of this key
    footprint: int,  # bytes of all the model's CPU weights
    clock: Callable[[], float],
) -> dict[str, dict[str, float]]:
    # Enough stand-ins that a call reads its weights from where the model's come from. One
    # a layer was too few: the 8 FP8 qkv linears of a 1024-wide model (12 MB) came from
    # L3 and kept the FP8 AMX kernel, while serving, from memory, ran the dot kernel's
    # 1.4x faster. Ops without weights (attention, norms) keep one a layer.
    instances = count
    if spec.weight_bytes > 0:
        streamed = min(footprint, TRIAL_BYTES) // spec.weight_bytes
        instances = min(max(streamed, 1), max(count, TRIAL_MAX_INSTANCES))
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        stand_ins: dict[str, Callable[[int], Callable[[], object]]] = {}
        for c in cands:  # built once for both classes: the weights are the trial's cost
            try:
                stand_ins[c.name] = module.cpu_trial(op, c, instances)
            except Exception as e:  # noqa: BLE001 - that candidate cannot serve here
                logger.warning("cpu kernel trial %s %s: %s", spec.key.name, c.name, e)
        for cls, n in rows.items():
            thunks: dict[str, Callable[[], object]] = {}
            for name, for_rows in stand_ins.items():
                try:
                    thunks[name] = for_rows(n)
                except Exception as e:  # noqa: BLE001
                    logger.warning("cpu kernel trial %s %s: %s", spec.key.name, name, e)
            timed = measure(thunks, clock=clock)
            out[cls] = {k: round(v, 5) for k, v in timed.items() if _finite(v)}
    return out


def _log(report: SelectionReport) -> None:
    if report.chosen_by is not None:  # the leader logged each choice and its timings
        logger.info(
            "cpu kernels (%s): %d op(s) serve by %s's choices",
            report.mode, len(report.choices), report.chosen_by,
        )  # fmt: skip
        return
    for name, c in report.choices.items():
        logger.info(
            "cpu kernels: %s -> decode %s, batch %s, prefill %s (%s; ms per call %s)",
            name, c.decode.name, c.batch.name, c.prefill.name, c.source, json.dumps(c.timings_ms),
        )  # fmt: skip
    logger.info(
        "cpu kernels (%s) chosen in %.2f s for %s, %d thread(s); cache %s",
        report.mode, report.trial_s, report.fingerprint.get("cpu_model"),
        report.fingerprint.get("threads"), report.cache_file,
    )  # fmt: skip
