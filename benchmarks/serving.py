"""Online serving benchmark: bounded concurrent streaming load on an OpenAI-compatible server,
Tidal's and its peer's in the same run.

Sends ``--num-requests`` streaming ``/v1/completions`` requests, at most ``--concurrency``
at a time, each with a random token-id prompt of ``--prompt-len`` tokens and
``ignore_eos`` so every request generates exactly ``--max-tokens`` tokens. Measures
throughput (req/s, output tok/s), TTFT and TPOT p50/p90/p99, e2e p50 (ms).

    python benchmarks/serving.py --launch --num-requests 32 --concurrency 8
    python benchmarks/serving.py --launch --launch-args "--dp 2 --ep" --peer-ref main
    python benchmarks/serving.py --launch --vllm-python ~/.cache/tidal-peers/vllm/bin/python
    python benchmarks/serving.py --url http://127.0.0.1:8000      # one running server, no peer

``--launch`` starts this tree's server (``python -m tidal.launch.cli serve``) and the peer
one after the other on the same model (``--model``, default the embedded one), each on a
free port in its own process group, waits for ``/health``, sends the same load, and stops
the whole group. The peer is vLLM's OpenAI server when ``--vllm-python`` names a vLLM venv
(``benchmarks/peers/README.md``; the settings of ``env_vllm.sh``), else Tidal at
``--peer-ref`` (default ``HEAD~1``: the previous commit), extracted with ``git archive``
into a temporary directory (the built C++ kernels copied over when ``tidal/kernels/csrc``
is the same at both commits, else built there) and removed afterwards. ``--rounds``
repeats the pair, alternating which runs first; the median run of each is reported.
Prints one JSON line: the case, ``tidal``, ``peer`` (null with ``--url``) and the
``tidal_over_peer`` ratios.

Both servers serve in one dtype, ``--dtype`` (default: the checkpoint's own), passed to
each: vLLM-CPU's ``auto`` serves a float32 checkpoint in bf16.

``--dp 1,2`` measures each data-parallel size in turn (Tidal's ``--dp N``, vLLM's
``--data-parallel-size N`` with its OpenMP threads bound one core group per rank), one
JSON line per size. ``--client aiperf`` sends the load with NVIDIA's aiperf instead of the
built-in client (a third-party client, as users measure): completions, streaming,
the same counts and lengths, its TTFT and inter-token latency (``tpot_ms``) reported in
the same fields, plus their means. aiperf runs from a venv of its own (``--aiperf-venv``,
default ``$PEERS/aiperf``), made with ``pip install aiperf`` when missing, so its
dependencies never move Tidal's. The run also records the CPU model and the load average.
The issue's online comparison, one command:

    python benchmarks/serving.py --launch --client aiperf --dp 1,2 \\
        --vllm-python ~/.cache/tidal-peers/vllm/bin/python \\
        --model ~/.cache/tidal-peers/tiny-qwen3-moe --concurrency 16 --num-requests 96 \\
        --prompt-len 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from kmp_registrations import registrations, remove_dead  # noqa: E402 - a sibling module


@dataclass
class Result:
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, model: str | None
) -> Result:
    """One streaming completion; TTFT is the first chunk carrying text or a token."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    start = time.perf_counter()
    ttft, chunks, usage_tokens = None, 0, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Result(
                    False, time.perf_counter() - start, error=f"{resp.status_code} {text[:200]}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return Result(False, time.perf_counter() - start, error=str(obj["error"]))
                if obj.get("usage"):
                    usage_tokens = obj["usage"]["completion_tokens"]
                if obj.get("choices"):
                    chunks += 1
                    if ttft is None and obj["choices"][0].get("text"):
                        ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        return Result(False, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    # Without usage (a server that ignores stream_options) chunks approximate tokens.
    return Result(True, e2e, ttft, usage_tokens if usage_tokens is not None else chunks)


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    out = {}
    for q in qs:
        v = _percentile(values, q)
        out[f"p{q}"] = None if v is None else round(v * 1000.0, 3)
    return out


def summarize(results: list[Result], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": round(duration_s, 3),
        "req_per_s": round(len(ok) / duration_s, 3) if duration_s > 0 else None,
        "output_tok_per_s": round(out_tokens / duration_s, 3) if duration_s > 0 else None,
        "output_tokens": out_tokens,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms_p50": _ms([r.e2e_s for r in ok], (50,))["p50"],
    }


async def run_benchmark(
    url: str,
    *,
    num_requests: int,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    api_key: str | None = None,
    model: str | None = None,
    token_id_range: int = 100,
    seed: int = 0,
    warmup: int = 1,
    timeout_s: float = 600.0,
) -> dict:
    """Run the load and return the summary (without the argument echo)."""
    rng = random.Random(seed)
    # Distinct random prompts, so prefix caching does not make the run trivial.
    prompts = [
        [rng.randrange(1, token_id_range) for _ in range(prompt_len)] for _ in range(num_requests)
    ]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        headers=_headers(api_key), timeout=timeout_s, limits=limits
    ) as client:
        for _ in range(warmup):
            await one_request(client, url, prompts[0], min(max_tokens, 4), model)
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p: list[int]) -> Result:
            async with sem:
                return await one_request(client, url, p, max_tokens, model)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(list(results), duration)


