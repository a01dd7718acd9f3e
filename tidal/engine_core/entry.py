"""The engine process's entry point: ``python -m tidal.engine_core.entry EngineCore_DP<r>``.

Engines are started as a fresh interpreter running this module (``tidal.utils.procs``),
never with multiprocessing's spawn, which would re-run the user's ``__main__`` in every
engine. The launcher writes one ``EngineLaunch`` (msgspec msgpack) to the child's stdin.

The config is a tree of frozen dataclasses that msgspec encodes as they are, except
``ModelConfig.hf_config``, a transformers ``PretrainedConfig``: it travels as its
``to_dict()`` and is rebuilt by its own config class, which reproduces it exactly.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Any

import msgspec
from transformers import CONFIG_MAPPING, AutoConfig

from tidal.config import EngineConfig
from tidal.engine_core.dp_proc import DPEngineCoreProc
from tidal.engine_core.proc import EngineCoreProc, run_engine_core
from tidal.utils.forkserver import ForkedProcess, ForkServer
from tidal.utils.procs import ModuleProcess, read_child_launch

ENGINE_ENTRY_MODULE = "tidal.engine_core.entry"
ENGINE_ZYGOTE_MODULE = "tidal.engine_core.zygote"


class EngineLaunch(msgspec.Struct, frozen=True):
    config: EngineConfig  # with model.hf_config = None; see hf_config
    hf_config: dict[str, Any] | None
    engine_index: int
    handshake_address: str
    # The process that asked for this engine (the frontend, a headless host's launcher):
    # the engine leaves when it is gone. Not necessarily the parent (a warm launcher's
    # fork); 0: the parent.
    launcher_pid: int = 0


def encode_engine_launch(config: EngineConfig, engine_index: int, handshake_address: str) -> bytes:
    """The launch payload, asked for by this process (its launcher)."""
    hf = config.model.hf_config
    wire = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_config=None))
    return msgspec.msgpack.encode(
        EngineLaunch(
            wire,
            hf.to_dict() if hf is not None else None,
            engine_index,
            handshake_address,
            os.getpid(),
        )
    )


def decode_engine_launch(data: bytes) -> EngineLaunch:
    """The payload, with ``config.model.hf_config`` rebuilt."""
    launch = msgspec.msgpack.decode(data, type=EngineLaunch)
    config = launch.config
    model = dataclasses.replace(
        config.model, hf_config=_rebuild_hf_config(config, launch.hf_config)
    )
    return msgspec.structs.replace(launch, config=dataclasses.replace(config, model=model))


def _rebuild_hf_config(config: EngineConfig, hf: dict[str, Any] | None) -> Any:
    if hf is None:
        return None
    config_class = CONFIG_MAPPING.get(hf.get("model_type", ""))
    if config_class is None:
        # Not a transformers-native model type: read it the way the launcher did.
        return AutoConfig.from_pretrained(config.model.model)
    return config_class.from_dict(hf)


def engine_process_name(engine_index: int) -> str:
    return f"EngineCore_DP{engine_index}"


def start_engine_process(
    config: EngineConfig,
    engine_index: int,
    handshake_address: str,
    entry_module: str = ENGINE_ENTRY_MODULE,
) -> ModuleProcess:
    """Start rank ``engine_index``. ``entry_module`` is any module that reads an
    ``EngineLaunch`` from stdin like ``main`` below (tests may substitute one)."""
    return ModuleProcess(
        entry_module,
        engine_process_name(engine_index),
        encode_engine_launch(config, engine_index, handshake_address),
    )


def engine_proc_class(config: EngineConfig) -> type[EngineCoreProc]:
    """The DP busy loop (waves, dummy batches, coordinator, process groups) with more than
    one rank at launch or with elastic EP (its size may grow from one)."""
    return DPEngineCoreProc if config.parallel.is_data_parallel else EngineCoreProc


def run_launch(payload: bytes) -> None:
    """Run the engine an ``EngineLaunch`` payload describes (does not return)."""
    launch = decode_engine_launch(payload)
    config, engine_index = launch.config, launch.engine_index
    multiprocessing.current_process().name = engine_process_name(engine_index)
    run_engine_core(
        config,
        engine_index,
        launch.handshake_address,
        engine_proc_class(config),
        launcher_pid=launch.launcher_pid or None,
    )


def start_engine_zygote() -> ForkServer:
    """A warm launcher for engines (``tidal.engine_core.zygote``): ``spawn_engine`` with
    it starts an engine without the seconds of imports of a fresh interpreter."""
    return ForkServer(ENGINE_ZYGOTE_MODULE, "EngineZygote")


def spawn_engine(
    zygote: ForkServer,
    config: EngineConfig,
    engine_index: int,
    handshake_address: str,
    timeout_s: float = 10.0,
) -> ForkedProcess:
    return zygote.spawn(
        engine_process_name(engine_index),
        encode_engine_launch(config, engine_index, handshake_address),
        timeout_s,
    )


def main() -> None:
    _, payload = read_child_launch()
    run_launch(payload)


if __name__ == "__main__":
    main()
