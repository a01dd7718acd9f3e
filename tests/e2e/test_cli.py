"""The command line as the README shows it: ``launch`` with no ``--model`` (the embedded
default model), ``TIDAL_API_KEY`` as the default API key of ``launch`` and of ``tidal
scale``, and ``tidal generate``, which prints what the server generates for the same
prompt (greedy: the same model, the same tokens).

One server for the module; the default model is built into a private cache directory
(``XDG_CACHE_HOME``), removed afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server_utils import RemoteServer

pytestmark = pytest.mark.timeout(600)

API_KEY = "cli-e2e-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The tide comes in"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="module")
def server(cache_home: str) -> Iterator[RemoteServer]:
    # No --model and no --api-key: both come from their defaults.
    srv = RemoteServer(
        ["--log-level", "warning"],
        env={"TIDAL_API_KEY": API_KEY, "XDG_CACHE_HOME": cache_home},
        headers=AUTH,
    )
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.leftover_processes() == []


def _cli(*args: str, env: dict[str, str | None]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "tidal.launch.cli", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def test_launch_without_model_serves_the_embedded_default_model(server, cache_home):
    (card,) = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()["data"]
    assert card["id"].startswith(os.path.join(cache_home, "tidal", "default-qwen3-moe-"))
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_tidal_api_key_is_launchs_default_key(server):
    for path in ("/health", "/v1/models", "/stats", "/metrics"):
        assert httpx.get(server.url + path, timeout=60).status_code == 401, path
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.get(server.url + path, headers=wrong, timeout=60).status_code == 401, path
        assert httpx.get(server.url + path, headers=AUTH, timeout=60).status_code == 200, path


def test_tidal_api_key_is_tidal_scales_default_key(server):
    # Authorized, the request reaches the route, which refuses it: elastic EP is off.
    done = _cli("scale", "--to", "2", "--url", server.url, env={"TIDAL_API_KEY": API_KEY})
    assert done.returncode == 1 and "HTTP 400" in done.stderr, done.stderr
    assert "--enable-elastic-ep" in done.stderr
    done = _cli("scale", "--to", "2", "--url", server.url, env={"TIDAL_API_KEY": None})
    assert done.returncode == 1 and "HTTP 401" in done.stderr, done.stderr


def test_tidal_generate_prints_what_the_server_generates(server, cache_home):
    env = {"XDG_CACHE_HOME": cache_home}
    done = _cli("generate", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), env=env)
    assert done.returncode == 0, done.stderr
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    tokens = r.json()["usage"]["completion_tokens"]
    want = f"{PROMPT!r} -> {choice['text']!r} ({tokens} tokens, {choice['finish_reason']})"
    assert want in done.stdout.splitlines(), done.stdout


def test_tidal_generate_flag_errors_name_the_flag(cache_home):
    done = _cli("generate", "--max-num-seqs", "0", env={"XDG_CACHE_HOME": cache_home})
    assert done.returncode == 2 and "--max-num-seqs" in done.stderr, done.stderr
