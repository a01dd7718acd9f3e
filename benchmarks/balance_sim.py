"""DP load-balancing simulator: vLLM's policy vs Tidal's, deterministic (seeded).

Engines serve at a fixed rate (one token per running request per step, up to
``max_running`` running); they report ``[waiting, running]`` after each step that changed
it; the real ``CoordinatorState`` publishes snapshots (at most every 100 ms); each frontend
owns a real ``Balancer``. Every socket hop costs ``lag_ms``. Time is an integer ms clock.

Prints one JSON line per (workload, policy): time-averaged max/mean of running (and of
waiting + running) per rank, max/mean of requests served per rank, queueing delay.

    python benchmarks/balance_sim.py [--seeds 3] [--duration-s 30] [--frontends 2]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import random
import statistics
from dataclasses import asdict, dataclass, field, replace

from tidal.dp_coordinator.balance import Balancer, policy_names
from tidal.dp_coordinator.state import CoordinatorState, PublishSnapshot
from tidal.protocol.messages import EngineCoreOutputs, SchedulerStats

WORKLOADS = ("uniform", "bursty", "skewed")
_MEAN_LEN = {"uniform": 50.0, "bursty": 50.0, "skewed": 0.9 * 10 + 0.1 * 400}


@dataclass(frozen=True)
class SimConfig:
    workload: str = "uniform"
    policy: str = "tidal"
    num_engines: int = 4
    num_frontends: int = 2
    seed: int = 0
    duration_ms: int = 30_000
    warmup_ms: int = 1_000
    step_ms: int = 20  # one engine step
    max_running: int = 16  # max_num_seqs
    utilization: float = 0.75  # offered tokens / capacity
    publish_interval_ms: int = 100
    lag_ms: int = 1  # every socket hop
    sample_ms: int = 10
    burst_spread_ms: int = 150


@dataclass
class _Req:
    arrival: int
    length: int
    frontend: int
    rank: int = -1
    admitted: int = -1
    done: int = 0


@dataclass
class _Engine:
    waiting: collections.deque = field(default_factory=collections.deque)
    running: list = field(default_factory=list)
    reported: tuple[int, int] = (0, 0)
    served: int = 0

    def step(self, now: int, max_running: int) -> list[_Req]:
        while self.waiting and len(self.running) < max_running:
            req = self.waiting.popleft()
            req.admitted = now
            self.running.append(req)
        finished = []
        for req in self.running:
            req.done += 1
            if req.done >= req.length:
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.done < r.length]
            self.served += len(finished)
        return finished


def make_arrivals(cfg: SimConfig) -> list[tuple[int, int]]:
    """(arrival ms, output length) sorted by time, for the configured workload."""
    rng = random.Random(cfg.seed * 1_000_003 + WORKLOADS.index(cfg.workload))
    capacity = cfg.num_engines * cfg.max_running * (1000 / cfg.step_ms)  # tokens/s
    rate = cfg.utilization * capacity / _MEAN_LEN[cfg.workload] / 1000  # requests/ms
    out: list[tuple[int, int]] = []
    t = 0.0
    if cfg.workload == "bursty":
        mean_burst = (8 + 40) / 2
        while True:
            t += rng.expovariate(rate / mean_burst)
            if t >= cfg.duration_ms:
                return sorted(out)
            # A client batch: its requests land within ``burst_spread_ms``, i.e. across
            # one or two snapshot intervals.
            size = rng.randint(8, 40)
            out += [
                (int(t + rng.uniform(0, cfg.burst_spread_ms)), rng.randint(20, 80))
                for _ in range(size)
            ]
    while True:
        t += rng.expovariate(rate)
        if t >= cfg.duration_ms:
            return out
        if cfg.workload == "skewed":
            length = rng.randint(300, 500) if rng.random() < 0.1 else rng.randint(5, 15)
        else:
            length = rng.randint(20, 80)
        out.append((int(t), length))


def _ratio(xs: list[int]) -> float | None:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean > 0 else None


class _Sim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.coord = CoordinatorState(
            cfg.num_engines, publish_interval_s=cfg.publish_interval_ms / 1000
        )
        self.engines = [_Engine() for _ in range(cfg.num_engines)]
        self.fronts = [
            Balancer(
                cfg.num_engines,
                cfg.policy,
                client_index=f,
                num_clients=cfg.num_frontends,
                seed=cfg.seed,
            )
            for f in range(cfg.num_frontends)
        ]
        self.events: list[tuple[int, int, str, object]] = []
        self._seq = 0
        self.run_ratio: list[float] = []
        self.load_ratio: list[float] = []
        self.run_sums = [0, 0.0]  # sum over samples of max and of mean running per rank
        self.reqs: list[_Req] = []

    def later(self, kind: str, payload: object, now: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (now + self.cfg.lag_ms, self._seq, kind, payload))

    def publish(self, actions: list, now: int) -> None:
        for a in actions:
            if isinstance(a, PublishSnapshot):
                self.later("snap", a.snapshot, now)

    def deliver(self, now: int) -> None:
        while self.events and self.events[0][0] <= now:
            _, _, kind, payload = heapq.heappop(self.events)
            if kind == "req":
                self.engines[payload.rank].waiting.append(payload)
            elif kind == "finish":
                self.fronts[payload.frontend].on_finish(payload.rank)
            elif kind == "stats":
                self.publish(self.coord.handle(payload, now / 1000), now)
            else:
                for bal in self.fronts:
                    bal.on_snapshot(payload, now / 1000)

    def step_engines(self, now: int) -> None:
        cfg = self.cfg
        for e, eng in enumerate(self.engines):
            # Engines are not in lockstep: stagger their step boundaries.
            if (now + e * cfg.step_ms // cfg.num_engines) % cfg.step_ms:
                continue
            for req in eng.step(now, cfg.max_running):
                self.later("finish", req, now)
            load = (len(eng.waiting), len(eng.running))
            if load != eng.reported:
                eng.reported = load
                stats = SchedulerStats(num_waiting_reqs=load[0], num_running_reqs=load[1])
                self.later("stats", EngineCoreOutputs(engine_id=e, scheduler_stats=stats), now)

    def sample(self, now: int) -> None:
        if now < self.cfg.warmup_ms or now % self.cfg.sample_ms:
            return
        running = [len(e.running) for e in self.engines]
        self.run_sums[0] += max(running)
        self.run_sums[1] += sum(running) / len(running)
        run = _ratio(running)
        load = _ratio([len(e.running) + len(e.waiting) for e in self.engines])
        if run is not None:
            self.run_ratio.append(run)
        if load is not None:
            self.load_ratio.append(load)

    def run(self) -> dict:
        cfg = self.cfg
        arrivals = collections.deque(make_arrivals(cfg))
        now, i = 0, 0
        while now < cfg.duration_ms or any(e.waiting or e.running for e in self.engines):
            self.deliver(now)
            while arrivals and arrivals[0][0] <= now:
                _, length = arrivals.popleft()
                req = _Req(arrival=now, length=length, frontend=i % cfg.num_frontends)
                i += 1
                bal = self.fronts[req.frontend]
                req.rank = bal.choose()
                bal.on_send(req.rank, now / 1000)
                self.reqs.append(req)
                self.later("req", req, now)
            self.step_engines(now)
            self.publish(self.coord.tick(now / 1000), now)
            if now < cfg.duration_ms:
                self.sample(now)
            now += 1
        return self.metrics()

    def metrics(self) -> dict:
        queue = sorted(r.admitted - r.arrival for r in self.reqs)
        served = [e.served for e in self.engines]
        return {
            "requests": len(self.reqs),
            "running_imbalance": statistics.fmean(self.run_ratio),
            # Load-weighted: sum of max over sum of mean, so idle moments weigh little.
            "running_imbalance_weighted": self.run_sums[0] / self.run_sums[1],
            "load_imbalance": statistics.fmean(self.load_ratio),
            "served_imbalance": _ratio(served),
            "mean_queue_ms": statistics.fmean(queue),
            "p99_queue_ms": queue[int(0.99 * (len(queue) - 1))],
        }


def simulate(cfg: SimConfig) -> dict:
    """Run one simulation; returns its metrics (deterministic for a given config)."""
    return _Sim(cfg).run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--step-ms", type=int, default=20)
    ap.add_argument("--utilization", type=float, default=0.75)
    ap.add_argument("--policies", default=",".join(policy_names()))
    args = ap.parse_args()
    for workload in WORKLOADS:
        for policy in args.policies.split(","):
            cfg = SimConfig(
                workload=workload,
                policy=policy,
                num_engines=args.engines,
                num_frontends=args.frontends,
                duration_ms=int(args.duration_s * 1000),
                step_ms=args.step_ms,
                max_running=args.max_running,
                utilization=args.utilization,
            )
            runs = [simulate(replace(cfg, seed=seed)) for seed in range(args.seeds)]
            row = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in runs[0]}
            params = {k: v for k, v in asdict(cfg).items() if k != "seed"}
            print(json.dumps({**params, "seeds": args.seeds, **row}))


if __name__ == "__main__":
    main()
