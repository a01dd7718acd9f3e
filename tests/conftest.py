"""Shared fixtures: tiny random checkpoints, built once per session into a temp dir.

Kept import-light on purpose: importing transformers' model classes pulls in
``torch._dynamo``, which imports triton in compiled mode; tests/kernels/conftest.py must
be able to switch triton to its interpreter first. So everything heavy is imported inside
the fixtures.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

# Everything Tidal caches under $XDG_CACHE_HOME (the measured CPU kernel choices, the
# embedded default model) goes to a folder of this session's, removed at its end: tests
# neither read a user's cached choices nor leave theirs behind. Engine processes inherit it.
# Made in pytest_configure, not at import: a run refused for its arguments imports this
# file but never configures, and so leaves no folder behind.
_cache_home: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _cache_home
    _cache_home = tempfile.mkdtemp(prefix="tidal-test-cache-")
    os.environ["XDG_CACHE_HOME"] = _cache_home
    # Each CPU worker's KV cache: 128 MiB, not the 512 MiB default (vLLM's variable, in
    # GiB; engines inherit it). A cache is faulted in when it is made, which on a 2-core
    # VM cost 2-4 CPU-s of a dp 2 server start's 9-11; the tiny checkpoints need a
    # fraction of 128 MiB. Tests of the default remove it (RemoteServer's env=None).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.125")
    # Every engine, worker, coordinator and launcher process a test starts imports about
    # 110 tidal modules. Where PYTHONDONTWRITEBYTECODE is set (this CI's machines) an
    # editable install has no bytecode, and each process would compile them all again:
    # 0.1-0.2 CPU-s a process, hundreds of processes a run. Compiled once here (into the
    # gitignored __pycache__ folders), as an install from a wheel would have them.
    spec = importlib.util.find_spec("tidal")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            compileall.compile_dir(folder, quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    from tests.background import start_selected

    start_selected(session)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.background import stop_all

    stop_all(config)
    if _cache_home is not None:
        shutil.rmtree(_cache_home, ignore_errors=True)


# Folder -> the markers its tests carry (pyproject.toml lists them); tests/unit and
# tests/kernels are the fast tier (``-m "not slow"``).
_FOLDER_MARKS = {
    "distributed": ("slow", "distributed"),
    "e2e": ("slow",),
    "ray": ("slow", "ray"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), tests_dir)
        for mark in _FOLDER_MARKS.get(rel.split(os.sep)[0], ()):
            item.add_marker(mark)


# Small enough that a model builds in well under a second and a forward is milliseconds.
TINY_KWARGS = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_experts": 8,
    "top_k": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
# Context of ``qwen3_long_ckpt``: decoding this many tokens takes minutes on a CPU, and
# still many seconds on a GPU.
LONG_CONTEXT = 131072


@pytest.fixture(scope="session")
def tiny_ckpt_root() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tidal-tiny-") as root:
        yield root


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_root: str) -> Callable[[str], str]:
    """``model_type`` (a registry entry, tidal/models/registry.py) -> its tiny checkpoint,
    built on first use: ``TINY_KWARGS`` (hidden 64, 2 layers, 8 experts top-2, vocab 512)
    plus the entry's ``test_config``, which turns on the architecture's switches."""
    built: dict[str, str] = {}

    def get(model_type: str) -> str:
        if model_type not in built:
            from tidal.models.registry import entry_for_model_type
            from tidal.models.tiny import make_tiny_checkpoint

            entry = entry_for_model_type(model_type)
            built[model_type] = make_tiny_checkpoint(
                os.path.join(tiny_ckpt_root, model_type), model_type,
                **TINY_KWARGS, **entry.test_config,
            )  # fmt: skip
        return built[model_type]

    return get


@pytest.fixture(scope="session")
def deepseek_fp8_ckpt(tiny_ckpt_root: str) -> str:
    """DeepSeek-V3 in its FP8 release's layout (``make_tiny_fp8_checkpoint``: hidden 256,
    expert intermediate 192, 128x128 blocks, the entry's test switches); layer 0's
    ``o_proj`` stays bf16, listed in ``modules_to_not_convert``."""
    from tidal.models.registry import entry_for_model_type
    from tidal.models.tiny import make_tiny_fp8_checkpoint

    path = os.path.join(tiny_ckpt_root, "deepseek_v3_fp8")
    if not os.path.isdir(path):
        make_tiny_fp8_checkpoint(
            path, "deepseek_v3", not_converted=("model.layers.0.self_attn.o_proj",),
            **entry_for_model_type("deepseek_v3").test_config,
        )  # fmt: skip
    return path


@pytest.fixture(scope="session")
def qwen3_ckpt(tiny_ckpt: Callable[[str], str]) -> str:
    """Qwen3-MoE: hidden 64, 2 layers, 8 experts top-2, norm_topk_prob, vocab 512."""
    return tiny_ckpt("qwen3_moe")


@pytest.fixture(scope="session")
def qwen3_long_ckpt(tiny_ckpt_root: str) -> str:
    """``qwen3_ckpt`` with a ``LONG_CONTEXT``-token context: a request with ``ignore_eos`` and
    ``max_tokens`` close to that is still running long after its first token, so a test
    can act on a running request (disconnect, kill the engine) without racing its end."""
    from tidal.models.tiny import make_tiny_checkpoint

    kwargs = {**TINY_KWARGS, "max_position_embeddings": LONG_CONTEXT}
    return make_tiny_checkpoint(
        os.path.join(tiny_ckpt_root, "qwen3_moe_long"), "qwen3_moe", **kwargs
    )


@pytest.fixture(scope="session")
def mixtral_ckpt(tiny_ckpt: Callable[[str], str]) -> str:
    """Mixtral: hidden 64, 2 layers, 8 experts top-2, vocab 512."""
    return tiny_ckpt("mixtral")
