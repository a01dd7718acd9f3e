"""Engine configuration: frozen dataclasses built once from ``EngineArgs`` and passed whole.

Validation happens here, at construction, with messages that name the offending
argument so a CLI or HTTP error can show them unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# The DP control plane's shared secret (tidal/utils/zmq_auth.py): where the CLI reads it,
# and the least length worth calling a secret.
AUTH_KEY_ENV = "TIDAL_DP_AUTH_KEY"
MIN_AUTH_KEY_LEN = 16
ALL2ALL_BACKENDS = (
    "allgather_reducescatter",
    "all2all",
    "deepep_high_throughput",
    "deepep_low_latency",
)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face folder
    tokenizer: str
    dtype: str  # resolved: float32 | float16 | bfloat16
    max_model_len: int
    seed: int
    architecture: str
    hf_config: Any = field(compare=False, hash=False, repr=False)
    # EOS ids from generation_config.json; all of them end generation (like transformers).
    generation_eos_token_ids: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    @property
    def eos_token_ids(self) -> list[int]:
        """config.json's EOS first, then generation_config.json's extra ones."""
        ids = _as_id_list(getattr(self.hf_config, "eos_token_id", None))
        return ids + [i for i in self.generation_eos_token_ids if i not in ids]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _read_generation_eos(model: str) -> tuple[int, ...]:
    path = os.path.join(model, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        return tuple(_as_id_list(json.load(f).get("eos_token_id")))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes of KV cache per rank; ignored when num_blocks is set.
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_blocks: int | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    # TCPStore port (on data_parallel_address, hosted by rank 0) for the DP/EP groups;
    # chosen by the launcher when 0.
    data_parallel_master_port: int = 0
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window: int = 1000
    eplb_interval: int = 3000
    dp_lb_policy: str = "tidal"  # frontend engine choice: tidal | vllm | tidal-p2c
    # Shared secret that authenticates the DP control plane when it runs over TCP
    # (tidal/utils/zmq_auth.py). Never printed; not in the config hash, which peers see.
    data_parallel_auth_key: str | None = field(default=None, repr=False)

    @property
    def ep_size(self) -> int:
        return self.data_parallel_size if self.enable_expert_parallel else 1

    def config_hash(self) -> str:
        """Hash of the parallel settings every rank must agree on (EP on/off, backends,
        EPLB). Excluded: what differs per rank or host, and ``data_parallel_size``: that
        is the launch size, the live size is the topology's (DESIGN.md 6.1), so an engine
        joining a grown or shrunk deployment still matches."""
        d = dataclasses.asdict(self)
        for k in (
            "data_parallel_size",
            "data_parallel_rank",
            "data_parallel_size_local",
            "data_parallel_start_rank",
            "data_parallel_master_port",
            "dp_lb_policy",
            "data_parallel_auth_key",
        ):
            d.pop(k)
        return _digest(d)


@dataclass(frozen=True)
class FrontendConfig:
    """What one request may ask for. Checked where requests enter (the HTTP server, ``LLM``,
    ``AsyncLLM``); the engine never sees these. Each is a flag of the same name because a
    deployment may need to raise it."""

    # OpenAI's own cap on ``n``; every choice is a sequence in the scheduler.
    max_n: int = 128
    # Prompts in one /v1/completions request (a batch is one HTTP call, but each prompt
    # is ``n`` engine requests).
    max_prompts_per_request: int = 256
    # vLLM's flag and default: top logprobs per position (completion and prompt).
    max_logprobs: int = 20
    # A prompt of a 128k-token context is under 1 MiB of JSON, as text or as token ids;
    # 8 MiB leaves room for batches and long chats and refuses a flood before it is read.
    max_request_body_bytes: int = 8 * 1024 * 1024
    # vLLM's flag: accept a ``chat_template`` in chat requests (rendered in a sandboxed,
    # time-bounded worker). Off: a template is code, run by anyone who can send a request.
    trust_request_chat_template: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    moe_backend: str = "auto"  # auto | torch | triton | reference
    frontend: FrontendConfig = field(default_factory=FrontendConfig)

    def with_parallel(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, **changes))

    def config_hash(self) -> str:
        """What an engine joining the deployment must share with it (the startup
        handshake compares it): the model (architecture and config.json, not its path,
        which may differ per host), dtype, max_model_len, KV block size, MoE backend flag
        and ``ParallelConfig.config_hash`` -- never the live DP size or a rank. The device
        is left out: a frontend-only host resolves ``auto`` by its own hardware."""
        return _digest(
            {
                "parallel": self.parallel.config_hash(),
                "architecture": self.model.architecture,
                "hf_config": _hf_config_fields(self.model.hf_config),
                "dtype": self.model.dtype,
                "max_model_len": self.model.max_model_len,
                "block_size": self.cache.block_size,
                "moe_backend": self.moe_backend,
            }
        )


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# config.json keys that name where or by what the checkpoint was saved, not the model.
_HF_CONFIG_IGNORED = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def _hf_config_fields(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:  # a test's stand-in config
        return {}
    return {k: v for k, v in to_dict().items() if k not in _HF_CONFIG_IGNORED}


@dataclass
class EngineArgs:
    """User-facing arguments (CLI flags and ``LLM(**kwargs)``); ``create_engine_config``
    turns them into the frozen config and is the one place that validates them."""

    model: str | None = None
    tokenizer: str | None = None
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
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window: int = 1000
    eplb_interval: int = 3000
    dp_lb_policy: str = "tidal"
    # The CLI fills it from TIDAL_DP_AUTH_KEY when the flag is not given.
    data_parallel_auth_key: str | None = field(default=None, repr=False)
    device: str = "auto"
    moe_backend: str = "auto"
    # FrontendConfig (request limits)
    max_n: int = 128
    max_prompts_per_request: int = 256
    max_logprobs: int = 20
    max_request_body_bytes: int = 8 * 1024 * 1024
    trust_request_chat_template: bool = False

    def create_engine_config(self) -> EngineConfig:
        from transformers import AutoConfig

        from tidal.models.registry import resolve_architecture

        model = self.model or _default_model()
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
        model_cfg = ModelConfig(
            model=model,
            tokenizer=self.tokenizer or model,
            dtype=dtype,
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config),
            seed=self.seed,
            architecture=arch,
            hf_config=hf_config,
            generation_eos_token_ids=_read_generation_eos(model),
        )
        return EngineConfig(
            model=model_cfg,
            cache=self._cache_config(),
            scheduler=self._scheduler_config(model_cfg.max_model_len),
            parallel=self._parallel_config(hf_config),
            device=_resolve_device(self.device),
            moe_backend=_check_choice(
                "moe_backend", self.moe_backend, ("auto", "torch", "triton", "reference")
            ),
            frontend=self._frontend_config(),
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

    def _parallel_config(self, hf_config: Any) -> ParallelConfig:
        dp = self.data_parallel_size
        if dp < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
        if not 0 <= self.data_parallel_rank < dp:
            raise ValueError(
                f"data_parallel_rank must be in [0, {dp}), got {self.data_parallel_rank}"
            )
        _check_choice("all2all_backend", self.all2all_backend, ALL2ALL_BACKENDS)
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}"
            )
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb requires enable_expert_parallel")
        local = self.data_parallel_size_local if self.data_parallel_size_local is not None else dp
        _check_choice("dp_lb_policy", self.dp_lb_policy, ("tidal", "vllm", "tidal-p2c"))
        if local < dp and self.data_parallel_auth_key is None:
            raise ValueError(
                "data_parallel_auth_key is required when ranks run on other hosts (the DP "
                "control plane then listens on TCP): give every host the same secret, "
                f"preferably in the {AUTH_KEY_ENV} environment variable"
            )
        key = self.data_parallel_auth_key
        if key is not None and len(key) < MIN_AUTH_KEY_LEN:
            raise ValueError(
                f"data_parallel_auth_key must be at least {MIN_AUTH_KEY_LEN} characters (use "
                "a random one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        # Same-named fields copy over; only the local size needs resolving.
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelConfig)}
        return ParallelConfig(**{**same, "data_parallel_size_local": local})


def _default_model() -> str:
    from tidal.models.tiny import default_model_path

    return default_model_path()


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


def _resolve_device(device: str) -> str:
    _check_choice("device", device, ("auto", "cpu", "cuda"))
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
