"""The engine process's entry point: ``python -m tidal.engine_core.entry EngineCore_DP<r>``.

Engines are started as a fresh interpreter running this module (``tidal.utils.procs``),
never with multiprocessing's spawn, which would re-run the user's ``__main__`` in every
engine. The launcher writes one ``EngineLaunch`` (msgspec msgpack) to the child's stdin.

The config travels as ``tidal.models.config_wire`` encodes it (``hf_config`` as its dict).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import msgspec

from tidal.config import EngineConfig
from tidal.engine_core.dp_proc import DPEngineCoreProc
from tidal.engine_core.proc import EngineCoreProc, run_engine_core
from tidal.models.config_wire import join_hf_config, split_hf_config
from tidal.utils.cpu_threads import engine_process_env, usable_cores
from tidal.utils.forkserver import ForkedProcess, ForkServer
from tidal.utils.procs import ModuleProcess, read_child_launch

ENGINE_ENTRY_MODULE = "tidal.engine_core.entry"
ENGINE_ZYGOTE_MODULE = "tidal.engine_core.zygote"


class EngineLaunch(msgspec.Struct, frozen=True):
    config: EngineConfig  # with model.hf_config = None; see hf_config
    hf_config: dict[str, Any] | None
    engine_id: int
    handshake_address: str
    # The process that asked for this engine (the frontend, a headless host's launcher):
    # the engine leaves when it is gone. Not necessarily the parent (a warm launcher's
    # fork); 0: the parent.
    launcher_pid: int = 0


def encode_engine_launch(
    config: EngineConfig,
    engine_id: int,
    handshake_address: str,
    launcher_pid: int | None = None,
) -> bytes:
    """The launch payload, asked for by this process (its launcher), or by the process
    ``launcher_pid`` on the engine's host (a Ray actor that starts it for the frontend)."""
    wire, hf = split_hf_config(config)
    pid = os.getpid() if launcher_pid is None else launcher_pid
    return msgspec.msgpack.encode(EngineLaunch(wire, hf, engine_id, handshake_address, pid))


def decode_engine_launch(data: bytes) -> EngineLaunch:
    """The payload, with ``config.model.hf_config`` rebuilt."""
    launch = msgspec.msgpack.decode(data, type=EngineLaunch)
    return msgspec.structs.replace(launch, config=join_hf_config(launch.config, launch.hf_config))


def engine_process_name(engine_id: int) -> str:
    return f"EngineCore_DP{engine_id}"


def start_engine_process(
    config: EngineConfig,
    engine_id: int,
    handshake_address: str,
    entry_module: str = ENGINE_ENTRY_MODULE,
) -> ModuleProcess:
    """Start rank ``engine_id``. ``entry_module`` is any module that reads an
    ``EngineLaunch`` from stdin like ``main`` below (tests may substitute one)."""
    return ModuleProcess(
        entry_module,
        engine_process_name(engine_id),
        encode_engine_launch(config, engine_id, handshake_address),
        env=engine_env(config),
    )


def engine_env(config: EngineConfig) -> dict[str, str]:
    """What an engine process beside a frontend adds to its environment: how its OpenMP
    threads wait and how many there are (``tidal/utils/cpu_threads.py``), CPU ranks only.
    With TP the rank's worker processes inherit it, so the thread count is a worker's
    share: the cores over every worker on the host (the engine process itself then runs
    no model, only the scheduler and the step broadcast)."""
    if config.device != "cpu":
        return {}
    p = config.parallel
    local = p.data_parallel_size_local * p.tensor_parallel_size
    return engine_process_env(os.environ, cores=usable_cores(), local_ranks=local)


def engine_proc_class(config: EngineConfig) -> type[EngineCoreProc]:
    """The DP busy loop (waves, dummy batches, coordinator, process groups) with more than
    one rank at launch or with elastic EP (its size may grow from one)."""
    return DPEngineCoreProc if config.parallel.is_data_parallel else EngineCoreProc


def run_launch(payload: bytes) -> None:
    """Run the engine an ``EngineLaunch`` payload describes (does not return)."""
    launch = decode_engine_launch(payload)
    config, engine_id = launch.config, launch.engine_id
    multiprocessing.current_process().name = engine_process_name(engine_id)
    run_engine_core(
        config,
        engine_id,
        launch.handshake_address,
        engine_proc_class(config),
        launcher_pid=launch.launcher_pid or None,
    )


def start_engine_zygote(config: EngineConfig) -> ForkServer:
    """A warm launcher for engines (``tidal.engine_core.zygote``): ``spawn_engine`` with
    it starts an engine without the seconds of imports of a fresh interpreter. It loads
    the OpenMP runtime, so the engines' environment (``engine_env``) is set on it."""
    return ForkServer(ENGINE_ZYGOTE_MODULE, "EngineZygote", env=engine_env(config))


def spawn_engine(
    zygote: ForkServer,
    config: EngineConfig,
    engine_id: int,
    handshake_address: str,
    timeout_s: float = 10.0,
) -> ForkedProcess:
    return zygote.spawn(
        engine_process_name(engine_id),
        encode_engine_launch(config, engine_id, handshake_address),
        timeout_s,
    )


def main() -> None:
    _, payload = read_child_launch()
    run_launch(payload)


if __name__ == "__main__":
    main()
