"""Block-size configs for the Triton fused-MoE kernels.

Tuned configs live in ``tidal/kernels/configs/`` as JSON files named
``E={E},N={N},device_name={device},dtype={dtype}.json`` (E = local experts, N = per-expert
intermediate size I; dtype ``float8_e4m3fn`` for the block-FP8 kernel of
``fp8_triton.py``), each mapping a token count M to one ``MoeKernelConfig``. A lookup
picks the entry whose M is nearest to the batch; without a file, ``default_config`` picks
batch-aware blocks. ``benchmarks/tune_moe.py`` writes the files.

The block-FP8 linear (``fp8_triton.fp8_linear``) takes the same launch parameters from
tables named ``linear,N={N},K={K},device_name={device},dtype=float8_e4m3fn.json``
(``linear_config_file_name``, ``get_linear_config``), written by the ``fp8`` step of
``benchmarks/gpu_proof.py``; without one, ``default_linear_config``.

Importable without triton or a GPU: pure lookup over JSON.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

_JSON_KEYS = {
    "block_size_m": "BLOCK_SIZE_M",
    "block_size_n": "BLOCK_SIZE_N",
    "block_size_k": "BLOCK_SIZE_K",
    "group_size_m": "GROUP_SIZE_M",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
    "split_k": "SPLIT_K",
}


@dataclass(frozen=True)
class MoeKernelConfig:
    """Launch parameters shared by both grouped GEMMs of one fused-MoE call (and of the
    FP8 linear's GEMM, the one kernel that takes ``split_k``).

    ``block_size_m`` is also the alignment block of ``moe_align_block_size``: every
    GEMM row-block then holds tokens of exactly one expert.
    """

    block_size_m: int
    block_size_n: int
    block_size_k: int
    group_size_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # The FP8 linear only: programs a tile's k range is split over (float32 partial sums
    # added atomically), so a decode's few output tiles still fill the GPU. 1 elsewhere.
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size_m", "block_size_n", "block_size_k"):
            value = getattr(self, name)
            # tl.arange needs powers of two; tl.dot on GPUs needs every dim >= 16.
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.group_size_m < 1 or self.num_warps < 1 or self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"group_size_m, num_warps, num_stages, split_k must be >= 1: {self}")

    def to_json(self) -> dict[str, int]:  # SPLIT_K only where it is not 1
        return {_JSON_KEYS[k]: v for k, v in asdict(self).items() if k != "split_k" or v != 1}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> MoeKernelConfig:
        unknown = set(data) - set(_JSON_KEYS.values())
        if unknown:
            raise ValueError(f"unknown MoE config keys {sorted(unknown)}")
        return cls(**{k: int(data[j]) for k, j in _JSON_KEYS.items() if j in data})


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the dtype part of a config file name)."""
    return str(dtype).removeprefix("torch.")


def normalize_device_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3"`` (file-name safe)."""
    return device_name.strip().replace(" ", "_").replace("/", "_").replace(",", "_")


def config_file_name(
    num_experts: int, intermediate_size: int, device_name: str, dtype: torch.dtype | str
) -> str:
    device = normalize_device_name(device_name)
    return (
        f"E={num_experts},N={intermediate_size},device_name={device},dtype={dtype_name(dtype)}.json"
    )


def parse_config_file(text: str) -> dict[int, MoeKernelConfig]:
    """JSON text ``{"M": {"BLOCK_SIZE_M": ...}, ...}`` -> ``{M: MoeKernelConfig}``."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or not raw:
        raise ValueError("a MoE config file must be a non-empty JSON object keyed by batch size")
    return {int(m): MoeKernelConfig.from_json(cfg) for m, cfg in raw.items()}


def check_moe_config(config: MoeKernelConfig) -> None:
    """A fused-MoE config: ``split_k`` belongs to the FP8 linear alone."""
    if config.split_k != 1:
        raise ValueError(f"the fused MoE splits no k range: split_k must be 1, got {config}")


def dump_config_file(configs: dict[int, MoeKernelConfig]) -> str:
    return json.dumps({str(m): configs[m].to_json() for m in sorted(configs)}, indent=2) + "\n"


def _read_table(path: Path) -> dict[int, MoeKernelConfig] | None:
    if not path.is_file():
        return None
    try:
        return parse_config_file(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"malformed MoE config file {path}: {exc}") from exc


@functools.lru_cache(maxsize=64)
def load_tuned_configs(
    num_experts: int,
    intermediate_size: int,
    device_name: str,
    dtype: str,
    config_dir: Path = CONFIG_DIR,
) -> dict[int, MoeKernelConfig] | None:
    """The tuned table for this key, or None when no file exists (cached per key)."""
    path = Path(config_dir) / config_file_name(num_experts, intermediate_size, device_name, dtype)
    table = _read_table(path)
    for config in (table or {}).values():
        try:
            check_moe_config(config)
        except ValueError as exc:
            raise ValueError(f"malformed MoE config file {path}: {exc}") from exc
    return table


def linear_config_file_name(n: int, k: int, device_name: str, dtype: torch.dtype | str) -> str:
    device = normalize_device_name(device_name)
    return f"linear,N={n},K={k},device_name={device},dtype={dtype_name(dtype)}.json"


@functools.lru_cache(maxsize=256)
def load_linear_configs(
    n: int, k: int, device_name: str, dtype: str, config_dir: Path = CONFIG_DIR
) -> dict[int, MoeKernelConfig] | None:
    """The FP8 linear's tuned table for ``[N, K]`` weights, or None (cached per key)."""
    return _read_table(Path(config_dir) / linear_config_file_name(n, k, device_name, dtype))


def default_linear_config(m: int, interpret: bool) -> MoeKernelConfig:
    """Block sizes of the FP8 linear by rows (decode: few rows, narrow M blocks)."""
    if interpret:
        return MoeKernelConfig(16, 32, 32, group_size_m=1, num_warps=1, num_stages=1)
    if m <= 16:
        return MoeKernelConfig(16, 64, 128, group_size_m=1, num_warps=4, num_stages=4)
    if m <= 64:
        return MoeKernelConfig(64, 64, 128, group_size_m=8, num_warps=4, num_stages=3)
    return MoeKernelConfig(64, 128, 128, group_size_m=8, num_warps=4, num_stages=3)


def get_linear_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype | str,
    device_name: str | None,
    interpret: bool,
    config_dir: Path = CONFIG_DIR,
) -> MoeKernelConfig:
    """Tuned config nearest to ``m`` rows if a file matches, else ``default_linear_config``."""
    if device_name is not None and not interpret:
        table = load_linear_configs(n, k, device_name, dtype_name(dtype), Path(config_dir))
        if table:
            return nearest_config(table, m)
    return default_linear_config(m, interpret)


