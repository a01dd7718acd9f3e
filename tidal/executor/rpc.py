"""Engine -> worker calls by name (docs/architecture.md#worker-rpc).

A call names ``"<namespace>.<method>"``: the namespace is one part of a worker
(``tidal.executor.worker.WORKER_RPCS``: ``worker``, ``runner``, ``elastic``), the method
one that part's class exports with ``@rpc(...)``. The decorator declares, once, everything
the engine side needs to know about the call: how the results of a rank's workers combine
(``Reduce``), which workers answer, how long a worker process may take, and whether its
failure leaves the rank's workers out of step. Nothing else is callable: an unknown
namespace, a method that is not exported or a private name is an ``RpcNameError`` naming
it, raised on the engine before anything is sent and again on the worker.

Arguments are positional; their annotated types are the wire types between processes
(msgspec, ``rpc_signature``).
"""

from __future__ import annotations

import enum
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

from tidal.protocol.worker import ReplyMode

F = TypeVar("F", bound=Callable[..., Any])


@enum.unique
class Reduce(enum.Enum):
    """How the results of a rank's workers (in TP rank order) become the call's result."""

    NONE = "none"  # None: the call's effect is its point (still waits for every answer)
    FIRST = "first"  # TP rank 0's (the driver's: the step's output, the DP consensus)
    MIN = "min"
    SUM = "sum"  # numbers each worker counted for its own share (bytes received)
    ANY = "any"
    # dict[key, list[int]], summed element-wise per key (per-layer expert load: each
    # worker counted the tokens of its own share).
    SUM_COUNTS = "sum_counts"
    EACH = "each"  # the list itself: one result per answering worker

    def apply(self, results: list[Any]) -> Any:
        return self.reducer()(results)

    def reducer(self) -> Callable[[list[Any]], Any]:
        """The function that combines the results (``Rpc.combine`` caches it: a member
        lookup per ``case`` would cost microseconds on every call of the hot path)."""
        match self:
            case Reduce.NONE:
                return _none
            case Reduce.FIRST:
                return _first
            case Reduce.MIN:
                return min
            case Reduce.SUM:
                return sum
            case Reduce.ANY:
                return any
            case Reduce.SUM_COUNTS:
                return _sum_counts
            case Reduce.EACH:
                return _each
            case _:
                assert_never(self)


def _none(results: list[Any]) -> None:
    return None


def _first(results: list[Any]) -> Any:
    return results[0]


def _each(results: list[Any]) -> list[Any]:
    return results


def _sum_counts(results: list[dict[Any, list[int]]]) -> dict[Any, list[int]]:
    total: dict[Any, list[int]] = {}
    for counts in results:
        for key, row in counts.items():
            acc = total.setdefault(key, [0] * len(row))
            for i, n in enumerate(row):
                acc[i] += n
    return total


@dataclass(frozen=True)
class RpcSpec:
    """What ``@rpc`` declares about one exported method."""

    reduce: Reduce = Reduce.NONE
    # DRIVER: every worker runs it, only TP rank 0 answers (unless it fails).
    reply: ReplyMode = ReplyMode.ALL
    # Only TP rank 0 runs it at all (the DP group's consensus is the rank-0 workers').
    driver_only: bool = False
    # Worker processes must answer within this (seconds; None: no bound). Calls that clean
    # up after a failure are bounded: a worker stuck in a collective with a dead peer must
    # not hang the rank.
    timeout_s: float | None = None
    # Runs no collective: its failure fails the call, not the rank (the workers are still
    # in step).
    local: bool = False
    # Once the executor shut down it answers as if no worker did (the reduction of no
    # results: ANY -> False) instead of raising: a liveness query the engine's I/O
    # threads keep asking until the process exits.
    empty_after_shutdown: bool = False

    def __post_init__(self) -> None:
        if self.reply is ReplyMode.DRIVER and self.reduce not in (
            Reduce.FIRST,
            Reduce.NONE,
            Reduce.EACH,
        ):
            raise ValueError(f"only the driver answers: {self.reduce} would see one result")
        if self.driver_only and self.reply is not ReplyMode.DRIVER:
            raise ValueError("a driver-only call is answered by the driver (ReplyMode.DRIVER)")
        if self.empty_after_shutdown and self.reduce not in (Reduce.NONE, Reduce.ANY):
            raise ValueError(f"{self.reduce} has no result over no workers")


