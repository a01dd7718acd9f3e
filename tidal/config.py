"""Engine configuration: frozen dataclasses built once from ``EngineArgs`` and passed whole.

Bottom layer (docs/architecture.md#layers): every process imports this, so it imports nothing of tidal and
no torch at import time. The user's arguments, their validation and their resolution
against the checkpoint (which needs ``tidal.models``) are ``tidal.launch.engine_args``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
    # The sampling values generation_config.json recommends (temperature, top_p, top_k,
    # min_p, repetition_penalty; max_tokens from max_new_tokens), as vLLM's
    # ``--generation-config auto``: what a request's unset fields default to.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    @property
    def eos_token_ids(self) -> list[int]:
        """config.json's EOS first, then generation_config.json's extra ones."""
        ids = as_id_list(getattr(self.hf_config, "eos_token_id", None))
        return ids + [i for i in self.generation_eos_token_ids if i not in ids]


def as_id_list(value: Any) -> list[int]:
    """A config's token id field (one id, a list of them, or None) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


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
    # Workers per DP rank (docs/architecture.md#tensor-parallel): the rank's engine core drives this many worker
    # processes, each holding a shard of the model.
    tensor_parallel_size: int = 1
    # This rank's device slots on its host (CUDA; one per TP worker), handed out by the
    # launcher (tidal/distributed/device_slots.py); () on CPU or when nothing assigned.
    device_ids: tuple[int, ...] = ()
    # CPU: whether ranks are pinned to core groups (auto | off | explicit groups,
    # ``tidal/distributed/core_slots.py``), and this rank's group, the launcher's to assign
    # per rank like ``device_ids`` (empty: not pinned).
    cpu_affinity: str = "auto"
    cpu_cores: tuple[int, ...] = ()
    enable_expert_parallel: bool = False
    # vLLM's flag: the deployment may grow and shrink while serving (docs/architecture.md#elastic). It runs
    # the DP machinery (coordinator, wave loop, process groups) even at size 1, since its
    # live size is the topology's and may not stay 1.
    enable_elastic_ep: bool = False
    # Elastic EP, after a rank death (docs/architecture.md#faults): the recovery removes the dead rank;
    # with this, a scale-up then brings the deployment back to the size it had.
    elastic_restore: bool = False
    # A data-parallel deployment survives the loss of ranks (docs/architecture.md#faults), with or
    # without elastic EP: the dead ranks are removed by a recovery operation and their
    # requests migrate. False: a rank death ends the deployment (every request fails),
    # for those who restart it from outside.
    rank_recovery: bool = True
    # The step-progress watchdog (docs/architecture.md#faults): a busy loop inside one iteration this
    # long, not waiting on its peers, is stuck, and its rank is killed and recovered from.
    # Seconds; 0 disables it. The default is ``protocol.messages.ENGINE_STALL_TIMEOUT_S``
    # (why there; this layer imports nothing of tidal).
    engine_stall_timeout: float = 120.0
    all2all_backend: str = "allgather_reducescatter"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window: int = 1000
    eplb_interval: int = 3000
    dp_lb_policy: str = "tidal"  # frontend engine choice: tidal | vllm | tidal-p2c
    # Shared secret that authenticates the DP control plane when it runs over TCP
    # (tidal/distributed/zmq_auth.py). Never printed; not in the config hash, which peers see.
    data_parallel_auth_key: str | None = field(default=None, repr=False)
    # Where engine ranks run (docs/architecture.md#launchers): "mp" (local processes, headless hosts) or
    # "ray" (Ray actors in placement groups). The frontend's choice, not the ranks'.
    data_parallel_backend: str = "mp"
    # Ray: the cluster to join ("auto", "host:port", "ray://..."); None: $RAY_ADDRESS, else
    # a local cluster started for this deployment.
    ray_address: str | None = None
    # Ray: how long a rank's placement group may take to be placed before the launch or
    # scale-up fails naming the missing resources.
    ray_placement_timeout_s: float = 30.0
    # Ray, elastic EP: ranks kept started ahead (placement group + actor + warm engine
    # launcher, their resources held) so a scale-up does not wait for them.
    ray_warm_ranks: int = 0
    # Ray: logical CPUs each rank reserves (its placement group's CPU bundle); on CPU its
    # engine runs that many threads.
    ray_cpus_per_rank: int = 1

    @property
    def is_data_parallel(self) -> bool:
        """Whether engines run as DP ranks (coordinator, waves, DP/EP process groups):
        more than one rank at launch, or elastic EP (the size may change later)."""
        return self.data_parallel_size > 1 or self.enable_elastic_ep

    @property
    def reconfigurable(self) -> bool:
        """Whether the deployment can change its groups while it serves: elastic EP, or
        a data-parallel deployment that recovers from rank deaths. Engines then run the
        elastic shell (a broken group waits for a recovery instead of ending the rank)
        and the frontend a scale driver."""
        return self.enable_elastic_ep or (self.data_parallel_size > 1 and self.rank_recovery)

    @property
    def recovers_ranks(self) -> bool:
        """Whether a rank death is recovered from (docs/architecture.md#faults) rather than fatal."""
        return self.is_data_parallel and self.rank_recovery

    @property
    def ep_size(self) -> int:
        """EP ranks at launch: every worker of every DP rank."""
        if not self.enable_expert_parallel:
            return 1
        return self.data_parallel_size * self.tensor_parallel_size

    def config_hash(self) -> str:
        """Hash of the parallel settings every rank must agree on (EP on/off, backends,
        EPLB). Excluded: what differs per rank or host, and ``data_parallel_size``: that
        is the launch size, the live size is the topology's (docs/architecture.md#elastic-identity), so an engine
        joining a grown or shrunk deployment still matches."""
        d = dataclasses.asdict(self)
        for k in (
            "data_parallel_size",
            "data_parallel_rank",
            "data_parallel_size_local",
            "data_parallel_start_rank",
            "data_parallel_master_port",
            "device_ids",
            "cpu_affinity",  # per host: how its cores are shared
            "cpu_cores",
            "dp_lb_policy",
            "data_parallel_auth_key",
            "elastic_restore",  # the frontend's policy, not the ranks'
            "data_parallel_backend",  # where ranks run: the frontend's choice
            "ray_address",
            "ray_placement_timeout_s",
            "ray_warm_ranks",
            "ray_cpus_per_rank",
            "engine_stall_timeout",  # the frontend's watchdog
        ):
            d.pop(k)
        return _digest(d)


