"""Rank death under load: Tidal's emergency scale-down vs a restart, in one run; and the
fault matrix: every process kind killed or frozen.

    python benchmarks/faults.py                  # kill -9 one rank of DP=3 under 32 streams
    python benchmarks/faults.py --restore        # ... then scale back to 3 (--elastic-restore)
    python benchmarks/faults.py --quick          # a short smoke run (8 streams)
    python benchmarks/faults.py --matrix         # 7 process kinds x 3 faults, a line each
    python benchmarks/faults.py --host-loss      # a whole headless host killed or frozen

The default model (the embedded tiny Qwen3-MoE, float32) is served by an in-process
``AsyncLLM`` at DP=EP=``--size`` with elastic EP. ``--streams`` clients stream requests
back to back (random 8-40 token prompts, greedy, ``ignore_eos``, ``--max-tokens`` each;
the load generator of ``benchmarks/elastic.py``). After a warm-up and a baseline window,
the engine at rank ``--victim-rank`` gets SIGKILL. Nothing else is done by hand: the
frontend sees the process exit, its recovery operation rebuilds the groups without the
dead rank (its requests migrate as resumed requests), and with ``--restore`` a scale-up
brings the deployment back to ``--size``.

Measured (``system: tidal``), on the clock of the scale records (``time.monotonic``):

- ``detect_s``: kill -> the death recorded by the frontend;
- ``recovered_s``: kill -> the recovery operation's commit (groups rebuilt);
- ``new_requests_served_s``: a probe request (4 greedy tokens) is submitted the moment
  after the kill, and again every ``--retry-s`` while it is refused or fails: kill -> its
  first token ("time until new requests are served again");
- ``max_stream_pause_s`` / ``p50_stream_pause_s``: per stream, its last token before the
  kill to its first token after (every stream is affected: the survivors' groups broke
  with the dead rank), beside ``baseline_gap`` (token gaps before the kill);
- ``requests_migrated`` (the dead rank's, resumed elsewhere), ``lost`` (requests in flight
  at the kill that did not end with exactly ``--max-tokens`` tokens), ``errors``;
- ``restore_s`` (with ``--restore``): the restore operation's duration.

The peer (``system: restart``): the same load against the same model and EP without
elastic EP -- what a deployment does today (vLLM has no automatic recovery; SGLang's
elastic EP loses the dead ranks' requests). The same rank is killed; the client fails
every request (``EngineDeadError``); a supervisor that polls ``is_dead`` every
``--retry-s`` stops the deployment and starts it again at the same size while the
clients keep retrying. ``new_requests_served_s``: the same probe, which the new
deployment answers; ``lost``: the requests in flight at the kill; ``errors`` counts every
request that failed (attempts against the dead deployment included). The restart is in-process
(interpreter, imports and page cache kept), so it is the peer at its fastest.

Prints one JSON document (machine, model, load, one row per system, ``targets``: new
requests served < 5 s after the kill, 0 lost). Every engine process is stopped at the
end, also on Ctrl-C, SIGTERM or an error; ``leftover_processes`` counts what was alive.

``--matrix`` (docs/architecture.md#faults: a helper is never a single point of failure, and a process
that freezes is handled like one that dies). A fresh DP=EP=``--size`` deployment with
elastic EP per cell, under ``--streams`` streams; the fault hits one process of a kind:

- ``engine``: the engine at rank 1;
- ``zygote``: the warm launcher, then a scale-up to ``--size`` + 1 asks it for an engine
  (cold-started while no zygote answers);
- ``coordinator``: the DP coordinator;
- ``joiner``: the new engine of a scale-up to ``--size`` + 1, once its PREPARE is out;
- ``leaver``: the leaving engine of a scale-down to ``--size`` - 1 with a 30 s drain, once
  its PREPARE is out (it drains its streams);

- ``tp-worker``: the TP rank 1 worker of the engine at rank 1, in a deployment whose
  ranks each run ``-tp 2`` (a worker's death or freeze is its rank's);
- ``ray-node``: the Ray node of the engine at rank 1, the ranks run by the Ray launcher on
  a loopback ``ray.cluster_utils.Cluster`` started for the cell (a head node with no CPU,
  one node of one CPU per rank): ``kill`` removes the node (its raylet and everything it
  runs, as a host lost), ``stop`` freezes the raylet and every process under it for good
  (no ``stop5``: Ray itself declares a node silent for a second dead). Ray's driver prints
  its own report of the lost node to stdout: the JSON lines are those starting with ``{``;

with each fault: ``kill`` (SIGKILL), ``stop`` (SIGSTOP for good: the frontend must find
it and kill it), ``stop5`` (SIGSTOP, SIGCONT 5 s later). Nothing else is done by hand.
One JSON line per cell: ``lost`` (requests in flight at the fault that did not end with
exactly ``--max-tokens`` tokens), ``errors`` (requests that raised), ``max_stream_pause_s``
(per stream, its last token before the fault to its first after), ``new_request_served_s``
(a probe submitted right after the fault, retried while refused: its first token), the
``final_size``, the operations the cell caused, and restarts of helpers. A last line
sums the matrix up (``all_zero_lost``).

``--host-loss``: the README's two-host deployment on loopback -- the frontend with rank 0,
a ``launch --headless`` host (its own launcher process) with ranks 1 and 2 -- under the
same load, without and with ``--enable-elastic-ep``; the whole host is killed (SIGKILL to
its launcher and both ranks at once) or frozen for good (SIGSTOP to all three: nothing
here can kill them). A line each, as the matrix's, with ``target: host``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic import (  # noqa: E402 - the sibling benchmark's load generator and helpers
    Load,
    Req,
    _r,
    add_load_args,
    gap_summary,
    gaps_ending_in,
    load_info,
    machine_info,
    make_llm,
    model_info,
    percentile,
    run_benchmark,
)

TARGET_NEW_REQUESTS_SERVED_S = 5.0


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ measures (pure)


def stream_pauses(reqs: list[Req], t: float) -> list[float]:
    """Per stream that had a token before ``t``: its last token before ``t`` to its first
    token after (the pause its client saw, across request boundaries and failures)."""
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    for r in reqs:
        for c, _ in r.chunks:
            if c <= t:
                before[r.stream] = max(before.get(r.stream, c), c)
            else:
                after[r.stream] = min(after.get(r.stream, c), c)
    return [after[w] - before[w] for w in sorted(before) if w in after]


def in_flight_at(reqs: list[Req], t: float) -> list[Req]:
    return [r for r in reqs if r.submitted <= t and (r.done is None or r.done > t)]


def fault_row(
    system: str,
    reqs: list[Req],
    t_kill: float,
    max_tokens: int,
    t_new: float | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    hit = in_flight_at(reqs, t_kill)
    pauses = stream_pauses(reqs, t_kill)
    return {
        "system": system,
        "new_requests_served_s": _r(None if t_new is None else t_new - t_kill),
        "max_stream_pause_s": _r(max(pauses) if pauses else None),
        "p50_stream_pause_s": _r(percentile(pauses, 50)),
        "in_flight_at_kill": len(hit),
        "lost": sum(1 for r in hit if not r.complete(max_tokens)),
        "errors": sum(1 for r in reqs if r.error is not None),
        **extra,
    }


def targets(tidal: dict[str, Any]) -> dict[str, Any]:
    served = tidal["new_requests_served_s"]
    return {
        "new_requests_served_s": {
            "value": served,
            "target": f"< {TARGET_NEW_REQUESTS_SERVED_S}",
            "ok": served is not None and served < TARGET_NEW_REQUESTS_SERVED_S,
        },
        "lost": {"value": tidal["lost"], "target": "0", "ok": tidal["lost"] == 0},
        "errors": {"value": tidal["errors"], "target": "0", "ok": tidal["errors"] == 0},
    }


# ------------------------------------------------------------------ runs


async def _warm(load: Load, opts: argparse.Namespace) -> tuple[float, float]:
    await load.wait(lambda: load.completed() >= opts.streams, 300)
    await asyncio.sleep(opts.warmup_s)
    b0 = time.monotonic()
    await asyncio.sleep(opts.baseline_s)
    return b0, time.monotonic()


async def probe(get_llm: Callable[[], Any], retry_s: float) -> float:
    """Submit one short request now; while it is refused or fails, again every
    ``retry_s``. Returns when its first token arrived."""
    from tidal.frontend.processor import ProcessedPrompt
    from tidal.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    attempt = 0
    while True:
        llm = get_llm()
        if llm is not None:
            attempt += 1
            try:
                gen = llm.generate(ProcessedPrompt(None, [5, 6, 7]), params, f"probe-{attempt}")
                async for _ in gen:
                    t = time.monotonic()
                    await gen.aclose()
                    return t
            except Exception:  # noqa: BLE001, S110 - refused or failed: try again
                pass
        await asyncio.sleep(retry_s)


def _kill(llm: Any, rank: int) -> tuple[int, float]:
    engine = llm.client.topology.engine_ids[rank]
    os.kill(llm.client.manager.procs[engine].pid, signal.SIGKILL)
    return engine, time.monotonic()


async def run_tidal(opts: argparse.Namespace) -> dict[str, Any]:
    llm = await asyncio.to_thread(
        make_llm, opts.model, opts.dtype, opts.size, True, restore=opts.restore
    )
    load: Load | None = None
    try:
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed)
        b0, b1 = await _warm(load, opts)
        victim, t_kill = _kill(llm, opts.victim_rank)
        probing = asyncio.create_task(probe(lambda: llm, opts.retry_s))
        log(f"tidal: killed engine {victim} (rank {opts.victim_rank} of {opts.size})")
        controller = llm.scale_driver.controller

        def recovered() -> bool:
            return any(d["recovered_at"] for d in controller.faults()["deaths"])

        await load.wait(recovered, 120)
        t_new = await asyncio.wait_for(probing, 120)
        if opts.restore:
            await load.wait(lambda: llm.client.topology.size == opts.size, 300)
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        faults = controller.faults()
        history = llm.scaling_history()
    finally:
        if load is not None:
            await load.cancel()
        await llm.shutdown()
    (death,) = faults["deaths"]
    recovery = next(h for h in history if h["operation_id"] == death["recovered_by"])
    restore = [h for h in history if h["trigger"] == "restore"]
    reqs = load.reqs
    log(f"tidal: recovered in {death['recovered_at'] - t_kill:.2f}s")
    extra = {
        "detect_s": _r(death["at"] - t_kill),
        "recovered_s": _r(death["recovered_at"] - t_kill),
        "recovery_operation_s": _r(recovery["duration_s"]),
        "recovery_phases_s": {k: _r(v) for k, v in recovery["phase_durations_s"].items()},
        "requests_migrated": death["requests_migrated"],
        "restore_s": _r(restore[-1]["duration_s"]) if restore else None,
        "restore_result": restore[-1]["result"] if restore else None,
        "baseline_gap": gap_summary(gaps_ending_in(reqs, b0, b1)),
        "requests": len(reqs),
    }
    return fault_row("tidal", reqs, t_kill, opts.max_tokens, t_new, extra)


async def run_restart(opts: argparse.Namespace) -> dict[str, Any]:
    llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, opts.size, False)
    load: Load | None = None
    try:
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed + 1, retry_s=opts.retry_s)
        await _warm(load, opts)
        victim, t_kill = _kill(llm, opts.victim_rank)
        probing = asyncio.create_task(probe(lambda: load.llm, opts.retry_s))
        log(f"restart: killed engine {victim}")
        while not llm.is_dead:  # the supervisor's poll
            await asyncio.sleep(opts.retry_s)
        t_detect = time.monotonic()
        load.llm = None
        old, llm = llm, None
        await old.shutdown()
        t_stopped = time.monotonic()
        load.deployment += 1
        llm = await asyncio.to_thread(make_llm, opts.model, opts.dtype, opts.size, False)
        t_up = time.monotonic()
        load.llm = llm
        t_new = await asyncio.wait_for(probing, 300)
        await asyncio.sleep(opts.settle_s)
        await load.finish()
    finally:
        if load is not None:
            await load.cancel()
        if llm is not None:
            await llm.shutdown()
    reqs = load.reqs
    extra = {
        "detect_s": _r(t_detect - t_kill),
        "stop_s": _r(t_stopped - t_detect),
        "start_s": _r(t_up - t_stopped),
        "requests_migrated": 0,
        "refused_attempts": len(load.refused),
        "requests": len(reqs),
    }
    log(f"restart: new requests served {t_new - t_kill:.2f}s after the kill")
    return fault_row("restart", reqs, t_kill, opts.max_tokens, t_new, extra)


async def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    tidal = await run_tidal(opts)
    peer = await run_restart(opts) if not opts.no_peer else None
    return {
        "benchmark": "faults",
        "machine": machine_info(),
        "model": model_info(opts),
        "load": {
            **load_info(opts),
            "size": opts.size,
            "victim_rank": opts.victim_rank,
            "restore": opts.restore,
        },
        "rows": [tidal] + ([peer] if peer is not None else []),
        "targets": targets(tidal),
        "elapsed_s": _r(time.monotonic() - t0, 1),
    }


# ------------------------------------------------------------------ the fault matrix

TARGETS = ("engine", "zygote", "coordinator", "joiner", "leaver", "tp-worker", "ray-node")
FAULTS = ("kill", "stop", "stop5")
# A Ray node frozen for a few seconds is declared dead by Ray itself: that cell is ``stop``.
SKIPPED_CELLS = {("ray-node", "stop5")}
RESUME_AFTER_S = 5.0  # stop5: SIGCONT this long after SIGSTOP
LEAVER_DRAIN_S = 30.0


class Fault:
    """One fault on one process (or a Ray node's processes): SIGKILL, or SIGSTOP (SIGCONT
    after ``RESUME_AFTER_S`` for ``stop5``). ``release()`` resumes what is still stopped
    (cleanup). ``must_be_killed``: a process stopped for good is the frontend's to find and
    kill (a frozen Ray node is Ray's to declare dead: nothing here can kill it)."""

    def __init__(self, kind: str, must_be_killed: bool = True) -> None:
        self.kind = kind
        self.must_be_killed = must_be_killed
        self.pids: list[int] = []
        self.at: float | None = None
        self._resume: asyncio.TimerHandle | None = None

    def hit(self, *pids: int) -> float:
        self.pids, self.at = list(pids), time.monotonic()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)
        if self.kind == "stop5":
            loop = asyncio.get_running_loop()
            self._resume = loop.call_later(RESUME_AFTER_S, self._cont)
        return self.at

    def _cont(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    @property
    def resumed_by(self) -> float:
        """When the fault's own part is over (a stop5 process resumed)."""
        assert self.at is not None
        return self.at + (RESUME_AFTER_S if self.kind == "stop5" else 0.0)

    def handled(self) -> bool:
        """A process stopped for good must have been found and killed by the frontend."""
        if self.kind != "stop" or not self.must_be_killed:
            return True
        import psutil

        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    def release(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        if self.kind != "kill":
            self._cont()


class LoopbackRayCluster:
    """A Ray cluster of this machine for one cell: a head node with no CPU (the frontend's
    driver connects there), ``nodes`` nodes of one CPU each (one rank each), everything on
    loopback, node deaths seen in about a second. ``close()`` stops it and removes its
    session files."""

    def __init__(self, nodes: int) -> None:
        import tempfile

        # Read when Ray is first imported, in this process and the ones it starts.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="tidal-faults-ray-")
        self._tmpdir_before = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.temp_dir
        os.makedirs(os.path.join(self.temp_dir, "ray"))  # Ray writes, but does not make, it
        try:
            self._start(Cluster, nodes)
        except BaseException:
            self.close()
            raise

    def _start(self, cluster_class: Any, nodes: int) -> None:
        store = 80 * 1024 * 1024  # per node: Ray's least is 75 MiB
        self.cluster = cluster_class(
            initialize_head=True,
            head_node_args={
                "temp_dir": self.temp_dir,
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "object_store_memory": store,
                "_system_config": {
                    "health_check_period_ms": 500,
                    "health_check_failure_threshold": 2,
                },
            },
        )
        for _ in range(nodes):
            self.cluster.add_node(
                num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=store,
                temp_dir=self.temp_dir,
            )  # fmt: skip
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def _node(self, node_id: str) -> Any:
        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        return node

    def node_pids(self, node_id: str) -> list[int]:
        """The node's raylet and every process under it (its actors, their engines)."""
        import psutil

        raylet = self._node(node_id).all_processes["raylet"][0].process.pid
        kids = psutil.Process(raylet).children(recursive=True)
        return [raylet, *(k.pid for k in kids)]

    def remove(self, node_id: str) -> float:
        """Kill the node's processes at once, as a host lost; when it was hit."""
        t = time.monotonic()
        self.cluster.remove_node(self._node(node_id), allow_graceful=False)
        return t

    def close(self) -> None:
        import shutil

        import ray

        ray.shutdown()
        if getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()
        if self._tmpdir_before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._tmpdir_before
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _on_prepare(llm: Any, pick: Callable[[Any], list[int]], fault: Fault) -> asyncio.Future:
    """Hit ``fault`` on the first engine ``pick(prepare)`` names, once that PREPARE is out;
    the future gets the hit time."""
    client = llm.client
    send = client.send_scale
    hit: asyncio.Future = asyncio.get_running_loop().create_future()

    async def hooked(engine_ids: Any, message: Any) -> list[int]:
        out = await send(engine_ids, message)
        from tidal.protocol.elastic import ScalePrepare

        if isinstance(message, ScalePrepare) and not hit.done():
            targets = pick(message)
            if targets:
                hit.set_result(fault.hit(client.manager.procs[targets[0]].pid))
        return out

    client.send_scale = hooked
    return hit


async def _until(pred: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def run_cell(opts: argparse.Namespace, target: str, kind: str) -> dict[str, Any]:
    """One cell of the matrix (see the module docstring)."""
    on_ray = target == "ray-node"
    # Ray sets signal handlers as it starts and stops: on the main thread, not a worker.
    cluster = LoopbackRayCluster(opts.size) if on_ray else None
    ray = {"ray_address": cluster.address} if cluster is not None else None
    tp = 2 if target == "tp-worker" else 1
    try:
        llm = await asyncio.to_thread(
            make_llm, opts.model, opts.dtype, opts.size, True, ray=ray, tp=tp
        )
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    llm.start()
    load: Load | None = None
    fault = Fault(kind, must_be_killed=not on_ray)
    scale: asyncio.Task | None = None

    def warm_launcher_ready() -> bool:  # the Ray launcher keeps no zygote
        return on_ray or (manager.zygote is not None and manager.zygote.ready)

    try:
        manager, size = llm.client.manager, opts.size
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed)
        await _warm(load, opts)
        await _until(warm_launcher_ready, 120)
        history0 = len(llm.scaling_history())
        rank1 = llm.client.topology.engine_ids[1]
        if target == "engine":
            t_fault = fault.hit(manager.procs[rank1].pid)
        elif target == "tp-worker":
            t_fault = fault.hit(llm.processes()[rank1]["worker_pids"][-1])
        elif target == "ray-node":
            assert cluster is not None
            node = llm.processes()[rank1]["node"]
            if kind == "kill":
                fault.at = t_fault = cluster.remove(node)
            else:
                t_fault = fault.hit(*cluster.node_pids(node))
        elif target == "coordinator":
            t_fault = fault.hit(llm.client.coordinator.proc.pid)
        elif target == "zygote":
            t_fault = fault.hit(manager.zygote.pid)
            scale = asyncio.create_task(llm.scale_elastic_ep(size + 1))
        else:
            joiner = target == "joiner"
            hit = _on_prepare(llm, lambda m: m.joining if joiner else m.leaving, fault)
            new = size + 1 if joiner else size - 1
            drain = 0.0 if joiner else LEAVER_DRAIN_S
            scale = asyncio.create_task(llm.scale_elastic_ep(new, drain_timeout=drain))
            t_fault = await asyncio.wait_for(hit, 300)
        probing = asyncio.create_task(probe(lambda: llm, opts.retry_s))
        log(f"matrix: {target} x {kind} at t={t_fault:.2f}")
        if scale is not None:
            code, rec = await asyncio.wait_for(scale, 600)
            log(f"matrix: {target} x {kind}: the scale call ended {rec['result']} ({code})")
        t_new = await asyncio.wait_for(probing, 300)
        await asyncio.sleep(max(0.0, fault.resumed_by - time.monotonic()))

        def settled() -> bool:
            faults = llm.fault_status()
            coord = llm.client.coordinator
            return (
                fault.handled()
                and faults["degraded"] is None
                and not llm.is_scaling_elastic_ep()
                and (coord is None or coord.is_alive())
                and warm_launcher_ready()
            )

        if not await _until(settled, 300):
            log(f"matrix: {target} x {kind}: not settled after 300 s")
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        history = llm.scaling_history()[history0:]
        faults = llm.fault_status()
        final_size = llm.client.topology.size
        coordinator_restarts = faults["coordinator_restarts"]
        zygote_restarts = manager.zygote_restarts
    finally:
        fault.release()
        if load is not None:
            await load.cancel()
        await llm.shutdown()
        if cluster is not None:
            cluster.close()
    reqs = load.reqs
    return {
        "target": target,
        "tensor_parallel_size": tp,
        "backend": "ray" if on_ray else "mp",
        "fault": kind,
        **_outcome(reqs, opts, t_fault, t_new, final_size),
        "operations": [
            {
                "trigger": h["trigger"],
                "sizes": f"{h['from_size']}->{h['to_size']}",
                "result": h["result"],
                "duration_s": _r(h["duration_s"]),
                "cause": h["cause"],
            }
            for h in history
        ],
        "deaths": [
            {"engine": d["engine_id"], "detect_s": _r(d["at"] - t_fault), "cause": d["cause"]}
            for d in faults["deaths"]
        ],
        "coordinator_restarts": coordinator_restarts,
        "zygote_restarts": zygote_restarts,
        "error_samples": sorted({r.error for r in reqs if r.error})[:3],
    }


def _outcome(
    reqs: list[Any], opts: argparse.Namespace, t_fault: float, t_new: float, final_size: int
) -> dict[str, Any]:
    """What every cell reports of its load around the fault at ``t_fault``."""
    hit = in_flight_at(reqs, t_fault)
    pauses = stream_pauses(reqs, t_fault)
    return {
        "lost": sum(1 for r in hit if not r.complete(opts.max_tokens)),
        "errors": sum(1 for r in reqs if r.error is not None),
        "max_stream_pause_s": _r(max(pauses) if pauses else None),
        "new_request_served_s": _r(t_new - t_fault),
        "final_size": final_size,
        "in_flight_at_fault": len(hit),
        "requests": len(reqs),
    }


HOST_SECRET = "faults-benchmark-host-secret-0123"


def _start_host(opts: argparse.Namespace, rpc: int, elastic: bool) -> Any:
    """``launch --headless`` for ranks 1 and 2 of DP=3, as another host would run it."""
    import subprocess

    flags = [
        "--dtype", opts.dtype, "--dp", "3", "--data-parallel-size-local", "2",
        "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc), "--ep", "--headless",
    ] + (["--model", opts.model] if opts.model else []) + (
        ["--enable-elastic-ep"] if elastic else []
    )  # fmt: skip
    env = {**os.environ, "TIDAL_DP_AUTH_KEY": HOST_SECRET}
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.launch.spawn", *flags], env=env, stdout=subprocess.DEVNULL
    )


def _host_llm(opts: argparse.Namespace, rpc: int, elastic: bool) -> Any:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.launch.engine_args import EngineArgs

    config = EngineArgs(
        model=opts.model,
        dtype=opts.dtype,
        data_parallel_size=3,
        data_parallel_size_local=1,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=rpc,
        data_parallel_auth_key=HOST_SECRET,
        enable_expert_parallel=True,
        enable_elastic_ep=elastic,
    ).create_engine_config()
    return AsyncLLM(config)


async def run_host_cell(opts: argparse.Namespace, elastic: bool, kind: str) -> dict[str, Any]:
    """The host of ranks 1 and 2 lost (``kill``) or frozen for good (``stop``)."""
    import psutil

    from tidal.distributed.ports import get_open_port

    rpc = get_open_port()
    host = _start_host(opts, rpc, elastic)
    llm = await asyncio.to_thread(_host_llm, opts, rpc, elastic)
    llm.start()
    load: Load | None = None
    frozen: list[Any] = []
    try:
        load = Load(llm, opts.streams, opts.max_tokens, seed=opts.seed)
        await _warm(load, opts)
        procs = [psutil.Process(host.pid), *psutil.Process(host.pid).children(recursive=True)]
        t_fault = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        frozen = procs if kind == "stop" else []
        probing = asyncio.create_task(probe(lambda: llm, opts.retry_s))
        log(f"host loss ({'elastic' if elastic else 'default'}) x {kind} at t={t_fault:.2f}")
        t_new = await asyncio.wait_for(probing, 300)

        def recovered() -> bool:
            return llm.fault_status()["degraded"] is None and llm.client.topology.size == 1

        if not await _until(recovered, 300):
            log("host loss: not recovered after 300 s")
        await asyncio.sleep(opts.settle_s)
        await load.finish()
        history = llm.scaling_history()
        faults = llm.fault_status()
        final_size = llm.client.topology.size
    finally:
        if load is not None:
            await load.cancel()
        await llm.shutdown()
        for p in frozen:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if host.poll() is None:
            host.kill()
        host.wait(30)
    reqs = load.reqs
    return {
        "target": "host",
        "fault": kind,
        "elastic": elastic,
        **_outcome(reqs, opts, t_fault, t_new, final_size),
        "recovery_operations": sum(1 for h in history if h["trigger"] == "recovery"),
        "operations": [
            {"trigger": h["trigger"], "sizes": f"{h['from_size']}->{h['to_size']}",
             "result": h["result"], "dead": h["dead"], "duration_s": _r(h["duration_s"])}
            for h in history
        ],  # fmt: skip
        "deaths": [
            {"engine": d["engine_id"], "detect_s": _r(d["at"] - t_fault), "cause": d["cause"]}
            for d in faults["deaths"]
        ],
    }


async def run_host_loss(opts: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    cells = []
    for elastic in (False, True):
        for kind in ("kill", "stop"):
            cell = await run_host_cell(opts, elastic, kind)
            cells.append(cell)
            print(json.dumps({"benchmark": "faults-host-loss", **cell}), flush=True)
    return {
        "benchmark": "faults-host-loss-summary",
        "machine": machine_info(),
        "model": model_info(opts),
        "load": {**load_info(opts), "size": 3, "host_ranks": [1, 2]},
        "target_new_request_served_s": TARGET_NEW_REQUESTS_SERVED_S,
        "all_served_within_target": all(
            c["new_request_served_s"] < TARGET_NEW_REQUESTS_SERVED_S for c in cells
        ),
        "all_zero_lost": all(c["lost"] == 0 for c in cells),
        "all_one_recovery": all(c["recovery_operations"] == 1 for c in cells),
        "elapsed_s": _r(time.monotonic() - t0, 1),
    }


def matrix_cells(opts: argparse.Namespace) -> list[tuple[str, str]]:
    """(target, fault) of every cell asked for, in order, less ``SKIPPED_CELLS``."""
    return [
        (t, f) for t in opts.targets for f in opts.faults if (t, f) not in SKIPPED_CELLS
    ]


async def run_matrix(opts: argparse.Namespace) -> dict[str, Any]:
    """Every cell, a JSON line each as it ends; the summary is the returned document."""
    t0 = time.monotonic()
    cells = []
    for target, kind in matrix_cells(opts):
        cell = await run_cell(opts, target, kind)
        cells.append(cell)
        print(json.dumps({"benchmark": "faults-matrix", **cell}), flush=True)
    return {
        "benchmark": "faults-matrix-summary",
        "machine": machine_info(),
        "model": model_info(opts),
        "load": {**load_info(opts), "size": opts.size},
        "table": [
            {k: c[k] for k in ("target", "fault", "lost", "errors", "max_stream_pause_s",
                               "new_request_served_s", "final_size")}  # fmt: skip
            for c in cells
        ],
        "all_zero_lost": all(c["lost"] == 0 for c in cells),
        "all_zero_errors": all(c["errors"] == 0 for c in cells),
        "elapsed_s": _r(time.monotonic() - t0, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_load_args(p, baseline_s=5.0, settle_s=2.0)
    p.add_argument("--size", type=int, default=3, help="DP = EP size at launch")
    p.add_argument("--victim-rank", type=int, default=1, help="rank that gets SIGKILL")
    p.add_argument("--restore", action="store_true", help="scale back to --size afterwards")
    p.add_argument("--no-peer", action="store_true", help="skip the restart peer")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 streams, short windows")
    p.add_argument("--matrix", action="store_true", help="the fault matrix (see above)")
    p.add_argument("--host-loss", action="store_true", help="a headless host lost (see above)")
    p.add_argument("--targets", default=",".join(TARGETS), help="matrix: process kinds")
    p.add_argument("--faults", default=",".join(FAULTS), help="matrix: faults")
    opts = p.parse_args(argv)
    opts.targets = [t for t in opts.targets.split(",") if t]
    opts.faults = [f for f in opts.faults.split(",") if f]
    if not set(opts.targets) <= set(TARGETS) or not set(opts.faults) <= set(FAULTS):
        p.error(f"--targets: of {','.join(TARGETS)}; --faults: of {','.join(FAULTS)}")
    if opts.quick:
        opts.streams, opts.max_tokens = 8, 16
        opts.warmup_s, opts.baseline_s, opts.settle_s = 0.5, 1.0, 0.5
    elif opts.matrix or opts.host_loss:  # many deployments: lighter load, shorter windows
        given = argv if argv is not None else sys.argv
        for flag, name, value in (
            ("--streams", "streams", 16),
            ("--warmup-s", "warmup_s", 1.0),
            ("--baseline-s", "baseline_s", 1.0),
            ("--settle-s", "settle_s", 1.0),
        ):
            if flag not in given:
                setattr(opts, name, value)
    if not 0 <= opts.victim_rank < opts.size or opts.size < 2:
        p.error(f"--victim-rank must be a rank of --size (>= 2): got {opts.victim_rank}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.matrix or opts.host_loss:  # a JSON line per cell, then the summary's line
        run_benchmark(run_matrix if opts.matrix else run_host_loss, opts, log, indent=None)
    else:
        run_benchmark(run_all, opts, log)


if __name__ == "__main__":
    main()
