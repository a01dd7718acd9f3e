"""A running deployment's secrets stay where they are needed: ``launch`` with the API key
and the DP control-plane key in files (and other values of both in the environment it
was started with) shows no key in any process's command line, and no process it started
(the engines' zygote and engines, the DP coordinator, the chat-template sandbox)
has either key in its environment."""

from __future__ import annotations

import httpx
import psutil

from tests.e2e.server_utils import RemoteServer

FILE_API_KEY = "file-api-key-7f3a9c1e5b2d4f60"
FILE_DP_KEY = "file-dp-auth-key-c4e1a8b7d2f95e36"
ENV_API_KEY = "env-api-key-91b2c3d4e5f6a7b8"
ENV_DP_KEY = "env-dp-auth-key-0a1b2c3d4e5f6789"
SECRETS = (FILE_API_KEY, FILE_DP_KEY, ENV_API_KEY, ENV_DP_KEY)
SECRET_VARS = ("TIDAL_API_KEY", "TIDAL_DP_AUTH_KEY")
# Renders in the sandbox worker, which is started by the first request that sends one.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _secret(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_keys_in_files_reach_no_command_line_and_no_child_environment(qwen3_ckpt, tmp_path):
    srv = RemoteServer(
        ["--model", qwen3_ckpt, "--dp", "2", "--log-level", "warning"]
        + ["--trust-request-chat-template"]
        + ["--api-key-file", _secret(tmp_path, "api", FILE_API_KEY)]
        + ["--data-parallel-auth-key-file", _secret(tmp_path, "dp", FILE_DP_KEY)],
        env={"TIDAL_API_KEY": ENV_API_KEY, "TIDAL_DP_AUTH_KEY": ENV_DP_KEY},
        headers={"Authorization": f"Bearer {FILE_API_KEY}"},
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert c.post("/v1/chat/completions", json=chat).status_code == 401  # no key
            env_key = {"Authorization": f"Bearer {ENV_API_KEY}"}
            assert c.get("/v1/models", headers=env_key).status_code == 401  # the file's wins
            r = c.post(
                "/v1/chat/completions",
                json={**chat, "chat_template": TEMPLATE},
                headers={"Authorization": f"Bearer {FILE_API_KEY}"},
            )
            assert r.status_code == 200, r.text
        children = srv.descendants()
        cmdlines = {p.pid: " ".join(p.cmdline()) for p in [psutil.Process(srv.proc.pid), *children]}
        # Every kind of child is there to be looked at.
        kinds = ("EngineCore", "DPCoordinator", "tidal.frontend.template_sandbox")
        names = " ".join(p.name() for p in children) + " ".join(cmdlines.values())
        for kind in kinds:
            assert kind in names, names
        assert len(children) >= 4, cmdlines  # 2 engines, the coordinator, the sandbox
        for pid, cmdline in cmdlines.items():
            for secret in SECRETS:
                assert secret not in cmdline, f"pid {pid}: {cmdline}"
        for p in children:
            env = p.environ()
            for var in SECRET_VARS:
                assert var not in env, f"{p.name()} ({p.pid}) has {var}"
            for secret in SECRETS:
                assert all(secret not in v for v in env.values()), f"{p.name()} ({p.pid})"
    finally:
        srv.stop()
    assert srv.leftover_processes() == []
