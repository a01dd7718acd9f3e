"""``EngineArgs``: the user's arguments (``launch``/``tidal`` flags, ``LLM(**kwargs)``),
generated from the option declarations of ``tidal.config`` (docs/contributing.md#options),
and the one place that validates them (the declared ranges and choices, then the rules
across fields and against the checkpoint) and resolves them into the frozen ``EngineConfig``.

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
import json
import os
import secrets
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig

from tidal.config import (
    CacheConfig,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    ModelDType,
    ParallelConfig,
    SchedulerConfig,
    as_id_list,
    check_options,
    engine_options,
    option_specs,
)
from tidal.distributed.core_slots import host_cores, parse_affinity, plan_groups
from tidal.frontend.launchers.registry import check_launcher_args
from tidal.frontend.processor import load_chat_template
from tidal.layers.quant import QuantConfigError, quant_method_from_config
from tidal.models.common import check_tensor_parallel
from tidal.models.hub import ModelNotFound, resolve_model_path
from tidal.models.registry import get_model_class, resolve_architecture
from tidal.models.tiny import default_model_path
from tidal.sampling_params import SamplingParams
from tidal.utils.cache_dir import cache_root
from tidal.utils.secret_env import AUTH_KEY_ENV

# What "auto" resolves to (the checkpoint's dtype when it is one of these).
_DTYPES = typing.get_args(ModelDType)
# vLLM's other names for two of them (``--dtype half``, ``--dtype float``).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# The DP control plane's shared secret (tidal/distributed/zmq_auth.py): the least length
# worth calling a secret (AUTH_KEY_ENV: where the CLI reads it).
MIN_AUTH_KEY_LEN = 16


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


# One field per option the config dataclasses declare (tidal/config.py), under its
# user-facing name, type and default; the declaration (help, range) rides along.
_EngineArgsFields = dataclasses.make_dataclass(
    "_EngineArgsFields",
    [
        (
            spec.name,
            spec.arg_hint,
            field(default=spec.default, repr=spec.field.repr, metadata=spec.field.metadata),
        )
        for spec in engine_options()
    ],
)


@dataclass
class EngineArgs(_EngineArgsFields):
    """User-facing arguments (CLI flags and ``LLM(**kwargs)``): every option of the config
    dataclasses, flat. ``create_engine_config`` turns them into the frozen config and is
    the one place that validates them (the declared ranges, then the rules across
    fields and against the checkpoint)."""

    def __post_init__(self) -> None:
        # setattr: the fields are made at import (make_dataclass), so an assignment here
        # would be their only declaration a type checker sees.
        dtype = getattr(self, "dtype")  # noqa: B009
        setattr(self, "dtype", DTYPE_ALIASES.get(dtype, dtype))  # noqa: B010

    def _same(self, cls: type) -> dict[str, Any]:
        """``cls``'s options, from the same-named arguments."""
        return {spec.field.name: getattr(self, spec.name) for spec in option_specs(cls)}

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
        check_options(self)  # every declared range and choice, before anything is read
        load_chat_template(self.chat_template)  # a missing file fails the start, not a request
        model = resolve_model_path(self.model or default_model_path(), self.revision)
        tokenizer = model
        if self.tokenizer and self.tokenizer != self.model:
            try:
                tokenizer = resolve_model_path(self.tokenizer)
            except ModelNotFound as e:
                raise ValueError("tokenizer" + str(e).removeprefix("model")) from e
        try:
            hf_config = AutoConfig.from_pretrained(
                model, trust_remote_code=self.trust_remote_code
            )
        except Exception as e:  # noqa: BLE001 - reported with the flag name
            raise ValueError(f"model: cannot read config.json in {model!r}: {e}") from e
        arch = resolve_architecture(hf_config)  # raises ValueError naming the architecture
        quantization = _resolve_quantization(self.quantization, hf_config, model)
        generation = _read_generation_config(model)
        model_cfg = ModelConfig(
            model=model,
            revision=self.revision,
            tokenizer=tokenizer,
            trust_remote_code=self.trust_remote_code,
            dtype=_resolve_dtype(self.dtype, hf_config, quantization),
            quantization=quantization,
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config),
            seed=self.seed,
            architecture=arch,
            hf_config=hf_config,
            generation_eos_token_ids=tuple(as_id_list(generation.get("eos_token_id"))),
            sampling_defaults=self._sampling_defaults(model, generation),
            generation_config=self.generation_config,
        )
        parallel = self._parallel_config(hf_config, arch)
        if self.async_scheduling and parallel.tensor_parallel_size > 1:
            # Only the driver samples: the other workers could not fill a placeholder.
            raise ValueError(
                f"async_scheduling with tensor_parallel_size {parallel.tensor_parallel_size}: "
                "async scheduling runs with tensor_parallel_size 1 (use --dp/--ep to scale)"
            )
        device = _resolve_device(self.device)
        if self.graph_backend == "cuda" and device != "cuda":
            raise ValueError(
                f"graph_backend 'cuda' needs --device cuda (got {device}); on CPU the "
                "emulating backend is 'emulated'"
            )
        if device == "cpu":  # this host's ranks: their core groups must exist here
            plan_groups(
                parallel.cpu_affinity,
                host_cores(),
                parallel.data_parallel_size_local,
                parallel.tensor_parallel_size,
            )
        return EngineConfig(
            **{
                **self._same(EngineConfig),
                "device": device,
                "kernel_cache_dir": _resolve_kernel_cache_dir(self.kernel_cache_dir),
            },
            model=model_cfg,
            cache=CacheConfig(**self._same(CacheConfig)),
            scheduler=self._scheduler_config(model_cfg.max_model_len),
            parallel=parallel,
            frontend=FrontendConfig(**self._same(FrontendConfig)),
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled"
            )
        return SchedulerConfig(
            **{
                **self._same(SchedulerConfig),
                "max_num_batched_tokens": budget,
                "max_model_len": max_model_len,
            }
        )

    def _parallel_config(self, hf_config: Any, arch: str) -> ParallelConfig:
        dp = self.data_parallel_size
        self._check_tensor_parallel(hf_config, arch)
        if not 0 <= self.data_parallel_rank < dp:
            raise ValueError(
                f"data_parallel_rank must be in [0, {dp}), got {self.data_parallel_rank}"
            )
        if self.elastic_restore and not self.enable_elastic_ep:
            raise ValueError("elastic_restore requires enable_elastic_ep")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb requires enable_expert_parallel")
        local = self.data_parallel_size_local if self.data_parallel_size_local is not None else dp
        key = self.data_parallel_auth_key
        if check_launcher_args(self).starts_all_ranks:
            # None beside the frontend: the control plane is TCP, and the frontend, which
            # starts every rank, may make the shared secret itself.
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
        parse_affinity(self.cpu_affinity)  # ValueError naming the flag
        # device_ids and cpu_cores are the launcher's to assign, per rank.
        return ParallelConfig(
            **{**self._same(ParallelConfig), "data_parallel_size_local": local,
               "data_parallel_auth_key": key}
        )  # fmt: skip

    def _check_tensor_parallel(self, hf_config: Any, arch: str) -> None:
        tp = self.tensor_parallel_size
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


def _resolve_quantization(requested: str | None, hf_config: Any, model: str) -> Any:
    """The checkpoint's quantization (None: not quantized), checked against
    ``--quantization``: ValueError naming the flag, the quant_method and the file."""
    where = os.path.join(model, "config.json")
    try:
        method = quant_method_from_config(hf_config, where, requested)
    except QuantConfigError as e:
        raise ValueError(f"quantization: {e}") from e
    return None if method is None else method.name


def _resolve_dtype(dtype: str, hf_config: Any, quantization: str | None = None) -> ModelDType:
    if dtype != "auto":  # one of ``_DTYPES``: ``check_options`` ran first
        return typing.cast(ModelDType, dtype)
    if quantization is not None:  # the scales' and unquantized weights' dtype (DeepSeek's)
        return "bfloat16"
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(ckpt).replace("torch.", "") if ckpt is not None else "float32"
    return typing.cast(ModelDType, name) if name in _DTYPES else "float32"


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({limit})"
        )
    return requested


def _resolve_kernel_cache_dir(path: str | None) -> str | None:
    if path == "":
        return None
    if path is None:
        return os.path.join(cache_root(), "kernels")
    return os.path.abspath(os.path.expanduser(path))


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"
