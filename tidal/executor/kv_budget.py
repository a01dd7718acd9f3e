"""How many bytes one worker gives its KV cache (docs/operations.md#kv-sizing).

Pure: the caller measures the host and the device, so every rule is unit-tested without
either. Precedence, first that applies: ``--num-kv-blocks`` (not bytes: the caller),
``--kv-cache-memory-bytes``, then on CPU ``VLLM_CPU_KVCACHE_SPACE`` (GiB, vLLM's) and
``--kv-cache-memory-fraction`` (of the host's available memory, shared by its workers),
on GPU ``--gpu-memory-utilization`` (of the device: weights, the decode graphs' memory
pool and the cache together); else the CPU default of 512 MiB.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from tidal.config import CacheConfig

CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
GiB = 1024**3


class BudgetSource(enum.StrEnum):
    EXPLICIT = "--kv-cache-memory-bytes"
    ENV = CPU_KVCACHE_SPACE_ENV
    CPU_FRACTION = "--kv-cache-memory-fraction"
    GPU_UTILIZATION = "--gpu-memory-utilization"
    DEFAULT = "default"


@dataclass(frozen=True)
class KVBudget:
    bytes: int  # for this worker's cache
    source: BudgetSource


@dataclass(frozen=True)
class HostMemory:
    """What the worker measured when it sized its cache."""

    available: int  # psutil.virtual_memory().available
    workers: int  # KV-holding processes on this host: local ranks x TP workers


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # the device's memory
    used: int  # taken when the cache is sized: weights, activations, other processes
    # Held back for the decode graphs' memory pool, captured after the cache is allocated
    # (estimated: tidal/executor/graphs.py graph_pool_estimate); 0 without graphs.
    graphs: int = 0


def _env_bytes(env: Mapping[str, str]) -> int | None:
    raw = env.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}: GiB >= 0 expected, got {raw!r}")
    # vLLM's 0 means "size it for me": the next rule decides.
    return int(gib * GiB) or None


def kv_cache_budget(
    cache: CacheConfig,
    *,
    host: HostMemory | None = None,
    device: DeviceMemory | None = None,
    env: Mapping[str, str] | None = None,
) -> KVBudget:
    """The KV budget of one worker: ``device`` given = a GPU worker, else a CPU one
    (``host`` needed only for ``--kv-cache-memory-fraction``). ValueError names the option
    when nothing is left for the cache."""
    if cache.kv_cache_memory_bytes is not None:
        return KVBudget(cache.kv_cache_memory_bytes, BudgetSource.EXPLICIT)
    if device is not None:
        if cache.kv_cache_memory_fraction is not None:
            raise ValueError(
                "kv_cache_memory_fraction: sizes a CPU cache; on GPU use "
                "gpu_memory_utilization (or kv_cache_memory_bytes)"
            )
        limit = int(device.total * cache.gpu_memory_utilization)
        free = limit - device.used - device.graphs
        if free <= 0:
            kept = device.graphs / GiB
            graphs = f" and {kept:.2f} GiB kept for the decode graphs" if device.graphs else ""
            raise ValueError(
                f"gpu_memory_utilization: {cache.gpu_memory_utilization} of "
                f"{device.total / GiB:.2f} GiB is {limit / GiB:.2f} GiB, and "
                f"{device.used / GiB:.2f} GiB are already in use (weights and activations)"
                f"{graphs}: nothing is left for the KV cache; raise it, set "
                "kv_cache_memory_bytes, or enforce_eager"
            )
        return KVBudget(free, BudgetSource.GPU_UTILIZATION)
    from_env = _env_bytes(env or {})
    if from_env is not None:
        return KVBudget(from_env, BudgetSource.ENV)
    if cache.kv_cache_memory_fraction is not None:
        if host is None:
            raise ValueError("kv_cache_memory_fraction: the host's memory was not measured")
        share = int(host.available * cache.kv_cache_memory_fraction) // max(1, host.workers)
        if share <= 0:
            raise ValueError(
                f"kv_cache_memory_fraction: {cache.kv_cache_memory_fraction} of "
                f"{host.available} available bytes over {host.workers} workers is nothing"
            )
        return KVBudget(share, BudgetSource.CPU_FRACTION)
    return KVBudget(DEFAULT_CPU_KV_BYTES, BudgetSource.DEFAULT)
