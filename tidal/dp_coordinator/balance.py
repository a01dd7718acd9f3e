"""Engine choice for a frontend's DP load balancer (pure: no sockets; time is passed in).

The coordinator publishes per-rank ``[waiting, running]`` at most every 100 ms, and an
engine reports a change only after its next step, so a snapshot lags what this frontend
has already sent and seen finish. A ``Balancer`` (one per frontend) therefore scores each
rank from the last snapshot corrected by its own events the snapshot cannot reflect yet.

Policies (``policy_names()``, ``register_policy``):

``vllm``   vLLM's baseline: ``4 * waiting + running``; own sends since the last snapshot
           count as waiting (times the number of frontends, guessing the others did the
           same) and are forgotten when a snapshot arrives; finishes are ignored until a
           snapshot shows them; ties go to the first rank from a fixed per-frontend start.
``tidal``  the same score on a better estimate of each rank's load *now*:
           * own sends stay counted until ``stats_lag_s`` (about one engine step) before
             the latest snapshot arrived -- sends just before it are not in it yet;
           * own finishes since the latest snapshot free their slots at once (the frontend
             sees a finish one hop after the step; the snapshot showing it comes later);
           * own outstanding requests (sent, not finished; exact) floor a rank's total, so
             a lagging snapshot never makes a rank look emptier than this frontend alone
             knows it is;
           * the total is split into running/waiting at the rank's capacity, learnt from
             snapshots in which requests waited, so ``4 * waiting`` means real queueing;
           * KV usage above ``kv_high`` adds a penalty (that rank would preempt) and is the
             first tie-breaker (5 % buckets); remaining ties rotate (start after the last
             rank sent to) instead of favouring the lowest index.
``tidal-p2c`` ``tidal`` scored on two random distinct ranks (power of two choices), for
           many frontends herding on one stale snapshot; measured worse than ``tidal`` at
           small DP sizes, kept for large ones.

``benchmarks/balance_sim.py`` compares them. An explicit ``data_parallel_rank`` on a
request overrides the choice (range-checked).
"""

from __future__ import annotations

import collections
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from tidal.engine_core.messages import DPLoadSnapshot


@dataclass(frozen=True)
class RankLoad:
    """What a frontend knows about one rank when choosing."""

    waiting: int  # from the last snapshot
    running: int  # from the last snapshot
    kv_usage: float = 0.0  # from the last snapshot, 0..1
    sent: int = 0  # own sends the snapshot does not reflect (the policy's window)
    finished: int = 0  # own finishes the snapshot does not reflect
    inflight: int = 0  # own requests sent to this rank and not finished yet
    capacity: int = 0  # running seen while requests waited (0 = never seen saturated)


class Policy(ABC):
    """Scores ranks; lower key wins. Subclasses set ``name`` and the knobs below."""

    name: ClassVar[str]
    # Own sends this long before the latest snapshot arrived still count as unseen
    # (an engine reports a request only after its next step); 0 = forget at a snapshot.
    stats_lag_s: ClassVar[float] = 0.0
    rotate_ties: ClassVar[bool] = False
    sample: ClassVar[int] = 0  # score only this many random ranks (0 = all)

    @abstractmethod
    def key(self, load: RankLoad, num_clients: int) -> tuple[float, ...]: ...


_POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    if cls.name in _POLICIES:
        raise ValueError(f"balance policy {cls.name!r} registered twice")
    _POLICIES[cls.name] = cls
    return cls


def get_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown balance policy {name!r}; choose from {sorted(_POLICIES)}"
        ) from None


def policy_names() -> list[str]:
    return sorted(_POLICIES)


@register_policy
class VllmPolicy(Policy):
    name = "vllm"

    def key(self, load: RankLoad, num_clients: int) -> tuple[float, ...]:
        return (4 * (load.waiting + num_clients * load.sent) + load.running,)


