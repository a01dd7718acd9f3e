"""Soak: a real ``launch --dp 2 --ep --enable-elastic-ep`` server under hours-like mixed
load, with a scale cycle and a rank kill every few minutes; what a long-running
deployment must show is that nothing is lost, nothing answers 5xx, and no process grows.

    python benchmarks/soak.py                      # 30 minutes (the issue's run)
    python benchmarks/soak.py --duration-s 30 --event-every-s 10   # the version CI runs

The server is started here (``python -m tidal.launch.cli serve --port 0``, the embedded
tiny model unless ``--model``) with ``--elastic-restore``: a killed rank is recovered
from (its requests migrate) and the deployment then scales itself back to two ranks.

Load: ``--clients`` HTTP clients (httpx, loopback only), each looping over a seeded mix
until the end of the run:

- ``stream``: a streamed greedy completion of ``ignore_eos`` tokens, read to its end;
- ``plain``: the same, not streamed;
- ``chat``: a streamed chat completion, read to its end;
- ``cancel``: a stream closed by its client after a few tokens (the server aborts it);
- ``stall``: a stream whose client reads nothing for ``--stall-s`` seconds (at least 1 s,
  at most until the end of the run) and then hangs up (a raw socket: nothing buffers on
  the client side);
- ``bad``: a request the server must refuse with a 4xx (malformed JSON, a wrong type, a
  negative ``max_tokens``, an unknown model, a lone surrogate).

Events, one starting every ``--event-every-s`` from the start of the load while half a
slot is left (alternating, starting with a scale cycle; one that overruns its slot delays
the next, which then starts at once): a scale
cycle (``POST /scale_elastic_ep`` to 3, then back to 2) or a rank kill (SIGKILL to the
engine of rank 1; the frontend recovers and restores the size by itself). Each event
waits until the deployment is back at two ranks and idle before the next is due.

Measured: ``lost`` (a ``stream``, ``plain`` or ``chat`` request that did not end with
exactly its ``max_tokens`` tokens and ``finish_reason: length``), ``http_5xx`` (any
answer >= 500, the ``stall`` and ``bad`` requests' included), ``bad_not_4xx`` (a bad
request answered otherwise), and per process of the deployment (the server, the
coordinator, every engine, sampled every ``--sample-s``): resident memory and open file
descriptors, first and last, and their least-squares slope per minute over the samples
after the warm-up (processes alive for at least a third of the run; a killed engine's
successor counts as a process of its own); ``idle_before_and_after``: descriptors and
memory of the processes that lived through the run, idle before the load (after a warm-up
scale cycle and rank kill, which open once what the first of each needs) and idle after it
(once every client connection has closed), where a leak shows without the load's noise.
After a graceful stop (SIGTERM to the server, as a supervisor does): ``leftover_processes``,
new ``/dev/shm/tidal-*`` segments, and anything left in the deployment's own ``TMPDIR``.

Prints one JSON document; ``ok`` is true when nothing was lost, nothing answered 5xx,
every bad request got a 4xx, every event completed, and nothing was left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

_SERVING = re.compile(r"tidal: serving on http://(\S+):(\d+)")
KINDS = ("stream", "plain", "chat", "cancel", "stall", "bad")
WEIGHTS = (40, 15, 15, 12, 6, 12)
BAD_BODIES: tuple[tuple[str, bytes], ...] = (
    ("malformed json", b'{"prompt": "x", "max_tokens": '),
    ("wrong type", b'{"prompt": "x", "max_tokens": "many"}'),
    ("negative max_tokens", b'{"prompt": "x", "max_tokens": -3}'),
    ("unknown model", b'{"model": "no-such-model", "prompt": "x", "max_tokens": 4}'),
    ("lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
)
WORDS = "the tide comes in and goes out over sand stone water light moon wind".split()


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


# ------------------------------------------------------------------ measures (pure)


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t_seconds, value)`` points, per minute; None under 3."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    if den == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / den


@dataclass
class Tally:
    """What the clients saw, by kind."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    lost: int = 0
    http_5xx: int = 0
    bad_not_4xx: int = 0
    samples: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.samples) < 10:
            self.samples.append(what[:300])


@dataclass
class ProcSeries:
    name: str
    points_rss: list[tuple[float, float]] = field(default_factory=list)
    points_fds: list[tuple[float, float]] = field(default_factory=list)


