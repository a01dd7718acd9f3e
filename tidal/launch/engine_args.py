"""``EngineArgs``: the user's arguments (``launch``/``tidal`` flags, ``LLM(**kwargs)``) and
the one place that validates them and resolves them into the frozen ``EngineConfig``.

Why here, in ``tidal.launch``, and not beside the config dataclasses in ``tidal.config``:
resolving arguments reads the checkpoint (transformers' AutoConfig), asks the model registry
whether the architecture is served (``tidal.models``, layer 4) and builds the embedded tiny
checkpoint when no model is given. ``tidal.config`` sits in the bottom layer that every
engine process imports, so it may not depend on models (docs/architecture.md#layers). The engine processes
never see ``EngineArgs``: they receive the resolved ``EngineConfig``. Its only callers are
the user entry points, which are this layer (cli, spawn, llm), plus tests and benchmarks.

Error messages start with the offending field's name so ``args.build_engine_config`` can
turn them into ``--flag: ...`` CLI errors and the HTTP server can show them unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig

from tidal.config import (
    CacheConfig,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    as_id_list,
)
from tidal.distributed.core_slots import host_cores, parse_affinity, plan_groups
from tidal.kernels.select import MODES as CPU_KERNEL_MODES
from tidal.models.common import check_tensor_parallel
from tidal.models.registry import get_model_class, resolve_architecture
from tidal.models.tiny import default_model_path
from tidal.protocol.messages import ENGINE_STALL_TIMEOUT_S
from tidal.sampling_params import SamplingParams
from tidal.utils.secret_env import AUTH_KEY_ENV

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# The DP control plane's shared secret (tidal/distributed/zmq_auth.py): the least length
# worth calling a secret (AUTH_KEY_ENV: where the CLI reads it).
MIN_AUTH_KEY_LEN = 16
ALL2ALL_BACKENDS = (
    "allgather_reducescatter",
    "all2all",
    "deepep_high_throughput",
    "deepep_low_latency",
)


def _read_generation_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


# transformers' GenerationConfig defaults: a value equal to one of these recommends nothing
# (vLLM reads the file's difference from them).
_HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: dict[str, Any], source: str) -> tuple:
    """The sampling values a generation_config.json recommends, checked as a request's
    would be: ValueError naming the file for one that no request could use."""
    out: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = generation_config.get(name)
        if value is not None and value != _HF_SAMPLING_DEFAULTS.get(name):
            out[name] = value
    if generation_config.get("max_new_tokens") is not None:
        out["max_tokens"] = generation_config["max_new_tokens"]
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"generation_config: {source}/generation_config.json: {e} "
            "(--generation-config none ignores its sampling values)"
        ) from None
    return tuple(sorted(out.items()))


@dataclass
class EngineArgs:
    """User-facing arguments (CLI flags and ``LLM(**kwargs)``); ``create_engine_config``
    turns them into the frozen config and is the one place that validates them."""

    model: str | None = None
    tokenizer: str | None = None
    # auto: the model folder's generation_config.json | none | a folder holding one.
    generation_config: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    data_parallel_master_port: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_elastic_ep: bool = False
    elastic_restore: bool = False
    rank_recovery: bool = True
    engine_stall_timeout: float = ENGINE_STALL_TIMEOUT_S
    all2all_backend: str = "allgather_reducescatter"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window: int = 1000
    eplb_interval: int = 3000
    dp_lb_policy: str = "tidal"
    # The CLI fills it from TIDAL_DP_AUTH_KEY when the flag is not given.
    data_parallel_auth_key: str | None = field(default=None, repr=False)
    data_parallel_backend: str = "mp"
    ray_address: str | None = None
    ray_placement_timeout_s: float = 30.0
    ray_warm_ranks: int = 0
    ray_cpus_per_rank: int = 1
    device: str = "auto"
    moe_backend: str = "auto"
    cpu_kernels: str = "auto"
    cpu_affinity: str = "auto"
    # None: $XDG_CACHE_HOME/tidal/kernels (~/.cache/tidal/kernels); "": no cache.
    kernel_cache_dir: str | None = None
    # FrontendConfig (request limits)
    max_n: int = 128
    max_prompts_per_request: int = 256
    max_logprobs: int = 20
    max_choices_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 1024
    max_request_body_bytes: int = 8 * 1024 * 1024
    trust_request_chat_template: bool = False

    def _sampling_defaults(self, model: str, model_generation: dict[str, Any]) -> tuple:
        """``model_generation``: the model folder's generation_config.json, already read."""
        choice = self.generation_config
        if choice == "none":
            return ()
        if choice == "auto":
            return sampling_defaults(model_generation, model)
        if not os.path.isdir(choice):
            raise ValueError(
                f"generation_config: auto, none or a folder holding generation_config.json; "
                f"{choice!r} is not a directory"
            )
        return sampling_defaults(_read_generation_config(choice), choice)

    def create_engine_config(self) -> EngineConfig:
        model = self.model or default_model_path()
        if not os.path.isdir(model):
            raise ValueError(
                f"model: {model!r} is not a directory (a Hugging Face checkpoint folder)"
            )
        try:
            hf_config = AutoConfig.from_pretrained(model)
        except Exception as e:  # noqa: BLE001 - reported with the flag name
            raise ValueError(f"model: cannot read config.json in {model!r}: {e}") from e
        arch = resolve_architecture(hf_config)  # raises ValueError naming the architecture
        dtype = _resolve_dtype(self.dtype, hf_config)
        generation = _read_generation_config(model)
        model_cfg = ModelConfig(
            model=model,
            tokenizer=self.tokenizer or model,
            dtype=dtype,
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config),
            seed=self.seed,
            architecture=arch,
            hf_config=hf_config,
            generation_eos_token_ids=tuple(as_id_list(generation.get("eos_token_id"))),
            sampling_defaults=self._sampling_defaults(model, generation),
        )
        parallel = self._parallel_config(hf_config, arch)
        device = _resolve_device(self.device)
        if device == "cpu":  # this host's ranks: their core groups must exist here
            plan_groups(
                parallel.cpu_affinity,
                host_cores(),
                parallel.data_parallel_size_local,
                parallel.tensor_parallel_size,
            )
        return EngineConfig(
            model=model_cfg,
            cache=self._cache_config(),
            scheduler=self._scheduler_config(model_cfg.max_model_len),
            parallel=parallel,
            device=device,
            moe_backend=_check_choice(
                "moe_backend", self.moe_backend, ("auto", "torch", "triton", "reference")
            ),
            frontend=self._frontend_config(),
            cpu_kernels=_check_choice("cpu_kernels", self.cpu_kernels, CPU_KERNEL_MODES),
            kernel_cache_dir=_resolve_kernel_cache_dir(self.kernel_cache_dir),
        )

    def _frontend_config(self) -> FrontendConfig:
        # Same-named fields copy over; every limit is a count or a size, so at least 1.
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(FrontendConfig)}
        for name, value in same.items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        return FrontendConfig(**same)

    def _cache_config(self) -> CacheConfig:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two in [1, 128], got {self.block_size}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_blocks=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled"
            )
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )

    def _parallel_config(self, hf_config: Any, arch: str) -> ParallelConfig:
        dp = self.data_parallel_size
        if dp < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
        self._check_tensor_parallel(hf_config, arch)
        if not 0 <= self.data_parallel_rank < dp:
            raise ValueError(
                f"data_parallel_rank must be in [0, {dp}), got {self.data_parallel_rank}"
            )
        _check_choice("all2all_backend", self.all2all_backend, ALL2ALL_BACKENDS)
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}"
            )
        if self.elastic_restore and not self.enable_elastic_ep:
            raise ValueError("elastic_restore requires enable_elastic_ep")
        stall = self.engine_stall_timeout
        if not isinstance(stall, int | float) or not math.isfinite(stall) or stall < 0:
            raise ValueError(
                f"engine_stall_timeout must be a finite number of seconds >= 0 (0: off), "
                f"got {stall!r}"
            )
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb requires enable_expert_parallel")
        local = self.data_parallel_size_local if self.data_parallel_size_local is not None else dp
        _check_choice("dp_lb_policy", self.dp_lb_policy, ("tidal", "vllm", "tidal-p2c"))
        key = self.data_parallel_auth_key
        if self._check_backend():
            # Ray places every rank, none beside the frontend: the control plane is TCP,
            # and the frontend, which starts every rank, may make the shared secret itself.
            local = 0
            key = key if key is not None else secrets.token_urlsafe(32)
        elif local < dp and key is None:
            raise ValueError(
                "data_parallel_auth_key is required when ranks run on other hosts (the DP "
                "control plane then listens on TCP): give every host the same secret, "
                f"preferably in the {AUTH_KEY_ENV} environment variable or a "
                "--data-parallel-auth-key-file"
            )
        if key is not None and len(key) < MIN_AUTH_KEY_LEN:
            raise ValueError(
                f"data_parallel_auth_key must be at least {MIN_AUTH_KEY_LEN} characters (use "
                "a random one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        # Same-named fields copy over; only the local size needs resolving (device_ids
        # and cpu_cores are the launcher's to assign, per rank).
        same = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(ParallelConfig)
            if f.name not in ("device_ids", "cpu_cores")
        }
        parse_affinity(self.cpu_affinity)  # ValueError naming the flag
        return ParallelConfig(
            **{**same, "data_parallel_size_local": local, "data_parallel_auth_key": key}
        )

    def _check_backend(self) -> bool:
        """Whether ranks run on Ray (``data_parallel_backend``), with its flags checked.
        Ray is looked for, never imported: only the Ray launcher imports it."""
        _check_choice("data_parallel_backend", self.data_parallel_backend, ("mp", "ray"))
        if self.data_parallel_backend == "mp":
            for name, value, default in (
                ("ray_address", self.ray_address, None),
                ("ray_warm_ranks", self.ray_warm_ranks, 0),
                ("ray_cpus_per_rank", self.ray_cpus_per_rank, 1),
            ):
                if value != default:
                    raise ValueError(f"{name} needs data_parallel_backend ray")
            return False
        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "data_parallel_backend ray needs Ray, which is not installed: "
                "pip install 'tidal[ray]'"
            )
        if self.data_parallel_size_local is not None or self.data_parallel_start_rank:
            raise ValueError(
                "data_parallel_backend ray places every rank itself: drop "
                "--data-parallel-size-local / --data-parallel-start-rank (those are for "
                "--headless hosts of the mp backend)"
            )
        if not self.ray_placement_timeout_s > 0:
            raise ValueError(
                f"ray_placement_timeout_s must be > 0, got {self.ray_placement_timeout_s}"
            )
        if self.ray_cpus_per_rank < 1:
            raise ValueError(f"ray_cpus_per_rank must be >= 1, got {self.ray_cpus_per_rank}")
        if self.ray_warm_ranks < 0:
            raise ValueError(f"ray_warm_ranks must be >= 0, got {self.ray_warm_ranks}")
        if self.ray_warm_ranks and not self.enable_elastic_ep:
            raise ValueError("ray_warm_ranks needs enable_elastic_ep (they serve scale-ups)")
        return True

    def _check_tensor_parallel(self, hf_config: Any, arch: str) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        spec = get_model_class(arch).spec_from_config(hf_config)
        try:
            check_tensor_parallel(spec, tp, self.enable_expert_parallel)
        except ValueError as e:
            raise ValueError(f"tensor_parallel_size {tp} cannot shard this model: {e}") from None
        ep = self.data_parallel_size * tp
        if self.enable_expert_parallel and ep > spec.num_experts:
            raise ValueError(
                f"tensor_parallel_size {tp} with data_parallel_size {self.data_parallel_size} "
                f"makes {ep} expert-parallel workers for {spec.num_experts} experts: every "
                "worker needs at least one expert"
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _resolve_dtype(dtype: str, hf_config: Any) -> str:
    _check_choice("dtype", dtype, _DTYPES)
    if dtype != "auto":
        return dtype
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(ckpt).replace("torch.", "") if ckpt is not None else "float32"
    return name if name in _DTYPES else "float32"


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    if requested is None:
        return limit
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({limit})"
        )
    return requested


def _resolve_kernel_cache_dir(path: str | None) -> str | None:
    if path == "":
        return None
    if path is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "tidal", "kernels")
    return os.path.abspath(os.path.expanduser(path))


def _resolve_device(device: str) -> str:
    _check_choice("device", device, ("auto", "cpu", "cuda"))
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"
