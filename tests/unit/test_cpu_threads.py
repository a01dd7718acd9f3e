"""How an engine process's OpenMP threads wait and how many there are, by deployment shape
(tidal/utils/cpu_threads.py): the defaults fill what the operator left unset, and the
launcher hands them to CPU engine processes only."""

from __future__ import annotations

from tidal.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tidal.engine_core.entry import engine_env
from tidal.utils.cpu_threads import (
    ENGINE_VARS,
    POOL_SPIN_US,
    SPIN_COUNT,
    SPIN_POOL_ENV,
    engine_process_env,
    threads_per_rank,
)


def test_engine_beside_a_frontend_spins_briefly_then_sleeps():
    env = engine_process_env({}, cores=8, local_ranks=1)
    assert env == {
        "GOMP_SPINCOUNT": str(SPIN_COUNT),
        "KMP_BLOCKTIME": "0",
        SPIN_POOL_ENV: str(POOL_SPIN_US),  # the C++ kernels: their own pool, this window
        "OMP_NUM_THREADS": "8",
    }


def test_several_ranks_share_the_cores():
    assert engine_process_env({}, cores=8, local_ranks=2)["OMP_NUM_THREADS"] == "4"
    assert threads_per_rank(2, 4) == 1  # never zero
    # A pinned rank's TP workers: each runs its share of the rank's group of cores.
    assert threads_per_rank(4, 2) == 2 and threads_per_rank(1, 2) == 1
    assert threads_per_rank(16, 3) == 5 and threads_per_rank(8, 0) == 8  # no ranks: all


def test_an_operators_settings_win():
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env = engine_process_env({var: "x"}, cores=2, local_ranks=1)
        # one wait setting: theirs (and the kernels stay on their OpenMP)
        assert not {"GOMP_SPINCOUNT", "KMP_BLOCKTIME", SPIN_POOL_ENV} & set(env)
    assert (
        engine_process_env({SPIN_POOL_ENV: "50"}, cores=2, local_ranks=1).get(SPIN_POOL_ENV) is None
    )
    assert "OMP_NUM_THREADS" not in engine_process_env(
        {"OMP_NUM_THREADS": "1"}, cores=2, local_ranks=1
    )


def _config(device: str, local: int, tp: int = 1) -> EngineConfig:
    model = ModelConfig("m", "m", "float32", 64, 0, "Qwen3MoeForCausalLM", None)
    return EngineConfig(
        model, CacheConfig(), SchedulerConfig(), ParallelConfig(data_parallel_size=local,
        data_parallel_size_local=local, tensor_parallel_size=tp), device=device,
    )  # fmt: skip


def test_the_launcher_sets_it_for_cpu_engines_only(monkeypatch):
    for var in ENGINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("tidal.engine_core.entry.usable_cores", lambda: 4)
    assert engine_env(_config("cpu", 2))["OMP_NUM_THREADS"] == "2"
    assert engine_env(_config("cpu", 1))["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    assert engine_env(_config("cpu", 1))[SPIN_POOL_ENV] == str(POOL_SPIN_US)
    assert engine_env(_config("cuda", 1)) == {}
    # -tp 2: the rank's worker processes inherit it, each a worker's share of the cores.
    assert engine_env(_config("cpu", 2, tp=2))["OMP_NUM_THREADS"] == "1"
    assert engine_env(_config("cpu", 1, tp=2))["OMP_NUM_THREADS"] == "2"