def summarize_procs(
    series: dict[tuple[int, float], ProcSeries], t_warm: float, duration_s: float
) -> list[dict[str, Any]]:
    """Per process alive for a third of the run: first/last RSS and fds, slopes after
    ``t_warm``."""
    rows = []
    for (pid, _), s in sorted(series.items(), key=lambda kv: kv[1].name):
        after_rss = [p for p in s.points_rss if p[0] >= t_warm]
        after_fds = [p for p in s.points_fds if p[0] >= t_warm]
        if not after_rss or after_rss[-1][0] - after_rss[0][0] < duration_s / 3:
            continue
        rss_slope = slope_per_min(after_rss)
        rows.append(
            {
                "pid": pid,
                "name": s.name,
                "rss_mib_first": _r(after_rss[0][1] / 2**20, 1),
                "rss_mib_last": _r(after_rss[-1][1] / 2**20, 1),
                "rss_mib_per_min": _r(None if rss_slope is None else rss_slope / 2**20),
                # Growth that slows down (a cache filling) or does not (a leak).
                "rss_mib_quarters": [
                    _r(after_rss[min(len(after_rss) - 1, len(after_rss) * q // 4)][1] / 2**20, 1)
                    for q in (1, 2, 3, 4)
                ],
                "fds_first": int(after_fds[0][1]),
                "fds_last": int(after_fds[-1][1]),
                "fds_max": int(max(v for _, v in after_fds)),
                "fds_per_min": _r(slope_per_min(after_fds)),
                "samples": len(after_rss),
            }
        )
    return rows


# ------------------------------------------------------------------ the server


class Server:
    """``tidal.launch.cli serve --port 0`` in a session of its own; its URL from the line
    it prints once ready. ``stop()`` is a supervisor's SIGTERM, then SIGKILL to whatever
    of the session is left (counted)."""

    def __init__(self, args: list[str], tmp: str, startup_timeout_s: float = 300.0) -> None:
        cmd = [sys.executable, "-m", "tidal.launch.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "TMPDIR": tmp},
        )  # fmt: skip
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = _SERVING.search(line)
                if m and not self.url:
                    host = "127.0.0.1" if m.group(1) in ("0.0.0.0", "::", "[::]") else m.group(1)
                    self.url = f"http://{host}:{m.group(2)}"
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(startup_timeout_s) or not self.url:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace_s: float = 60.0) -> int:
        """SIGTERM, then whatever of the session survives ``grace_s`` is killed: how many."""
        tree = self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        deadline = time.monotonic() + 10
        alive = [p for p in tree if _alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _alive(p)]
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return len(alive)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _shm_segments() -> set[str]:
    return {str(p) for p in Path("/dev/shm").glob("tidal-*")}


def idle_snapshot(server: Server) -> dict[int, dict[str, Any]]:
    """pid -> name, open descriptors and resident MiB of every process of the deployment."""
    out = {}
    for p in server.processes():
        with contextlib.suppress(psutil.Error), p.oneshot():
            out[p.pid] = {"name": p.name(), "fds": p.num_fds(),
                          "rss_mib": _r(p.memory_info().rss / 2**20, 1)}  # fmt: skip
    return out


async def until_no_client_connections(server: Server, port: int, timeout_s: float) -> bool:
    """Every HTTP connection to ``port`` closed (the clients have gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conns = psutil.Process(server.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        if not any(c.laddr and c.laddr.port == port and c.raddr for c in conns):
            return True
        await asyncio.sleep(0.2)
    return False


def idle_growth(before: dict, after: dict) -> list[dict[str, Any]]:
    """The processes idle both before and after the load: descriptors and memory then."""
    return [
        {"pid": pid, "name": b["name"], "fds_before": b["fds"], "fds_after": after[pid]["fds"],
         "rss_mib_before": b["rss_mib"], "rss_mib_after": after[pid]["rss_mib"]}
        for pid, b in sorted(before.items(), key=lambda kv: kv[1]["name"])
        if pid in after
    ]  # fmt: skip


# ------------------------------------------------------------------ load


class Load:
    def __init__(self, url: str, opts: argparse.Namespace, end: float) -> None:
        self.url, self.opts, self.end = url, opts, end
        self.tally = Tally()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))

    async def client(self, i: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + i)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=self.url, timeout=300.0, limits=limits) as http:
            while time.monotonic() < self.end:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                self.tally.counts[kind] += 1
                try:
                    await getattr(self, f"_{kind}")(http, rng)
                except Exception as e:  # noqa: BLE001 - a transport error is a problem too
                    if kind not in ("cancel", "stall"):
                        self.tally.lost += kind != "bad"
                        self.tally.problem(f"{kind}: {type(e).__name__}: {e}")

    def _prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))

    def _status(self, kind: str, status: int, body: str) -> bool:
        if status >= 500:
            self.tally.http_5xx += 1
            self.tally.problem(f"{kind}: {status} {body}")
        return status == 200

    def _complete(self, kind: str, got: int, want: int, finish: str | None) -> None:
        if (got, finish) != (want, "length"):
            self.tally.lost += 1
            self.tally.problem(f"{kind}: {got}/{want} tokens, finish {finish}")

    async def _stream(self, http: httpx.AsyncClient, rng: random.Random, chat: bool = False):
        want = rng.randint(4, self.opts.max_tokens)
        body: dict[str, Any] = {"max_tokens": want, "temperature": 0, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt(rng)}]
        else:
            body["prompt"] = self._prompt(rng)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kind = "chat" if chat else "stream"
        got, finish = 0, None
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self._status(kind, r.status_code, (await r.aread()).decode()[:200])
                self.tally.lost += 1
                self.tally.problem(f"{kind}: refused with {r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    self.tally.problem(f"{kind}: {msg['error']}")
                    continue
                if msg.get("usage"):
                    got = msg["usage"]["completion_tokens"]
                for c in msg.get("choices", []):
                    finish = c.get("finish_reason") or finish
        self._complete(kind, got, want, finish)

    async def _chat(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self._stream(http, rng, chat=True)

    async def _plain(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        want = rng.randint(4, self.opts.max_tokens)
        body = {"prompt": self._prompt(rng), "max_tokens": want, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = await http.post("/v1/completions", json=body)
        if not self._status("plain", r.status_code, r.text[:200]):
            self.tally.lost += 1
            self.tally.problem(f"plain: refused with {r.status_code} {r.text[:200]}")
            return
        out = r.json()
        self._complete("plain", out["usage"]["completion_tokens"], want,
                       out["choices"][0]["finish_reason"])  # fmt: skip

    async def _cancel(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": self._prompt(rng), "max_tokens": 256, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        keep = rng.randint(1, 6)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if not self._status("cancel", r.status_code, ""):
                return
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= keep:
                    break  # leaving the block closes the connection mid-stream

    async def _stall(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = json.dumps({"prompt": self._prompt(rng), "max_tokens": 512, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.addr[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection(*self.addr)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:  # a small window, so the server's sends back up at once
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(head + body)
            await writer.drain()
            # The client reads nothing meanwhile: --stall-s, cut at the end of the run (one
            # begun just before it would otherwise hold the run's end that long).
            await asyncio.sleep(max(1.0, min(self.opts.stall_s, self.end - time.monotonic())))
            status_line = await asyncio.wait_for(reader.readline(), 30)
            parts = status_line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                self._status("stall", int(parts[1]), status_line.decode(errors="replace"))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _bad(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        what, body = rng.choice(BAD_BODIES)
        r = await http.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        self._status("bad", r.status_code, f"{what}: {r.text[:200]}")
        if not 400 <= r.status_code < 500:
            self.tally.bad_not_4xx += 1
            self.tally.problem(f"bad ({what}): {r.status_code} {r.text[:200]}")


# ------------------------------------------------------------------ events


async def _stats(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get("/stats")
    r.raise_for_status()
    return r.json()


async def _until_size(http: httpx.AsyncClient, size: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            s = await _stats(http)
            if len(s.get("ranks", [])) == size and not s.get("is_scaling_elastic_ep"):
                return True
        await asyncio.sleep(0.5)
    return False


async def scale_cycle(http: httpx.AsyncClient) -> dict[str, Any]:
    t0 = time.monotonic()
    codes = []
    for size in (3, 2):
        r = await http.post("/scale_elastic_ep", json={"new_data_parallel_size": size})
        codes.append(r.status_code)
    ok = codes == [200, 200] and await _until_size(http, 2, 300)
    return {"event": "scale 2->3->2", "ok": ok, "codes": codes, "s": _r(time.monotonic() - t0, 2)}


async def kill_rank(http: httpx.AsyncClient) -> dict[str, Any]:
    """SIGKILL rank 1's engine; recovered (2 -> 1), then restored (1 -> 2) by the frontend
    itself."""
    t0 = time.monotonic()
    pid = (await _stats(http))["ranks"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    back = await _until_size(http, 2, 300)
    ok = back and pid not in {x["pid"] for x in (await _stats(http))["ranks"]}
    return {"event": "kill rank 1", "ok": ok, "pid": pid, "s": _r(time.monotonic() - t0, 2)}


async def events(url: str, opts: argparse.Namespace, end: float) -> list[dict[str, Any]]:
    """Alternate a scale cycle and a rank kill, one starting every ``--event-every-s``
    (counted from the start, so a slow event delays the next one only if it overruns its
    slot), while at least half a slot of the run is left."""
    done: list[dict[str, Any]] = []
    every = opts.event_every_s
    start = end - opts.duration_s  # the start of the load
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
        while True:
            due = max(start + every * (len(done) + 1), time.monotonic())
            if due + every / 2 > end:
                return done
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            done.append(await (scale_cycle if len(done) % 2 == 0 else kill_rank)(http))
            log(f"event {done[-1]}")


# ------------------------------------------------------------------ the run


async def sample(server: Server, t0: float, end: float, every_s: float, series: dict) -> None:
    while time.monotonic() < end:
        t = time.monotonic() - t0
        for p in server.processes():
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    s = series.setdefault(key, ProcSeries(p.name()))
                    s.points_rss.append((t, float(p.memory_info().rss)))
                    s.points_fds.append((t, float(p.num_fds())))
            except psutil.Error:
                continue
        await asyncio.sleep(every_s)


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    shm_before = _shm_segments()
    # The deployment's own TMPDIR: what it leaves there after a graceful stop is a leak,
    # whatever else runs on the machine.
    tmp = tempfile.mkdtemp(prefix="soak-tmp-")
    try:
        return await _run(opts, tmp, shm_before)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _run(opts: argparse.Namespace, tmp: str, shm_before: set[str]) -> dict[str, Any]:
    args = ["--dp", "2", "--ep", "--enable-elastic-ep", "--elastic-restore",
            "--dtype", opts.dtype, "--log-level", "warning"]  # fmt: skip
    if opts.model:
        args += ["--model", opts.model]
    args += opts.server_arg
    t_start = time.monotonic()
    server = Server(args, tmp)
    startup_s = time.monotonic() - t_start
    log(f"server at {server.url} in {startup_s:.1f}s; load for {opts.duration_s:.0f}s")
    series: dict[tuple[int, float], ProcSeries] = {}
    port = int(server.url.rsplit(":", 1)[1])
    idle_after: dict[int, dict[str, Any]] = {}
    try:
        # One of each event before the idle baseline: what the first scale-up or recovery
        # opens once (a thread pool, a helper's pipes) is not a leak of the load's.
        async with httpx.AsyncClient(base_url=server.url, timeout=600.0) as http:
            warm = [await scale_cycle(http), await kill_rank(http)]
        log(f"warm-up events {warm}")
        idle_before = idle_snapshot(server)
        t0 = time.monotonic()
        end = t0 + opts.duration_s
        load = Load(server.url, opts, end)
        sampler = asyncio.create_task(sample(server, t0, end, opts.sample_s, series))
        chaos = asyncio.create_task(events(server.url, opts, end))
        await asyncio.gather(*(load.client(i) for i in range(opts.clients)))
        done_events = await chaos
        await sampler
        elapsed = time.monotonic() - t0
        if await until_no_client_connections(server, port, 60):
            idle_after = idle_snapshot(server)
    finally:
        stopped_at = time.monotonic()
        killed = server.stop()
    stop_s = time.monotonic() - stopped_at
    left_paths = sorted(_shm_segments() - shm_before) + sorted(
        str(p) for p in Path(tmp).iterdir()
    )
    growth = idle_growth(idle_before, idle_after)
    tally = load.tally
    procs = summarize_procs(series, opts.duration_s * opts.warm_fraction, opts.duration_s)
    ok = (
        tally.lost == 0
        and tally.http_5xx == 0
        and tally.bad_not_4xx == 0
        and all(e["ok"] for e in warm + done_events)
        and killed == 0
        and not left_paths
        and bool(idle_after)
    )
    return {
        "benchmark": "soak",
        "machine": machine(),
        "server_args": args,
        "duration_s": _r(elapsed, 1),
        "startup_s": _r(startup_s, 1),
        "clients": opts.clients,
        "requests": tally.counts,
        "lost": tally.lost,
        "http_5xx": tally.http_5xx,
        "bad_not_4xx": tally.bad_not_4xx,
        "problem_samples": tally.samples,
        "warmup_events": warm,
        "events": done_events,
        "processes": procs,
        "idle_before_and_after": growth,
        "max_rss_mib_per_min": max((p["rss_mib_per_min"] or 0 for p in procs), default=None),
        "max_fds_per_min": max((p["fds_per_min"] or 0 for p in procs), default=None),
        "stop_s": _r(stop_s, 1),
        "leftover_processes": killed,
        "leftover_paths": left_paths,
        "ok": ok,
    }


def machine() -> dict[str, Any]:
    from tidal.kernels.select import cpu_description

    return {
        "cpu": cpu_description()["model"],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--event-every-s", type=float, default=None,
                   help="a scale cycle or a rank kill this often (default: 150 s, or a third "
                        "of a run under 7.5 minutes)")  # fmt: skip
    p.add_argument("--stall-s", type=float, default=15.0, help="a stalled client's silence")
    p.add_argument("--sample-s", type=float, default=5.0, help="process sampling period")
    p.add_argument("--warm-fraction", type=float, default=0.2,
                   help="slopes leave out this part of the run (warm-up)")  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for the server (repeat)")  # fmt: skip
    opts = p.parse_args(argv)
    if opts.event_every_s is None:
        opts.event_every_s = min(150.0, opts.duration_s / 3)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    result = asyncio.run(run(opts))
    print(json.dumps(result, indent=1), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