@dataclass(frozen=True)
class FrontendConfig:
    """What one request may ask for. Checked where requests enter (the HTTP server, ``LLM``,
    ``AsyncLLM``); the engine re-checks the sizes (``check_sizes``) of what it is handed.
    Each is a flag of the same name because a deployment may need to raise it."""

    # OpenAI's own cap on ``n``; every choice is a sequence in the scheduler.
    max_n: int = 128
    # Prompts in one /v1/completions request (a batch is one HTTP call, but each prompt
    # is ``n`` engine requests).
    max_prompts_per_request: int = 256
    # vLLM's flag and default: top logprobs per position (completion and prompt).
    max_logprobs: int = 20
    # Prompts x n of one call: each is an engine request, however the call spells it
    # (256 prompts x n=128 would be 32,768 of them).
    max_choices_per_request: int = 1024
    # Stop strings are matched against every new piece of text of every choice, on the
    # server's event loop: their number and length bound that work per token.
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters of one stop string
    # Stop token ids (deduplicated once accepted); every choice carries them to the
    # engine, which keeps them as a set.
    max_stop_token_ids: int = 1024
    # A prompt of a 128k-token context is under 1 MiB of JSON, as text or as token ids;
    # 8 MiB leaves room for batches and long chats and refuses a flood before it is read.
    max_request_body_bytes: int = 8 * 1024 * 1024
    # vLLM's flag: accept a ``chat_template`` in chat requests (rendered in a sandboxed,
    # time-bounded worker). Off: a template is code, run by anyone who can send a request.
    trust_request_chat_template: bool = False

    def check_sizes(
        self,
        *,
        n: int = 1,
        num_prompts: int = 1,
        stop: Sequence[Any] = (),
        stop_token_ids: Sequence[Any] = (),
        extra_stop_token_ids: int = 0,
    ) -> None:
        """How much work one call may ask for (ValueError naming the field and its flag):
        prompts, choices (``n``, prompts x ``n``), stop strings (count, length) and stop
        token ids (``extra_stop_token_ids`` more where the model's extra EOS ids were
        added). Lists are counted as sent, repeats included: what bounds is the work of
        reading them (``SamplingParams`` then drops the repeats). Lengths only, and
        tolerant of items of the wrong type, which it leaves to the type checks: the HTTP
        server runs it on the raw JSON before anything walks the body, so a huge list
        costs nothing; ``InputProcessor.check`` runs it on every request of every entry
        point, and the engine once more on what it is handed."""
        if num_prompts > self.max_prompts_per_request:
            raise ValueError(
                f"prompt: at most {self.max_prompts_per_request} prompts per request "
                f"(--max-prompts-per-request), got {num_prompts}"
            )
        if n > self.max_n:
            raise ValueError(f"n must be <= {self.max_n} (max_n, --max-n), got {n}")
        if num_prompts * n > self.max_choices_per_request:
            raise ValueError(
                f"n: {num_prompts} prompts x n={n} = {num_prompts * n} choices; at most "
                f"{self.max_choices_per_request} per request (--max-choices-per-request)"
            )
        if len(stop) > self.max_stop_strings:
            raise ValueError(
                f"stop: at most {self.max_stop_strings} stop strings (--max-stop-strings), "
                f"got {len(stop)}"
            )
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_length:
            raise ValueError(
                f"stop: a stop string may have at most {self.max_stop_string_length} "
                f"characters (--max-stop-string-length), got one of {longest}"
            )
        if len(stop_token_ids) > self.max_stop_token_ids + extra_stop_token_ids:
            raise ValueError(
                f"stop_token_ids: at most {self.max_stop_token_ids} ids "
                f"(--max-stop-token-ids), got {len(stop_token_ids)}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    moe_backend: str = "auto"  # auto | torch | triton | reference
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    # CPU: which path serves each op (tidal/kernels/select.py): "auto" measures them at
    # load; native | onednn | torch forces one. Not in the config hash: every path gives
    # the same tokens, and ranks may differ (their CPUs may).
    cpu_kernels: str = "auto"
    # Where the measured choices are cached (one file per CPU and setup); None: not cached.
    kernel_cache_dir: str | None = None

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
