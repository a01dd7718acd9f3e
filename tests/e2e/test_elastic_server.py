"""Elastic EP through the real server (``launch --enable-elastic-ep``) and ``tidal scale``.

One server (DP 2, EP, float32, an API key) under continuous streaming load: the CLI
scales it 2 -> 3 -> 1 while six clients stream /v1/completions back to back, and a request
pinned to the rank that leaves must migrate. Every stream answers 200 and ends with the
tokens and the text it had before scaling (greedy); the routes' refusals (400 for a size
the model cannot serve, 409 while an operation runs), /is_scaling_elastic_ep, /stats
``scaling`` and the ``tidal:scale_*`` metrics report what happened; nothing is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.e2e.server_utils import RemoteServer, Streamed, StreamingLoad, stream_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

API_KEY = "elastic-e2e-api-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 48
PROMPTS = [
    "The tide comes in",
    "Experts route tokens",
    "A ship sails at dawn",
    "Moons pull on the sea",
    "Seven ranks, one model",
    "Waves break on the shore",
]
# Pinned to the rank that leaves in the scale-down: still streaming when that rank goes,
# so the operation has a request to migrate.
LONG_PROMPT = "The long request that must migrate"
LONG_TOKENS = 320


class KeyedServer(RemoteServer):
    """``RemoteServer`` started with ``--api-key``: its readiness probe sends the key
    (every route but the dashboard page needs it)."""

    def __init__(self, args: list[str]) -> None:
        super().__init__([*args, "--api-key", API_KEY])

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s

        def exited() -> bool:
            return self.proc.poll() is not None

        if not wait_until(lambda: self._serving.is_set() or exited(), timeout_s):
            raise TimeoutError(f"server did not start in {timeout_s} s:\n{self.output}")

        def healthy() -> bool:
            if exited():
                return True  # reported below
            try:
                return httpx.get(f"{self.url}/health", headers=AUTH, timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        if self.url and not wait_until(healthy, max(deadline - time.monotonic(), 1.0)):
            raise TimeoutError(f"server did not become healthy in {timeout_s} s:\n{self.output}")
        if not self.url or exited():
            self.proc.wait(10)
            self._reader.join(10)
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")


def _scale_cmd(url: str, size: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.launch.cli",
        "scale",
        "--to",
        str(size),
        "--url",
        url,
        "--api-key",
        API_KEY,
    ]


def _record(proc_out: str, err: str, code: int, srv: RemoteServer) -> dict:
    assert code == 0, f"tidal scale exited {code}: {err}\n{proc_out}\n--- server:\n{srv.output}"
    return json.loads(proc_out)


def _is_scaling(client: httpx.Client, method: str = "GET") -> bool:
    r = client.request(method, "/is_scaling_elastic_ep")
    assert r.status_code == 200, r.text
    return r.json()["is_scaling_elastic_ep"]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


def test_scale_server_under_streaming_load(qwen3_ckpt):
    srv = KeyedServer(
        [
            "--model",
            qwen3_ckpt,
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--enable-elastic-ep",
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ]
    )
    seen: dict[int, psutil.Process] = {p.pid: p for p in srv.children}
    load: StreamingLoad | None = None
    try:
        client = httpx.Client(base_url=srv.url, headers=AUTH, timeout=120)
        assert httpx.get(srv.url + "/is_scaling_elastic_ep").status_code == 401  # keyed

        # Sizes the model cannot serve: 400 naming the field, nothing recorded.
        err = _error(client.post("/scale_elastic_ep", json={"new_data_parallel_size": 0}), 400)
        assert "new_data_parallel_size" in err["message"], err
        err = _error(client.post("/scale_elastic_ep", json={"new_data_parallel_size": 9}), 400)
        assert "new_data_parallel_size" in err["message"], err
        assert "number of experts (8)" in err["message"] and "maximum is 8" in err["message"]
        assert not _is_scaling(client)

        # References: every prompt before any scaling (concurrently, as served later).
        refs: dict[int, Streamed] = {}

        def reference(i: int) -> None:
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=300) as c:
                if i < len(PROMPTS):
                    refs[i] = stream_completion(c, PROMPTS[i], MAX_TOKENS)
                else:
                    refs[i] = stream_completion(c, LONG_PROMPT, LONG_TOKENS)

        threads = [threading.Thread(target=reference, args=(i,)) for i in range(len(PROMPTS) + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(refs) == len(PROMPTS) + 1, "a reference request failed (see above)"
        for i, ref in refs.items():
            want = LONG_TOKENS if i == len(PROMPTS) else MAX_TOKENS
            assert (ref.completion_tokens, ref.finish_reason) == (want, "length"), ref
        stats = client.get("/stats").json()
        assert [r["engine_id"] for r in stats["ranks"]] == [0, 1] and stats["epoch"] == 0

        load = StreamingLoad(srv.url, PROMPTS, MAX_TOKENS, AUTH, timeout_s=120)
        assert wait_until(lambda: load.served() > 20 or bool(load.errors), 120), "no load"

        # 2 -> 3 through the CLI; a second operation meanwhile is refused with 409.
        cli = subprocess.Popen(
            _scale_cmd(srv.url, 3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert wait_until(lambda: cli.poll() is not None or _is_scaling(client), 120)
            assert cli.poll() is None, "the operation ended before /is_scaling_elastic_ep said so"
            r = client.post(
                "/scale_elastic_ep", json={"new_data_parallel_size": 2, "operation_id": "second"}
            )
            err = _error(r, 409)
            assert err["code"] == "scaling_in_progress", err
            running = r.json()["operation"]
            assert (running["from_size"], running["to_size"]) == (2, 3), running
            out, cli_err = cli.communicate(timeout=300)
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait(10)
        up = _record(out, cli_err, cli.returncode, srv)
        assert (up["result"], up["from_size"], up["to_size"]) == ("succeeded", 2, 3), up
        assert up["joining"] == [2] and up["leaving"] == [] and up["to_epoch"] == 1, up
        assert not _is_scaling(client)
        stats = client.get("/stats").json()
        assert [r["engine_id"] for r in stats["ranks"]] == [0, 1, 2], stats["ranks"]
        assert stats["data_parallel_size"] == 3 and stats["epoch"] == 1
        seen.update((p.pid, p) for p in srv.descendants())
        assert wait_until(lambda: len(srv.engine_processes()) == 3, 60)
        served = load.served()
        assert wait_until(lambda: load.served() > served + 20 or bool(load.errors), 120)

        # 3 -> 1 with a stream pinned to rank 2 (which leaves): it migrates, unchanged.
        pinned: dict[str, object] = {}
        started = threading.Event()

        def run_pinned() -> None:
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=300) as c:
                try:
                    pinned["out"] = stream_completion(
                        c, LONG_PROMPT, LONG_TOKENS, started.set, data_parallel_rank=2
                    )
                except BaseException as e:  # noqa: BLE001 - reported below
                    pinned["error"] = f"{type(e).__name__}: {e}"
                    started.set()

        long_thread = threading.Thread(target=run_pinned, daemon=True)
        long_thread.start()
        assert started.wait(120), "the pinned request never streamed"
        assert "error" not in pinned, pinned
        done = subprocess.run(_scale_cmd(srv.url, 1), capture_output=True, text=True, timeout=300)
        down = _record(done.stdout, done.stderr, done.returncode, srv)
        assert (down["result"], down["from_size"], down["to_size"]) == ("succeeded", 3, 1), down
        assert down["leaving"] == [1, 2] and down["to_epoch"] == 2, down
        long_thread.join(300)
        assert "error" not in pinned and "out" in pinned, pinned
        assert pinned["out"] == refs[len(PROMPTS)], "the migrated request's output changed"
        assert down["requests_migrated"] >= 1, down
        served = load.served()
        assert wait_until(lambda: load.served() > served + 20 or bool(load.errors), 120)

        results = load.finish()
        assert load.errors == [], load.errors
        assert len(results) > len(PROMPTS), "too few streams completed"
        for i, out in results:
            assert out == refs[i], f"prompt {i} changed: {out} != {refs[i]}"

        # The state the routes report afterwards.
        assert not _is_scaling(client) and not _is_scaling(client, "POST")
        stats = client.get("/stats").json()
        assert [r["engine_id"] for r in stats["ranks"]] == [0], stats["ranks"]
        assert stats["data_parallel_size"] == 1 and stats["epoch"] == 2
        assert stats["scaling"]["is_scaling"] is False
        history = stats["scaling"]["history"]
        assert [(h["from_size"], h["to_size"], h["result"]) for h in history] == [
            (2, 3, "succeeded"),
            (3, 1, "succeeded"),
        ], history
        assert [h["operation_id"] for h in history] == [up["operation_id"], down["operation_id"]]
        assert wait_until(lambda: len(srv.engine_processes()) == 1, 60), srv.engine_processes()
        metrics = client.get("/metrics").text
        succeeded = 'tidal:scale_operations_total{result="succeeded",trigger="api"} 2.0'
        assert succeeded in metrics, metrics
        operations = [
            m for m in metrics.splitlines() if m.startswith("tidal:scale_operations_total")
        ]
        assert operations == [succeeded], operations
        assert "tidal:scale_in_progress 0.0" in metrics
        client.close()
    finally:
        if load is not None:
            load.stop.set()
        seen.update((p.pid, p) for p in srv.descendants())
        srv.children = list(seen.values())  # every process it ever had, joiners included
        srv.stop()
    assert srv.leftover_processes() == []
