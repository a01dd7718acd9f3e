"""``--model ORG/NAME``: resolved from a Hugging Face cache laid out as the hub lays it out,
offline; a clear error naming the cache folder when it is not there."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tidal.models.hub import ModelNotFound, looks_like_repo_id, resolve_model_path

SHA = "0123456789abcdef0123456789abcdef01234567"


def _cached_repo(cache: Path, repo: str, files: dict[str, str], ref: str = "main") -> Path:
    """A snapshot in ``cache`` exactly where ``huggingface_hub`` keeps one."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / SHA
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / ref).write_text(SHA)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_folder_is_served_as_it_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_a_repo_id_resolves_to_its_cached_snapshot_offline(tmp_path: Path, offline: None) -> None:
    snap = _cached_repo(tmp_path, "acme/tiny-moe", {"config.json": "{}"})
    assert resolve_model_path("acme/tiny-moe", cache_dir=str(tmp_path)) == str(snap)
    # A commit id names the same snapshot; a tag the cache has a ref for, too.
    assert resolve_model_path("acme/tiny-moe", SHA, cache_dir=str(tmp_path)) == str(snap)


def test_a_tag_resolves_through_its_ref(tmp_path: Path, offline: None) -> None:
    snap = _cached_repo(tmp_path, "acme/tagged", {"config.json": "{}"}, ref="v1.0")
    assert resolve_model_path("acme/tagged", "v1.0", cache_dir=str(tmp_path)) == str(snap)
    with pytest.raises(ModelNotFound, match=r"'acme/tagged' \(revision 'main'\)"):
        resolve_model_path("acme/tagged", cache_dir=str(tmp_path))


def test_missing_offline_names_the_repo_and_the_cache_folder(tmp_path: Path, offline: None) -> None:
    with pytest.raises(ModelNotFound) as err:
        resolve_model_path("acme/absent", cache_dir=str(tmp_path))
    msg = str(err.value)
    assert "'acme/absent'" in msg and str(tmp_path) in msg and "HF_HUB_OFFLINE" in msg


def test_missing_and_the_hub_unreachable_names_the_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with socket.socket() as s:  # a loopback port nobody listens on: the hub is unreachable
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ModelNotFound) as err:
        resolve_model_path("acme/absent", cache_dir=str(tmp_path), endpoint=endpoint)
    msg = str(err.value)
    assert "'acme/absent'" in msg and str(tmp_path) in msg and "downloading it failed" in msg


@pytest.mark.parametrize("model", ["not a repo", "a/b/c", "../x", "/no/such/folder", "org/"])
def test_neither_folder_nor_repo_id_is_refused(model: str, tmp_path: Path) -> None:
    assert not looks_like_repo_id(model)
    with pytest.raises(ModelNotFound, match="neither a directory nor a Hugging Face repo id"):
        resolve_model_path(model, cache_dir=str(tmp_path))


def test_engine_args_serve_a_cached_repo_id(qwen3_ckpt: str, tmp_path: Path, monkeypatch) -> None:
    """``--model ORG/NAME --revision R``: the engine config points at the cached snapshot,
    and so does the tokenizer."""
    import shutil

    from tidal.launch.engine_args import EngineArgs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    snap = _cached_repo(tmp_path, "acme/tiny-qwen3", {}, ref="v1")
    for name in os.listdir(qwen3_ckpt):
        shutil.copy2(os.path.join(qwen3_ckpt, name), snap / name)
    config = EngineArgs(model="acme/tiny-qwen3", revision="v1").create_engine_config()
    assert config.model.model == str(snap) and config.model.tokenizer == str(snap)
    assert config.model.architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match=r"model: 'acme/tiny-qwen3' \(revision 'main'\)"):
        EngineArgs(model="acme/tiny-qwen3").create_engine_config()


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_cli_names_the_flag_and_the_cache_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.launch.cli", "serve", "--model", "acme/absent"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--model" in proc.stderr and str(tmp_path) in proc.stderr