@register_policy
class TidalPolicy(Policy):
    name = "tidal"
    stats_lag_s = 0.02  # about one engine step
    rotate_ties = True
    kv_high = 0.9  # above this KV usage a new request likely causes preemption
    kv_penalty = 8.0  # score added at 100 % KV usage (two waiting requests' worth)

    def estimate(self, load: RankLoad, num_clients: int) -> tuple[float, float]:
        """(waiting, running) on the rank now. Own unseen sends and finishes are scaled
        by the number of frontends (the others are assumed to do alike); own outstanding
        requests are certain, so they floor the total; the total is split at the
        capacity last seen while requests waited (unknown: all of it runs)."""
        delta = num_clients * (load.sent - load.finished)
        total = max(float(load.waiting + load.running + delta), float(load.inflight), 0.0)
        running = min(total, float(load.capacity)) if load.capacity else total
        return total - running, running

    def key(self, load: RankLoad, num_clients: int) -> tuple[float, ...]:
        waiting, running = self.estimate(load, num_clients)
        score = 4.0 * waiting + running
        if load.kv_usage > self.kv_high:
            score += self.kv_penalty * (load.kv_usage - self.kv_high) / (1.0 - self.kv_high)
        return (score, round(load.kv_usage * 20))


@register_policy
class TidalP2CPolicy(TidalPolicy):
    name = "tidal-p2c"
    sample = 2


def check_rank(data_parallel_rank: int, num_engines: int) -> int:
    """Validate an explicit ``data_parallel_rank`` against the current DP size."""
    if (
        isinstance(data_parallel_rank, bool)
        or not isinstance(data_parallel_rank, int)
        or not 0 <= data_parallel_rank < num_engines
    ):
        raise ValueError(
            f"data_parallel_rank={data_parallel_rank!r} is out of range: this deployment "
            f"has {num_engines} DP rank(s), valid ranks are 0..{num_engines - 1}"
        )
    return data_parallel_rank


def _pick(
    policy: Policy,
    loads: Sequence[RankLoad],
    candidates: Sequence[int],
    start: int,
    num_clients: int,
) -> int:
    """First rank with the lowest key, scanning ``candidates`` in order from ``start``."""
    n = len(loads)
    order = sorted(candidates, key=lambda r: (r - start) % n)
    best = order[0]
    best_key = policy.key(loads[best], num_clients)
    for r in order[1:]:
        k = policy.key(loads[r], num_clients)
        if k < best_key:
            best, best_key = r, k
    return best


def choose_engine(
    snapshot_counts: Sequence[Sequence[int]],
    own_inflight: Sequence[int],
    *,
    kv_usage: Sequence[float] | None = None,
    policy: str = "tidal",
    start: int = 0,
    num_clients: int = 1,
) -> int:
    """Stateless choice: ``snapshot_counts[r] = [waiting, running]``; ``own_inflight[r]``
    = requests this frontend sent to rank r that the snapshot does not reflect yet."""
    n = len(snapshot_counts)
    if n == 0 or len(own_inflight) != n:
        raise ValueError("snapshot_counts and own_inflight must be non-empty and equal length")
    kv = kv_usage if kv_usage is not None else [0.0] * n
    loads = [
        RankLoad(c[0], c[1], kv[r], sent=own_inflight[r], inflight=own_inflight[r])
        for r, c in enumerate(snapshot_counts)
    ]
    return _pick(get_policy(policy), loads, range(n), start % n, num_clients)