# ---- --launch ----------------------------------------------------------------------------


def _wait_healthy(url: str, proc: subprocess.Popen, api_key: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        with contextlib.suppress(httpx.HTTPError):
            if (
                httpx.get(f"{url}/health", headers=_headers(api_key), timeout=2.0).status_code
                == 200
            ):
                return
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (engines included), SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children may outlive the leader: kill the group regardless.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def launched_server(
    cmd: list[str],
    host: str,
    api_key: str | None,
    timeout_s: float,
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Run ``cmd`` + ``--host HOST --port P`` (P free) until the block ends; its output goes
    to stderr (stdout carries the JSON lines)."""
    from tidal.distributed.ports import get_open_port

    port = get_open_port(host)
    shm_before = registrations()
    # A private TMPDIR, removed afterwards: vLLM's server puts its ipc:// sockets there
    # (/tmp/<uuid>) and a server stopped by a signal leaves them behind.
    tmp = tempfile.mkdtemp(prefix="serving-peer-")
    proc = subprocess.Popen(
        [*cmd, "--host", host, "--port", str(port)],
        start_new_session=True,
        cwd=cwd,
        env={**(os.environ if env is None else env), "TMPDIR": tmp},
        stdout=sys.stderr,
    )
    try:
        url = f"http://{host}:{port}"
        _wait_healthy(url, proc, api_key, timeout_s)
        yield url
    finally:
        _stop(proc)
        remove_dead(registrations() - shm_before, wait_s=10.0)  # the group was SIGKILLed
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a checkpoint folder's config.json names (``torch_dtype`` or ``dtype``),
    else float32 (transformers' default); None for a model that is not a local folder (a
    hub id: then each server keeps its own default, and the JSON says so). Both servers
    get it explicitly: vLLM-CPU's ``auto`` serves a float32 checkpoint in bf16, Tidal's in
    float32, so without it they serve different weights (at 256 streams that alone read
    as Tidal 0.87x vLLM; in one dtype, 1.25x)."""
    if not os.path.isdir(model):
        return None
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "float32"
    named = config.get("torch_dtype") or config.get("dtype")
    return named if isinstance(named, str) else "float32"


def _dtype_args(dtype: str | None) -> list[str]:
    return [] if dtype is None else ["--dtype", dtype]


def tidal_command(model: str, launch_args: list[str], api_key: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "tidal.launch.cli", "serve", "--model", model]
    if api_key:
        cmd += ["--api-key", api_key]
    return [*cmd, "--log-level", "warning", *launch_args]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def previous_commit(ref: str) -> Iterator[Path]:
    """This repository's files at ``ref`` (``git archive``: no checkout or worktree is
    registered) in a temporary directory, with its C++ kernels, removed afterwards."""
    tree = Path(tempfile.mkdtemp(prefix="tidal-peer-"))
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        # Both extensions: the kernels' and the shm queue's (without it the peer's queue
        # would fall back to its slower pure-Python atomics).
        built = sorted(REPO.glob("tidal/kernels/*.so")) + sorted(REPO.glob("tidal/distributed/*.so"))
        same_kernels = subprocess.run(
            ["git", "diff", "--quiet", ref, "--", "tidal/kernels/csrc", "tidal/distributed/csrc", "setup.py"],
            cwd=REPO,
        )
        if built and same_kernels.returncode == 0:
            for so in built:
                shutil.copy2(so, tree / so.relative_to(REPO))
        else:  # the kernels differ (or none is built here): build the peer's own
            # Its output to stderr: stdout is the JSON a caller reads.
            subprocess.run(
                [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                cwd=tree, check=True, stdout=sys.stderr,
            )  # fmt: skip
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


@contextlib.contextmanager
def peer_server(args: argparse.Namespace, model: str, dp: int = 1) -> Iterator[tuple[dict, Any]]:
    """(what the peer is, a ``launch()`` context manager that serves it) at ``dp`` ranks."""
    if args.vllm_python:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd += _dtype_args(args.dtype)
        if dp > 1:
            cmd += ["--data-parallel-size", str(dp)]
        peers = Path(os.environ.get("PEERS", Path.home() / ".cache" / "tidal-peers"))
        script = f"export PEERS={peers}; . {HERE / 'peers' / 'env_vllm.sh'}; env -0"
        raw = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
        env = dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and os.path.exists(p)]
        env["LD_PRELOAD"] = ":".join(preload)  # a missing tcmalloc is optional
        if dp > 1:  # each local DP rank binds its own group of cores ("0|1" on 2 cores)
            env["VLLM_CPU_OMP_THREADS_BIND"] = _core_groups(dp)
        info = {"name": "vllm", "python": args.vllm_python}
        yield info, lambda: launched_server(cmd, HOST, None, args.launch_timeout, env=env)
        return
    here = args.peer_ref == "."  # this tree, other flags: an A/B of --peer-launch-args
    sha = _git("rev-parse", "--short", "HEAD" if here else args.peer_ref)
    peer_args = args.launch_args if args.peer_launch_args is None else args.peer_launch_args
    with contextlib.nullcontext(REPO) if here else previous_commit(args.peer_ref) as tree:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        peer_flags = [*shlex.split(peer_args), *_dp_args(dp), *_dtype_args(args.dtype)]
        cmd = tidal_command(model, peer_flags, args.api_key)
        info = {"name": "tidal", "ref": args.peer_ref, "commit": sha, "launch_args": peer_args}
        yield (
            info,
            lambda: launched_server(
                cmd, HOST, args.api_key, args.launch_timeout, cwd=str(tree), env=env
            ),
        )


def _dp_args(dp: int) -> list[str]:
    return ["--dp", str(dp)] if dp > 1 else []


def _core_groups(groups: int) -> str:
    """This process's usable cores cut into ``groups`` contiguous lists, "|"-separated."""
    cores = sorted(os.sched_getaffinity(0))
    size = max(1, len(cores) // groups)
    return "|".join(
        ",".join(map(str, cores[i * size : (i + 1) * size] or cores[-1:])) for i in range(groups)
    )


# ---- --client aiperf ---------------------------------------------------------------------


def ensure_aiperf(venv: Path) -> Path:
    """``venv/bin/aiperf``, installing aiperf into the venv ``venv`` when it is missing."""
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        print(f"serving: installing aiperf into {venv}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf"], check=True)
    return exe


def run_aiperf(aiperf: Path, url: str, model: str, args: argparse.Namespace) -> dict:
    """One aiperf profile against ``url`` (completions, streaming, the case's counts and
    lengths, ``ignore_eos``), summarised in ``summarize``'s fields; aiperf's inter-token
    latency is ``tpot_ms``."""
    out = Path(tempfile.mkdtemp(prefix="serving-aiperf-"))
    try:
        cmd = [
            str(aiperf), "profile", "--model", model, "--tokenizer", model, "--url", url,
            "--endpoint-type", "completions", "--streaming",
            "--concurrency", str(args.concurrency), "--request-count", str(args.num_requests),
            "--warmup-request-count", str(max(args.warmup, args.concurrency)),
            "--prompt-input-tokens-mean", str(args.prompt_len),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.max_tokens),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--random-seed", str(args.seed), "--output-artifact-dir", str(out),
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        ]  # fmt: skip
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        # TMPDIR inside ``out``: aiperf leaves its mmap folders (aiperf_mmap_*) there.
        env = {**os.environ, "TMPDIR": str(out)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        export = out / "profile_export_aiperf.json"
        if proc.returncode != 0 or not export.exists():
            raise RuntimeError(f"aiperf failed ({proc.returncode}): {proc.stdout[-2000:]}")
        doc = json.loads(export.read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)

    def stats(name: str, keys: tuple[str, ...] = ("avg", "p50", "p90", "p99")) -> dict:
        got = doc.get(name) or {}
        return {k: None if got.get(k) is None else round(float(got[k]), 3) for k in keys}

    completed = int((doc.get("request_count") or {}).get("avg") or 0)
    errors = doc.get("error_summary") or []
    return {
        "client": "aiperf",
        "completed": completed,
        "failed": max(0, args.num_requests - completed) + len(errors),
        "first_error": str(errors[0]) if errors else None,
        "duration_s": stats("benchmark_duration", ("avg",))["avg"],
        "req_per_s": stats("request_throughput", ("avg",))["avg"],
        "output_tok_per_s": stats("output_token_throughput", ("avg",))["avg"],
        "ttft_ms": stats("time_to_first_token"),
        "tpot_ms": stats("inter_token_latency"),
        # The whole request as its client waits for it, and how the tokens came: aiperf's
        # inter-token latency is (latency - TTFT) / (tokens - 1), so a server that sends
        # many tokens in one chunk (vLLM-CPU sends most 64-token answers in one) shows a
        # small one while its client waits longest for the first text.
        "request_latency_ms": stats("request_latency"),
        "tokens_per_chunk": _per(
            stats("output_sequence_length", ("avg",))["avg"],
            stats("http_req_chunks_received", ("avg",))["avg"],
        ),
    }


def _per(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _machine() -> dict:
    from tidal.kernels.select import cpu_description

    model = cpu_description()["model"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "load_avg": load}


def _median_summary(runs: list[dict]) -> dict:
    """The run with the median output throughput (its whole summary: one real run)."""
    ranked = sorted(runs, key=lambda s: s["output_tok_per_s"] or 0.0)
    return {**ranked[len(ranked) // 2], "rounds": len(runs)}


# A client's reads coalesce a fast server's one-token chunks (a Tidal server at 16 streams
# read as 1.4-1.6 tokens a chunk); a server that bundles answers reads as tens.
MAX_TOKENS_PER_CHUNK = 4.0


def _ratios(tidal: dict, peer: dict) -> dict:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out = {
        "output_tok_per_s": ratio(tidal["output_tok_per_s"], peer["output_tok_per_s"]),
        "ttft_p50": ratio(tidal["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]),
        "tpot_p50": ratio(tidal["tpot_ms"]["p50"], peer["tpot_ms"]["p50"]),
    }
    if "avg" in tidal["ttft_ms"] and "avg" in peer["ttft_ms"]:  # aiperf's means
        out["ttft_avg"] = ratio(tidal["ttft_ms"]["avg"], peer["ttft_ms"]["avg"])
        out["tpot_avg"] = ratio(tidal["tpot_ms"]["avg"], peer["tpot_ms"]["avg"])
    if "request_latency_ms" in tidal and "request_latency_ms" in peer:
        t, q = tidal["request_latency_ms"], peer["request_latency_ms"]
        out["request_latency_avg"] = ratio(t["avg"], q["avg"])
        out["request_latency_p50"] = ratio(t["p50"], q["p50"])
        # Inter-token latencies compare only where both streamed about a token a chunk.
        chunked = [s.get("tokens_per_chunk") for s in (tidal, peer)]
        out["tpot_comparable"] = all(c is not None and c <= MAX_TOKENS_PER_CHUNK for c in chunked)
    return out


# ---- main --------------------------------------------------------------------------------

HOST = "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--token-id-range", type=int, default=100, help="prompt ids in [1, N)")
    p.add_argument("--model", default=None, help="checkpoint (--launch: default the embedded one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--launch", action="store_true", help="start Tidal's server and the peer's")
    p.add_argument("--launch-args", default="", help="extra flags for the launched Tidal servers")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument(
        "--peer-ref", default="HEAD~1", help="git ref of the Tidal peer ('.': this tree)"
    )
    p.add_argument(
        "--peer-launch-args",
        default=None,
        help="the Tidal peer's flags (default: --launch-args), e.g. --peer-ref . "
        "--peer-launch-args '--cpu-affinity off' for an A/B of one flag",
    )
    p.add_argument("--vllm-python", default=None, help="python of a vLLM venv: vLLM is the peer")
    p.add_argument(
        "--dtype",
        default=None,
        help="--launch: the dtype both servers serve in, passed to each (default: a local "
        "checkpoint's own, float32 where config.json names none; a hub id: each server's own)",
    )
    p.add_argument("--rounds", type=int, default=1, help="runs of each server (--launch)")
    p.add_argument("--dp", default="1", help="--launch: data-parallel sizes, e.g. 1,2")
    p.add_argument("--client", choices=("builtin", "aiperf"), default="builtin")
    p.add_argument(
        "--aiperf-venv",
        type=Path,
        default=Path(os.environ.get("PEERS", Path.home() / ".cache" / "tidal-peers")) / "aiperf",
        help="venv of the aiperf client (--client aiperf; made when missing)",
    )
    args = p.parse_args(argv)
    if min(args.num_requests, args.concurrency, args.prompt_len, args.max_tokens) < 1:
        p.error("--num-requests, --concurrency, --prompt-len and --max-tokens must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        sizes = [int(d) for d in args.dp.split(",") if d.strip()]
    except ValueError:
        p.error(f"--dp: a comma-separated list of sizes, got {args.dp!r}")
    if not sizes or min(sizes) < 1:
        p.error("--dp: sizes must be >= 1")
    if args.client == "aiperf" and not args.launch and not args.model:
        p.error("--client aiperf: --model names the checkpoint (its tokenizer) to send")
    aiperf = ensure_aiperf(args.aiperf_venv) if args.client == "aiperf" else None

    def run(url: str, model: str | None) -> dict:
        if aiperf is not None:
            return run_aiperf(aiperf, url, model or args.model, args)
        return asyncio.run(
            run_benchmark(
                url,
                num_requests=args.num_requests,
                concurrency=args.concurrency,
                prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                api_key=args.api_key,
                model=model,
                token_id_range=args.token_id_range,
                seed=args.seed,
                warmup=args.warmup,
                timeout_s=args.timeout,
            )
        )

    case = {
        "benchmark": "serving",
        "client": args.client,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "machine": _machine(),
    }
    if not args.launch:
        url = args.url.rstrip("/")
        summary = run(url, args.model)
        line = {**case, "url": url, "tidal": summary, "peer": None, "tidal_over_peer": None}
        print(json.dumps(line), flush=True)
        return 0 if summary["failed"] == 0 else 1

    model = args.model or _default_model()
    args.dtype = args.dtype or checkpoint_dtype(model)
    case["dtype"] = args.dtype
    # This tree's server measures its CPU paths afresh (a kernel-choice cache private to
    # the run, removed with it): never a choice an earlier, noisier run left.
    kernel_cache = tempfile.mkdtemp(prefix="serving-kernels-")
    try:
        return _launch_sizes(args, case, sizes, model, run, kernel_cache)
    finally:
        shutil.rmtree(kernel_cache, ignore_errors=True)


def _launch_sizes(
    args: argparse.Namespace,
    case: dict,
    sizes: list[int],
    model: str,
    run: Any,
    kernel_cache: str,
) -> int:
    failed = 0
    peer_at: dict[int, dict] = {}  # the peer's median run per size, for a size it cannot serve
    for dp in sizes:
        launch_args = [*shlex.split(args.launch_args), *_dp_args(dp), *_dtype_args(args.dtype)]
        ours = [*launch_args, "--kernel-cache-dir", kernel_cache]
        tidal_cmd = tidal_command(model, ours, args.api_key)
        runs: dict[str, list[dict]] = {"tidal": [], "peer": []}
        peer_error = None
        with peer_server(args, model, dp) as (peer_info, launch_peer):
            servers = {
                "tidal": lambda cmd=tidal_cmd: launched_server(
                    cmd, HOST, args.api_key, args.launch_timeout
                ),
                "peer": launch_peer,
            }
            for r in range(args.rounds):
                for name in ("tidal", "peer") if r % 2 == 0 else ("peer", "tidal"):
                    if name == "peer" and peer_error is not None:
                        continue
                    try:
                        with servers[name]() as url:
                            # vLLM names the model by its path; Tidal takes either.
                            runs[name].append(run(url, model))
                    except RuntimeError as e:
                        if name == "tidal":
                            raise
                        # e.g. vLLM-CPU 0.32 cannot serve an MoE model at DP > 1 (its CPU
                        # communicator lacks all_gatherv): said, and compared below with
                        # the peer's nearest size that served.
                        peer_error = f"{e}"
        tidal = _median_summary(runs["tidal"])
        line = {**case, "model": model, "dp": dp, "launch_args": " ".join(launch_args)}
        line["tidal"] = tidal
        if runs["peer"]:
            peer = peer_at[dp] = {**peer_info, **_median_summary(runs["peer"])}
            line["peer"] = peer
        else:
            line["peer"] = {**peer_info, "dp": dp, "error": peer_error}
            nearest = max((d for d in peer_at if d < dp), default=None)
            peer = peer_at.get(nearest) if nearest is not None else None
            line["peer_compared"] = None if peer is None else {**peer, "dp": nearest}
        line["tidal_over_peer"] = None if peer is None else _ratios(tidal, peer)
        line["load_avg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        print(json.dumps(line), flush=True)
        failed += tidal["failed"] + (peer["failed"] if runs["peer"] else 0)
    return 0 if failed == 0 else 1


def _default_model() -> str:
    from tidal.models.tiny import default_model_path

    return default_model_path()


if __name__ == "__main__":
    sys.exit(main())
