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
request overrides the choice (range-checked); it is a rank, i.e. a position in the current
``Topology``, and is mapped to that engine's id. Everything else here is keyed by engine
id, which is stable across reconfigurations (docs/architecture.md#elastic-identity).
"""

from __future__ import annotations

import collections
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tidal.protocol.messages import DPLoadSnapshot
from tidal.protocol.topology import Topology


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


class _EngineLoad:
    """What one frontend tracks about one engine (mutable; the Balancer's table row)."""

    __slots__ = ("counts", "kv", "inflight", "sends", "finished", "capacity")
    counts: tuple[int, int]

    def __init__(self) -> None:
        self.counts = (0, 0)  # [waiting, running] from the latest snapshot covering it
        self.kv = 0.0
        self.inflight = 0  # own requests sent and not finished (exact)
        self.sends: collections.deque[float] = collections.deque()  # own send times
        self.finished = 0  # own finishes since the latest snapshot covering it
        self.capacity = 0  # running seen while requests waited

    def load(self) -> RankLoad:
        waiting, running = self.counts
        return RankLoad(
            waiting,
            running,
            self.kv,
            len(self.sends),
            self.finished,
            self.inflight,
            self.capacity,
        )


class Balancer:
    """Frontend-side balancing state for one DP client, keyed by engine id (docs/architecture.md#elastic-identity). All times are this process's monotonic clock (never compared with another
    process's).

    Call ``choose()`` for a request (an engine id), then ``on_send(engine_id, now)`` once
    it is sent there, ``on_finish(engine_id)`` when it finishes or is aborted,
    ``on_snapshot(snap, now)`` per snapshot and ``set_topology`` on each reconfiguration.
    A request migrated to another engine is ``on_finish(old)`` + ``on_send(new)``.

    Topology races: a snapshot published before the coordinator learnt the current
    topology arrives after ``set_topology``; its epoch is older, and it is dropped whole
    (applying it would resurrect a removed engine's row or give a new engine a removed
    one's load). A snapshot from a *newer* epoch than this frontend knows (another
    frontend's controller moved first) is applied to the engines both know; the others
    keep their last load until this frontend's own ``set_topology``. Events for an engine
    no longer in the topology (a finish of a request that was on a removed engine) are
    ignored: its row, in-flight counts included, went with it."""

    def __init__(
        self,
        topology: Topology | int,
        policy: str = "tidal",
        *,
        client_index: int = 0,
        num_clients: int = 1,
        seed: int = 0,
    ) -> None:
        if isinstance(topology, int):  # launch size: engine ids 0..n-1
            topology = Topology.initial(topology)
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.policy = get_policy(policy)
        self.client_index = client_index
        self.num_clients = num_clients
        self._rng = random.Random(seed * 1_000_003 + client_index)
        self._draining: frozenset[int] = frozenset()
        self.stale_snapshots = 0  # dropped: older epoch than the topology
        self.topology = topology
        self._engines: dict[int, _EngineLoad] = {e: _EngineLoad() for e in topology.engine_ids}
        self._reset_start()

    def _reset_start(self) -> None:
        # Spread frontends' fixed/rotating starting positions over the ranks.
        n = self.topology.size
        self._start = (self.client_index * n // self.num_clients) % n

    @property
    def num_engines(self) -> int:
        return self.topology.size

    @property
    def engine_ids(self) -> list[int]:
        return self.topology.engine_ids

    # ---------------------------------------------------------------- events

    def on_snapshot(self, snap: DPLoadSnapshot, now: float) -> bool:
        """A new snapshot arrived at ``now``; False when dropped as stale."""
        if snap.epoch < self.topology.epoch:
            self.stale_snapshots += 1
            return False
        horizon = now - self.policy.stats_lag_s
        for engine_id, counts, kv in zip(snap.engine_ids, snap.counts, snap.kv_usage):
            row = self._engines.get(engine_id)
            if row is None:
                continue  # not (or no longer) in this frontend's topology
            waiting, running = row.counts = (counts[0], counts[1])
            row.kv = float(kv)
            if waiting > 0:  # saturated: running is what this engine can hold right now
                row.capacity = running
            elif running > row.capacity > 0:
                row.capacity = running
            while row.sends and row.sends[0] <= horizon:
                row.sends.popleft()
            row.finished = 0
        return True

    def on_send(self, engine_id: int, now: float) -> None:
        row = self._row(engine_id)
        row.sends.append(now)
        row.inflight += 1
        if self.policy.rotate_ties:
            self._start = (self.topology.rank_of(engine_id) + 1) % self.num_engines

    def on_finish(self, engine_id: int) -> None:
        row = self._engines.get(engine_id)  # None: removed since the send
        if row is not None and row.inflight > 0:
            row.inflight -= 1
            row.finished += 1

    def set_topology(self, topology: Topology) -> bool:
        """Elastic scaling: drop removed engines (their in-flight counts with them), add
        new ones idle, keep survivors' rows. False when ``topology`` is not newer (a stale
        or repeated one); ValueError for a different one at the same epoch."""
        if not topology.supersedes(self.topology):
            return False
        old = self._engines
        self._engines = {e: old.get(e) or _EngineLoad() for e in topology.engine_ids}
        self._draining = frozenset(e for e in self._draining if e in self._engines)
        self.topology = topology
        self._reset_start()
        return True

    @property
    def draining(self) -> frozenset[int]:
        return self._draining

    def set_draining(self, engine_ids: Sequence[int]) -> None:
        """Engines being removed by a scale-down get no automatically chosen requests."""
        for e in engine_ids:
            self._row(e)  # validates
        self._draining = frozenset(engine_ids)

    # ---------------------------------------------------------------- choice

    def loads(self) -> list[RankLoad]:
        """Per engine, in rank (topology) order."""
        return [row.load() for row in self._engines.values()]

    def load_of(self, engine_id: int) -> RankLoad:
        return self._row(engine_id).load()

    def choose(
        self, data_parallel_rank: int | None = None, *, exclude: Collection[int] = ()
    ) -> int:
        """The engine id for the next request (does not record it: call ``on_send``).
        An explicit ``data_parallel_rank`` is a rank (position) in the current topology.
        ``exclude``: engine ids that must not get it either (a migrating request's former
        owners), on top of the draining ones."""
        ids = self.topology.engine_ids
        if data_parallel_rank is not None:
            return ids[check_rank(data_parallel_rank, len(ids))]
        candidates = [r for r, e in enumerate(ids) if e not in self._draining and e not in exclude]
        if not candidates and any(e in exclude for e in ids if e not in self._draining):
            # Every rank staying in a scale-down is excluded (dead, or gone from the
            # routes): that operation cannot commit, its rollback will route to the
            # draining ranks again, so one of them takes the request instead of a refusal.
            candidates = [r for r, e in enumerate(ids) if e not in exclude]
        if not candidates:
            raise RuntimeError("every DP rank is draining; no rank accepts new requests")
        k = self.policy.sample
        if 0 < k < len(candidates):
            candidates = self._rng.sample(candidates, k)
        rank = _pick(self.policy, self.loads(), candidates, self._start, self.num_clients)
        return ids[rank]

    def _row(self, engine_id: int) -> _EngineLoad:
        row = self._engines.get(engine_id)
        if row is None or isinstance(engine_id, bool):
            raise ValueError(
                f"engine {engine_id!r} is not in topology epoch {self.topology.epoch} "
                f"(engines {self.topology.engine_ids})"
            )
        return row