def nearest_config(configs: dict[int, MoeKernelConfig], m: int) -> MoeKernelConfig:
    """The entry whose batch size is nearest to ``m`` (ties go to the smaller one)."""
    best = min(configs, key=lambda key: (abs(key - m), key))
    return configs[best]


def default_config(
    m: int,
    num_experts: int,
    top_k: int,
    interpret: bool,
    dtype: torch.dtype | str | None = None,  # the weights'; float8_e4m3fn: the FP8 kernel
) -> MoeKernelConfig:
    """Batch-aware blocks when nothing was tuned.

    What matters is the number of rows each expert gets (``m * top_k / E``): decode
    batches give an expert a handful of rows, so a big BLOCK_SIZE_M would mostly
    multiply padding; prefill batches fill big blocks and profit from L2 grouping.
    FP8 weights take 128-deep k tiles: one weight block (and scale) per FP8 dot, and 4
    warps at prefill sizes (on an H200 8 were 1.2-1.3x slower on Qwen3-30B-A3B's and
    DeepSeek-V3's layers, where each k tile's product is also scaled).
    """
    if dtype is not None and dtype_name(dtype) == "float8_e4m3fn" and not interpret:
        return replace(
            default_config(m, num_experts, top_k, interpret), block_size_k=128, num_warps=4
        )
    if interpret:
        # The interpreter pays per program, not per FLOP: few, small-M programs.
        return MoeKernelConfig(16, 32, 32, group_size_m=1, num_warps=1, num_stages=1)
    rows_per_expert = m * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoeKernelConfig(16, 64, 64, group_size_m=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return MoeKernelConfig(32, 64, 64, group_size_m=4, num_warps=4, num_stages=3)
    return MoeKernelConfig(64, 128, 64, group_size_m=8, num_warps=8, num_stages=3)


def get_moe_config(
    m: int,
    num_experts: int,
    intermediate_size: int,
    top_k: int,
    dtype: torch.dtype | str,
    device_name: str | None,
    interpret: bool,
    config_dir: Path = CONFIG_DIR,
) -> MoeKernelConfig:
    """Tuned config nearest to batch ``m`` if a file matches, else ``default_config``."""
    if device_name is not None and not interpret:
        table = load_tuned_configs(
            num_experts, intermediate_size, device_name, dtype_name(dtype), Path(config_dir)
        )
        if table:
            return nearest_config(table, m)
    return default_config(m, num_experts, top_k, interpret, dtype)
