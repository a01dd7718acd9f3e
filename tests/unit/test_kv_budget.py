"""The KV budget rules (tidal/executor/kv_budget.py): precedence, the CPU fraction shared
by the host's workers, vLLM's VLLM_CPU_KVCACHE_SPACE, the GPU utilization."""

from __future__ import annotations

import pytest

from tidal.config import CacheConfig
from tidal.executor.kv_budget import (
    DEFAULT_CPU_KV_BYTES,
    BudgetSource,
    DeviceMemory,
    GiB,
    HostMemory,
    kv_cache_budget,
)

HOST = HostMemory(available=64 * GiB, workers=4)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "3"}


def test_cpu_default_is_512_mib() -> None:
    b = kv_cache_budget(CacheConfig(), host=HOST, env={})
    assert (b.bytes, b.source) == (DEFAULT_CPU_KV_BYTES, BudgetSource.DEFAULT)


def test_cpu_fraction_is_shared_by_the_hosts_workers() -> None:
    b = kv_cache_budget(CacheConfig(kv_cache_memory_fraction=0.5), host=HOST, env={})
    assert (b.bytes, b.source) == (8 * GiB, BudgetSource.CPU_FRACTION)
    one = kv_cache_budget(
        CacheConfig(kv_cache_memory_fraction=0.25), host=HostMemory(10 * GiB, 1), env={}
    )
    assert one.bytes == int(2.5 * GiB)


def test_env_wins_over_fraction_and_explicit_bytes_win_over_all() -> None:
    frac = CacheConfig(kv_cache_memory_fraction=0.5)
    assert kv_cache_budget(frac, host=HOST, env=ENV) == kv_cache_budget(
        CacheConfig(), host=HOST, env=ENV
    )
    b = kv_cache_budget(frac, host=HOST, env=ENV)
    assert (b.bytes, b.source) == (3 * GiB, BudgetSource.ENV)
    explicit = CacheConfig(kv_cache_memory_bytes=12345, kv_cache_memory_fraction=0.5)
    b = kv_cache_budget(explicit, host=HOST, env=ENV)
    assert (b.bytes, b.source) == (12345, BudgetSource.EXPLICIT)
    gpu = kv_cache_budget(explicit, device=DeviceMemory(80 * GiB, 10 * GiB), env=ENV)
    assert (gpu.bytes, gpu.source) == (12345, BudgetSource.EXPLICIT)


def test_env_fractional_gib_zero_means_unset_and_garbage_is_an_error() -> None:
    b = kv_cache_budget(CacheConfig(), env={"VLLM_CPU_KVCACHE_SPACE": "0.5"})
    assert b.bytes == GiB // 2
    b = kv_cache_budget(CacheConfig(), env={"VLLM_CPU_KVCACHE_SPACE": "0"})
    assert b.source is BudgetSource.DEFAULT
    for bad in ("lots", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_budget(CacheConfig(), env={"VLLM_CPU_KVCACHE_SPACE": bad})


def test_gpu_utilization_leaves_what_weights_took() -> None:
    dev = DeviceMemory(total=80 * GiB, used=20 * GiB)
    b = kv_cache_budget(CacheConfig(gpu_memory_utilization=0.5), device=dev, env=ENV)
    # The CPU env var does not size a GPU cache.
    assert (b.bytes, b.source) == (20 * GiB, BudgetSource.GPU_UTILIZATION)
    assert kv_cache_budget(CacheConfig(), device=dev).bytes == int(80 * GiB * 0.9) - 20 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization.*nothing is left"):
        kv_cache_budget(CacheConfig(gpu_memory_utilization=0.2), device=dev)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        kv_cache_budget(CacheConfig(kv_cache_memory_fraction=0.5), device=dev)


@pytest.mark.parametrize("field", ["kv_cache_memory_fraction", "gpu_memory_utilization"])
@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_fractions_are_range_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_gpu_budget_leaves_the_decode_graphs_pool() -> None:
    """The graphs' pool is captured after the cache is allocated: its estimate comes out
    of the utilization budget first, and an explicit budget is what it says."""
    cache = CacheConfig(gpu_memory_utilization=0.5)
    with_graphs = DeviceMemory(total=80 * GiB, used=20 * GiB, graphs=3 * GiB)
    assert kv_cache_budget(cache, device=with_graphs).bytes == 17 * GiB
    explicit = CacheConfig(kv_cache_memory_bytes=12345)
    assert kv_cache_budget(explicit, device=with_graphs).bytes == 12345
    with pytest.raises(ValueError, match="2.00 GiB kept for the decode graphs"):
        kv_cache_budget(cache, device=DeviceMemory(80 * GiB, 38 * GiB, graphs=2 * GiB))