_SPEC_ATTR = "__tidal_rpc__"


def rpc(
    reduce: Reduce = Reduce.NONE,
    *,
    reply: ReplyMode = ReplyMode.ALL,
    driver_only: bool = False,
    timeout_s: float | None = None,
    local: bool = False,
    empty_after_shutdown: bool = False,
) -> Callable[[F], F]:
    """Export the decorated method to the engine (see ``RpcSpec`` for the options).
    Outermost, above decorators such as ``torch.no_grad()``."""
    spec = RpcSpec(reduce, reply, driver_only, timeout_s, local, empty_after_shutdown)

    def export(fn: F) -> F:
        if fn.__name__.startswith("_"):
            raise ValueError(f"{fn.__name__!r}: a private method cannot be exported")
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return export


@functools.cache
def exports(cls: type) -> dict[str, RpcSpec]:
    """``cls``'s exported methods (its bases' included) and their specs."""
    out: dict[str, RpcSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, _SPEC_ATTR, None)
            if isinstance(spec, RpcSpec):
                out[name] = spec
    return out


def rpc_signature(fn: Callable[..., Any]) -> tuple[tuple[Any, ...], Any]:
    """``(parameter types, return type)`` of method ``fn`` from its annotations (through
    decorators that wrap it): what a worker process decodes a call's arguments into and
    the engine decodes its result into."""
    fn = inspect.unwrap(fn)
    hints = typing.get_type_hints(fn)
    params = [
        p
        for p in list(inspect.signature(fn).parameters.values())[1:]  # after self
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return tuple(hints.get(p.name, Any) for p in params), hints.get("return", Any)


class RpcNameError(LookupError):
    """A call names no exported worker method."""


@dataclass(frozen=True)
class Rpc:
    """One resolved method name."""

    method: str  # "<namespace>.<name>", as called
    namespace: str
    name: str
    spec: RpcSpec
    params: tuple[Any, ...]  # annotated parameter types, positional
    result: Any  # annotated return type
    combine: Callable[[list[Any]], Any]  # spec.reduce's function


class RpcTable:
    """The namespaces a worker exports, by the class of each part; resolution is cached
    (every call of the hot path resolves its name)."""

    def __init__(self, namespaces: Mapping[str, type]) -> None:
        self.namespaces = dict(namespaces)
        self._resolved: dict[str, Rpc] = {}

    def resolve(self, method: str) -> Rpc:
        found = self._resolved.get(method)
        if found is not None:
            return found
        namespace, dot, name = method.partition(".")
        if not dot:
            raise RpcNameError(
                f"worker call {method!r}: expected '<namespace>.<method>' "
                f"(namespaces: {', '.join(sorted(self.namespaces))})"
            )
        cls = self.namespaces.get(namespace)
        if cls is None:
            raise RpcNameError(
                f"worker call {method!r}: no namespace {namespace!r} "
                f"(namespaces: {', '.join(sorted(self.namespaces))})"
            )
        if name.startswith("_"):
            raise RpcNameError(f"worker call {method!r}: {name!r} is private")
        spec = exports(cls).get(name)
        if spec is None:
            raise RpcNameError(
                f"worker call {method!r}: {cls.__name__} exports no {name!r} "
                f"(exported: {', '.join(sorted(exports(cls)))})"
            )
        params, result = rpc_signature(getattr(cls, name))
        found = Rpc(method, namespace, name, spec, params, result, spec.reduce.reducer())
        self._resolved[method] = found
        return found

    def bind(self, targets: Mapping[str, object], method: str) -> tuple[Rpc, Callable[..., Any]]:
        """The method ``method`` names on ``targets`` (one object per namespace, each an
        instance of the table's class for it)."""
        r = self.resolve(method)
        return r, getattr(targets[r.namespace], r.name)