class Balancer:
    """Frontend-side balancing state for one DP client. All times are this process's
    monotonic clock (never compared with another process's).

    Call ``choose()`` for a request, then ``on_send(rank, now)`` once it is sent there,
    ``on_finish(rank)`` when it finishes or is aborted, ``on_snapshot(snap, now)`` per
    snapshot. A request migrated to another rank is ``on_finish(old)`` + ``on_send(new)``."""

    def __init__(
        self,
        num_engines: int,
        policy: str = "tidal",
        *,
        client_index: int = 0,
        num_clients: int = 1,
        seed: int = 0,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.policy = get_policy(policy)
        self.client_index = client_index
        self.num_clients = num_clients
        self._rng = random.Random(seed * 1_000_003 + client_index)
        self._draining: frozenset[int] = frozenset()
        self._init_ranks(num_engines)

    def _init_ranks(self, n: int) -> None:
        self.num_engines = n
        self._counts = [[0, 0] for _ in range(n)]
        self._kv = [0.0] * n
        self._inflight = [0] * n
        self._sends: list[collections.deque[float]] = [collections.deque() for _ in range(n)]
        self._finished = [0] * n  # own finishes since the latest snapshot
        self._capacity = [0] * n
        # Spread frontends' fixed/rotating starting points over the ranks.
        self._start = (self.client_index * n // self.num_clients) % n

    # ---------------------------------------------------------------- events

    def on_snapshot(self, snap: DPLoadSnapshot, now: float) -> None:
        self.on_load(snap.counts, snap.kv_usage, now)

    def on_load(
        self, counts: Sequence[Sequence[int]], kv_usage: Sequence[float], now: float
    ) -> None:
        """A new snapshot arrived at ``now``. Ranks it does not cover (a size change in
        flight) read as idle."""
        n = self.num_engines
        self._counts = [list(counts[r][:2]) if r < len(counts) else [0, 0] for r in range(n)]
        self._kv = [float(kv_usage[r]) if r < len(kv_usage) else 0.0 for r in range(n)]
        for r, (waiting, running) in enumerate(self._counts):
            if waiting > 0:  # saturated: running is what this rank can hold right now
                self._capacity[r] = running
            elif running > self._capacity[r] > 0:
                self._capacity[r] = running
        horizon = now - self.policy.stats_lag_s
        for sends in self._sends:
            while sends and sends[0] <= horizon:
                sends.popleft()
        self._finished = [0] * n

    def on_send(self, rank: int, now: float) -> None:
        check_rank(rank, self.num_engines)
        self._sends[rank].append(now)
        self._inflight[rank] += 1
        if self.policy.rotate_ties:
            self._start = (rank + 1) % self.num_engines

    def on_finish(self, rank: int) -> None:
        if 0 <= rank < self.num_engines and self._inflight[rank] > 0:
            self._inflight[rank] -= 1
            self._finished[rank] += 1

    def resize(self, num_engines: int) -> None:
        """Elastic scaling; own in-flight counts of surviving ranks are kept."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        inflight = self._inflight
        self._init_ranks(num_engines)
        for r in range(min(num_engines, len(inflight))):
            self._inflight[r] = inflight[r]
        self._draining = frozenset(r for r in self._draining if r < num_engines)

    def set_draining(self, ranks: Sequence[int]) -> None:
        """Ranks being removed by a scale-down get no automatically chosen requests."""
        self._draining = frozenset(check_rank(r, self.num_engines) for r in ranks)

    # ---------------------------------------------------------------- choice

    def loads(self) -> list[RankLoad]:
        return [
            RankLoad(
                c[0],
                c[1],
                self._kv[r],
                len(self._sends[r]),
                self._finished[r],
                self._inflight[r],
                self._capacity[r],
            )
            for r, c in enumerate(self._counts)
        ]

    def choose(self, data_parallel_rank: int | None = None) -> int:
        """The rank for the next request (does not record it: call ``on_send``)."""
        if data_parallel_rank is not None:
            return check_rank(data_parallel_rank, self.num_engines)
        candidates = [r for r in range(self.num_engines) if r not in self._draining]
        if not candidates:
            raise RuntimeError("every DP rank is draining; no rank accepts new requests")
        k = self.policy.sample
        if 0 < k < len(candidates):
            candidates = self._rng.sample(candidates, k)
        return _pick(self.policy, self.loads(), candidates, self._start, self.num_clients)
