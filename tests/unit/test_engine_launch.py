"""The engine launch message: what the launcher writes to an engine process's stdin must
rebuild exactly the config it was made from (msgspec; the transformers config as a dict,
read on the engine's side without transformers)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import msgspec
import pytest

from tidal.engine_core.entry import decode_engine_launch, encode_engine_launch
from tidal.launch.engine_args import EngineArgs
from tidal.models.config_wire import WireHFConfig
from tidal.models.registry import get_model_class


@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "mixtral_ckpt"])
def test_launch_round_trip(ckpt: str, request: pytest.FixtureRequest) -> None:
    args = EngineArgs(
        model=request.getfixturevalue(ckpt),
        data_parallel_size=2,
        data_parallel_master_port=29999,
        enable_expert_parallel=True,
        all2all_backend="all2all",
        num_gpu_blocks_override=77,
        max_num_seqs=5,
        dtype="float32",
        device="cpu",
    )
    config = args.create_engine_config().with_parallel(data_parallel_rank=1)
    data = encode_engine_launch(config, 1, "ipc:///tmp/x/handshake")
    msgspec.msgpack.decode(data)  # plain msgpack: nothing a peer must unpickle

    launch = decode_engine_launch(data)
    back, index, address = launch.config, launch.engine_id, launch.handshake_address
    assert (index, address) == (1, "ipc:///tmp/x/handshake")
    assert launch.launcher_pid == os.getpid()  # the engine watches who asked for it
    assert back == config  # every field but hf_config (compare=False)
    assert dataclasses.astuple(back.parallel) == dataclasses.astuple(config.parallel)
    assert back.model.generation_eos_token_ids == config.model.generation_eos_token_ids
    assert isinstance(back.model.generation_eos_token_ids, tuple)
    hf, hf_back = config.model.hf_config, back.model.hf_config
    assert isinstance(hf_back, WireHFConfig)
    assert hf_back.to_dict() == hf.to_dict()
    assert back.model.eos_token_ids == config.model.eos_token_ids
    # What the engine reads of it: the model's spec, and the hash a joining rank must match.
    model_class = get_model_class(config.model.architecture)
    assert model_class.spec_from_config(hf_back) == model_class.spec_from_config(hf)
    assert back.config_hash() == config.config_hash()
    assert hf_back.vocab_size == hf.vocab_size
    with pytest.raises(AttributeError):
        hf_back.no_such_field  # noqa: B018
    with pytest.raises(AttributeError):
        hf_back.vocab_size = 3


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_engine_processes_do_not_import_transformers() -> None:
    """An engine or TP worker process imports neither transformers nor the frontend's
    packages: each such import is seconds of a cold scale-up and megabytes of every rank."""
    code = (
        "import sys, tidal.engine_core.entry, tidal.executor.worker_proc, "
        "tidal.engine_core.zygote; "
        "print(sorted(m for m in ('transformers', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
