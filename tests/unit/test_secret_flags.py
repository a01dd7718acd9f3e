"""Secrets on the command line and in the environment: ``--api-key-file`` and
``--data-parallel-auth-key-file`` read the keys from files (out of ``ps``), a bad file is
a CLI error naming the flag, and the environment a child process gets (engines, workers,
the coordinator, the chat-template sandbox) holds neither key. tests/e2e/test_secrets_cli.py
checks a running deployment's processes."""

from __future__ import annotations

import argparse
import os

import pytest

from tidal.frontend.template_sandbox import worker_env
from tidal.launch.api_key import resolve_api_key
from tidal.launch.args import build_engine_config
from tidal.launch.cli import main
from tidal.launch.spawn import make_parser
from tidal.utils.procs import _child_env

API_KEY = "file-api-key-0123456789abcdef"
DP_KEY = "file-dp-auth-key-0123456789abcdef"


def _secret(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = make_parser()
    return parser, parser.parse_args(argv)


def test_api_key_file_is_read_and_wins_over_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_API_KEY", "env-api-key-0123456789")
    parser, ns = _parse(["--api-key-file", _secret(tmp_path, "key", API_KEY + "\n")])
    assert resolve_api_key(parser, ns) == API_KEY


def test_dp_auth_key_file_is_read_into_the_config(tmp_path, monkeypatch, qwen3_ckpt):
    monkeypatch.setenv("TIDAL_DP_AUTH_KEY", "env-dp-auth-key-0123456789")
    path = _secret(tmp_path, "dp", DP_KEY + "\n")
    parser, ns = _parse(["--model", qwen3_ckpt, "--data-parallel-auth-key-file", path])
    assert build_engine_config(parser, ns).parallel.data_parallel_auth_key == DP_KEY


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--api-key-file", "{missing}"], "--api-key-file"),
        (["--api-key-file", "{empty}"], "--api-key-file"),
        (["--api-key", "k" * 20, "--api-key-file", "{good}"], "--api-key-file"),
        (["--data-parallel-auth-key-file", "{missing}"], "--data-parallel-auth-key-file"),
        (["--data-parallel-auth-key-file", "{empty}"], "--data-parallel-auth-key-file"),
        (
            ["--data-parallel-auth-key", "k" * 20, "--data-parallel-auth-key-file", "{good}"],
            "--data-parallel-auth-key-file",
        ),
    ],
)
def test_bad_key_files_are_cli_errors_naming_the_flag(tmp_path, capsys, qwen3_ckpt, args, flag):
    files = {
        "missing": str(tmp_path / "nope"),
        "empty": _secret(tmp_path, "empty", "\n"),
        "good": _secret(tmp_path, "good", API_KEY),
    }
    argv = ["serve", "--model", qwen3_ckpt, *(a.format(**files) for a in args)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}:" in err
    assert API_KEY not in err and "k" * 20 not in err  # an error never echoes a key


def test_help_documents_the_file_forms(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--api-key-file" in out and "--data-parallel-auth-key-file" in out


def test_tidal_scale_takes_the_api_key_file_too(tmp_path, capsys):
    path = _secret(tmp_path, "key", API_KEY)
    # No server answers at port 1: the flags were accepted, the request then fails.
    code = main(["scale", "--to", "2", "--url", "http://127.0.0.1:1", "--api-key-file", path])
    assert code != 2, capsys.readouterr().err


def test_children_get_no_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("TIDAL_API_KEY", API_KEY)
    monkeypatch.setenv("TIDAL_DP_AUTH_KEY", DP_KEY)
    monkeypatch.setenv("TIDAL_LOG_LEVEL", "INFO")
    for env in (_child_env(), _child_env({"OMP_NUM_THREADS": "1"}), worker_env(os.environ)):
        assert "TIDAL_API_KEY" not in env and "TIDAL_DP_AUTH_KEY" not in env
        assert env["TIDAL_LOG_LEVEL"] == "INFO"  # the rest is passed on
