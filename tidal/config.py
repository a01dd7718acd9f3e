"""Engine configuration: frozen dataclasses built once from ``EngineArgs`` and passed whole,
and the one declaration of every engine option (docs/contributing.md#options).

Each user option is a field here declared with ``option``: its type (``Literal`` for a
choice), its range (``Annotated[int, Meta(ge=1)]``, the ``msgspec.Meta`` of
``SamplingParams``' range table), its default and its help. ``EngineArgs``, the ``--flags``,
their ``--help`` and the range checks (``check_options``) are generated from these.

Bottom layer (docs/architecture.md#layers): every process imports this, so it imports nothing of tidal and
no torch at import time. The user's arguments, their cross-field rules and their resolution
against the checkpoint (which needs ``tidal.models``) are ``tidal.launch.engine_args``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from typing import Annotated, Any, Literal

from msgspec import Meta


class _Same:
    """``Option.arg_default``: the same as the field's default."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


@dataclass(frozen=True)
class Option:
    """What makes a config field a user option (``option``'s metadata)."""

    help: str
    # The user-facing name (``EngineArgs`` field, ``--flag``) where it differs.
    arg: str | None = None
    aliases: tuple[str, ...] = ()  # more spellings of the flag (``--dp``)
    # The user-facing default where it differs from the field's: None or "auto" mean
    # "resolved at launch" (from the checkpoint, the host); the help says how.
    arg_default: Any = SAME


def option(
    default: Any = MISSING,
    *,
    help: str,  # noqa: A002 - argparse's word for it
    arg: str | None = None,
    aliases: tuple[str, ...] = (),
    arg_default: Any = SAME,
    repr: bool = True,  # noqa: A002 - dataclasses' word for it
    in_hash: bool = True,
) -> Any:
    """A config field that is a user option (a flag and an ``EngineArgs`` field).
    ``in_hash=False``: left out of ``config_hash`` (see ``NOT_HASHED``)."""
    metadata: dict[str, Any] = {"option": Option(help, arg, aliases, arg_default)}
    if not in_hash:
        metadata.update(NOT_HASHED)
    return field(default=default, repr=repr, metadata=metadata)


# Field metadata: the ranks need not agree on this field (it differs per rank or host, or
# is the frontend's alone), so ``config_hash``, which the startup handshake compares,
# leaves it out.
NOT_HASHED = {"in_hash": False}


@dataclass(frozen=True)
class OptionSpec:
    """One declared option, as the generators read it."""

    field: dataclasses.Field
    option: Option
    hint: Any  # the field's type, ``Annotated`` extras kept

    @property
    def name(self) -> str:
        return self.option.arg or self.field.name

    @property
    def default(self) -> Any:
        if self.option.arg_default is not SAME:
            return self.option.arg_default
        if self.field.default is MISSING:
            raise TypeError(f"option {self.name} has no default")
        return self.field.default

    @property
    def arg_hint(self) -> Any:
        """The user-facing type: the field's, plus its unresolved default ("auto", None)."""
        unresolved = self.option.arg_default
        if unresolved is None and not _allows_none(self.hint):
            return self.hint | None
        if isinstance(unresolved, str):
            choices = _choices(self.hint)
            if choices is not None and unresolved not in choices:
                return Literal[(unresolved, *choices)]
        return self.hint


def option_specs(cls: type) -> list[OptionSpec]:
    """The options ``cls`` declares, in field order."""
    return list(_option_specs(cls))


@functools.cache
def _option_specs(cls: type) -> tuple[OptionSpec, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(
        OptionSpec(f, f.metadata["option"], hints[f.name])
        for f in dataclasses.fields(cls)
        if "option" in f.metadata
    )


def check_options(obj: Any, specs: Sequence[OptionSpec] | None = None) -> None:
    """Every declared option of ``obj`` against its choices and range: ValueError starting
    with the option's user-facing name (the CLI turns it into the flag's)."""
    for spec in option_specs(type(obj)) if specs is None else specs:
        check_value(spec.name, spec.hint, getattr(obj, spec.field.name))


def check_value(name: str, hint: Any, value: Any) -> None:
    """``value`` against ``hint``'s ``Literal`` choices or ``Meta`` range (None passes
    where the type allows it). Types are checked only where a range or choice is."""
    if value is None and _allows_none(hint):
        return
    choices = _choices(hint)
    if choices is not None:
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return
    base, meta = _range(hint)
    if meta is None:
        return
    bound = describe_range(meta)
    if base is int:
        if not isinstance(value, int) or isinstance(value, bool) or not _in_range(value, meta):
            raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    elif (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not _in_range(value, meta)
    ):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def describe_range(meta: Meta) -> str:
    """``>= 1``, ``> 0``, ``in [0, 8]``: what a ``Meta`` allows."""
    low = f">= {meta.ge}" if meta.ge is not None else f"> {meta.gt}" if meta.gt is not None else ""
    high = f"<= {meta.le}" if meta.le is not None else f"< {meta.lt}" if meta.lt is not None else ""
    if meta.ge is not None and meta.le is not None:
        return f"in [{meta.ge}, {meta.le}]"
    return " and ".join(p for p in (low, high) if p)


def choices_of(hint: Any) -> tuple[Any, ...] | None:
    """A ``Literal`` option's choices (through ``Annotated`` and ``| None``); None otherwise."""
    return _choices(hint)


def range_of(hint: Any) -> tuple[type | None, Meta | None]:
    """A numeric option's type and ``Meta`` range (through ``| None``); (type, None) unbounded."""
    return _range(hint)


def _in_range(v: float, m: Meta) -> bool:
    return (
        (m.ge is None or v >= m.ge)
        and (m.gt is None or v > m.gt)
        and (m.le is None or v <= m.le)
        and (m.lt is None or v < m.lt)
    )


def _members(hint: Any) -> list[Any]:
    """``X | None`` -> [X, None]; anything else -> [it]."""
    if typing.get_origin(hint) in (typing.Union, _UnionType):
        return list(typing.get_args(hint))
    return [hint]


_UnionType = type(int | None)


def _allows_none(hint: Any) -> bool:
    return type(None) in _members(hint)


def _choices(hint: Any) -> tuple[Any, ...] | None:
    for member in _members(hint):
        if typing.get_origin(member) is Annotated:
            member = typing.get_args(member)[0]
        if typing.get_origin(member) is Literal:
            return typing.get_args(member)
    return None


def _range(hint: Any) -> tuple[type | None, Meta | None]:
    for member in _members(hint):
        if member is type(None):
            continue
        if typing.get_origin(member) is Annotated:
            base, *extras = typing.get_args(member)
            metas = [e for e in extras if isinstance(e, Meta)]
            return base, (metas[0] if metas else None)
        return member, None
    return None, None


ModelDType = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class ModelConfig:
    model: str = option(
        arg_default=None,
        help="Hugging Face checkpoint folder, or a repo id ORG/NAME looked up in the local "
        "Hugging Face cache (downloaded when missing, unless HF_HUB_OFFLINE=1) (default: the "
        "embedded tiny Qwen3-MoE model)",
    )
    tokenizer: str = option(arg_default=None, help="tokenizer folder or repo id (default: --model)")
    dtype: ModelDType = option(
        arg_default="auto",
        help="weights and activations (auto: the checkpoint's dtype; bfloat16 for a quantized "
        "checkpoint, whose unquantized weights and activations then use it; half and float, "
        "vLLM's names, are float16 and float32)",
    )
    max_model_len: Annotated[int, Meta(ge=1)] = option(
        arg_default=None, help="longest prompt + output in tokens (default: the model's limit)"
    )
    seed: int = option(arg_default=0, help="random seed of each engine process")
    # Required: the options above have no field default either (``option()`` without one),
    # which a type checker cannot see through.
    architecture: str  # pyright: ignore[reportGeneralTypeIssues]
    hf_config: Any = field(compare=False, hash=False, repr=False)  # pyright: ignore[reportGeneralTypeIssues]
    # EOS ids from generation_config.json; all of them end generation (like transformers).
    generation_eos_token_ids: tuple[int, ...] = ()
    # The sampling values generation_config.json recommends (temperature, top_p, top_k,
    # min_p, repetition_penalty; max_tokens from max_new_tokens), as vLLM's
    # ``--generation-config auto``: what a request's unset fields default to.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # Where ``sampling_defaults`` came from (``tidal.launch.engine_args`` reads it).
    generation_config: str = option(
        "auto",
        help="where the default sampling values come from (temperature, top_p, top_k, "
        "min_p, repetition_penalty; max_new_tokens caps an unset max_tokens): auto (the "
        "model's generation_config.json, as vLLM) | none (temperature 1, no top-k/top-p) "
        "| a folder holding a generation_config.json",
    )
    revision: str | None = option(
        None, help="branch, tag or commit of a --model repo id (default: main)"
    )
    trust_remote_code: bool = option(
        False,
        help="let transformers run Python code shipped in the checkpoint (config.json or "
        "tokenizer_config.json auto_map); off: such code is never run",
    )
    quantization: Literal["fp8"] | None = option(
        None,
        help="how the checkpoint's weights are quantized (default: its config.json "
        "quantization_config; fp8: float8_e4m3fn weights with block or per-tensor scales, "
        "held in FP8: on CPU dequantized in the kernels, on CUDA multiplied by Triton w8a8 "
        "kernels with activations quantized per token group, "
        "docs/architecture.md#quantization); another "
        "quant_method is an error",
    )

    def __post_init__(self) -> None:
        check_options(self)

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
    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128] = option(16, help="tokens per KV cache block")
    # Ignored when num_blocks is set; precedence: tidal/executor/kv_budget.py.
    kv_cache_memory_bytes: Annotated[int, Meta(gt=0)] | None = option(
        None,
        help="KV cache bytes per rank (per TP worker); overrides the fraction, the GPU "
        "utilization and VLLM_CPU_KVCACHE_SPACE (default: those, else 512 MiB on CPU)",
    )
    kv_cache_memory_fraction: Annotated[float, Meta(gt=0, le=1)] | None = option(
        None,
        help="CPU: this fraction of the host's available memory at start, shared by its "
        "ranks' workers, for their KV caches (VLLM_CPU_KVCACHE_SPACE, in GiB per rank, "
        "wins over it)",
    )
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = option(
        0.9, help="GPU: fraction of each device's memory for weights, activations and KV cache"
    )
    num_blocks: Annotated[int, Meta(ge=1)] | None = option(
        None,
        arg="num_gpu_blocks_override",
        aliases=("--num-kv-blocks",),
        help="KV cache blocks per rank (overrides --kv-cache-memory-bytes)",
    )
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prompt prefixes")
    # vLLM's flag. Its float8 names are refused by the choice check: nothing here reads
    # a float8 cache (docs/architecture.md#kv-cache-layouts).
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto",
        help="dtype the KV cache holds (auto: the model's --dtype); new K/V are cast into it "
        "and attention reads it directly, so bfloat16/float16 hold twice float32's tokens "
        "in the same bytes",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def torch_dtype(self, model_dtype: Any) -> Any:
        """The cache's torch dtype: ``kv_cache_dtype``, or ``model_dtype`` for auto."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        import torch

        return getattr(torch, self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: Annotated[int, Meta(ge=1)] = option(
        2048,
        arg_default=None,
        help="token budget of one step (default: 2048; without chunked prefill at least "
        "--max-model-len)",
    )
    max_num_seqs: Annotated[int, Meta(ge=1)] = option(
        128, help="most requests running at once per rank"
    )
    max_model_len: int = 2048  # ModelConfig's, resolved
    enable_chunked_prefill: bool = option(True, help="split long prompts across steps")
    # docs/architecture.md#async-scheduling: the next step is scheduled while this one
    # runs; a decode row's input token is the previous step's sampled one, filled in by
    # the worker from its tensor.
    async_scheduling: bool = option(
        False,
        help="schedule step n+1 while step n runs: sampled tokens stay on the device and "
        "their host copy and output processing are deferred one step (a stop costs at "
        "most one extra token, discarded); tensor_parallel_size 1 only",
    )

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: Annotated[int, Meta(ge=1)] = option(
        1,
        aliases=("--dp",),
        help="number of data-parallel engine ranks",
        in_hash=False,
    )
    data_parallel_rank: Annotated[int, Meta(ge=0)] = option(
        0,
        help="this process's rank (set per spawned engine; rarely by hand)",
        in_hash=False,
    )
    # 0 where the launcher places every rank itself (Ray).
    data_parallel_size_local: Annotated[int, Meta(ge=0)] = option(
        1,
        arg_default=None,
        help="ranks started on this host (default: all of them)",
        in_hash=False,
    )
    data_parallel_start_rank: Annotated[int, Meta(ge=0)] = option(
        0,
        help="first rank started on this host (with --headless)",
        in_hash=False,
    )
    data_parallel_address: str = option(
        "127.0.0.1", help="host the frontend and rank 0's groups listen on"
    )
    data_parallel_rpc_port: Annotated[int, Meta(ge=0, le=65535)] = option(
        0, help="frontend handshake port headless ranks connect to (0: pick)"
    )
    # TCPStore port (on data_parallel_address, hosted by rank 0) for the DP/EP groups;
    # chosen by the launcher when 0.
    data_parallel_master_port: Annotated[int, Meta(ge=0, le=65535)] = option(
        0,
        help="TCPStore port of the DP/EP process groups (0: pick)",
        in_hash=False,
    )
    # Workers per DP rank (docs/architecture.md#tensor-parallel): the rank's engine core drives this many worker
    # processes, each holding a shard of the model.
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = option(
        1,
        aliases=("-tp",),
        help="worker processes (devices) per data-parallel rank, each with a shard of the "
        "model (attention heads, dense MLP, vocabulary; MoE experts' intermediate "
        "dimension, or with --ep the experts, over every rank's workers)",
    )
    # This rank's device slots on its host (CUDA; one per TP worker), handed out by the
    # launcher (tidal/distributed/device_slots.py); () on CPU or when nothing assigned.
    device_ids: tuple[int, ...] = field(default=(), metadata=NOT_HASHED)
    # CPU: whether ranks are pinned to core groups (``tidal/distributed/core_slots.py``
    # parses it; per host: how its cores are shared), and this rank's group, the
    # launcher's to assign per rank like ``device_ids`` (empty: not pinned).
    cpu_affinity: str = option(
        "auto",
        help="auto | off | explicit groups, one per local rank (0-7|8-15): pin each CPU "
        "rank's threads to its own group of cores, shared by its TP workers (auto: where "
        "the host runs several ranks, with at least a core for each of their workers)",
        in_hash=False,
    )
    cpu_cores: tuple[int, ...] = field(default=(), metadata=NOT_HASHED)
    enable_expert_parallel: bool = option(
        False,
        aliases=("--ep",),
        help="shard MoE experts across the data-parallel ranks (and their tensor-parallel workers)",
    )
    # vLLM's flag: the deployment may grow and shrink while serving (docs/architecture.md#elastic). It runs
    # the DP machinery (coordinator, wave loop, process groups) even at size 1, since its
    # live size is the topology's and may not stay 1.
    enable_elastic_ep: bool = option(
        False,
        help="elastic expert parallelism: the deployment can grow and shrink while serving; "
        "runs the DP coordinator and wave loop even with one rank",
    )
    # Elastic EP, after a rank death (docs/architecture.md#faults): the recovery removes the dead rank;
    # with this, a scale-up then brings the deployment back to the size it had. The
    # frontend's policy, not the ranks'.
    elastic_restore: bool = option(
        False,
        help="elastic EP: after a rank died and the deployment recovered without it, scale "
        "back up to the size it had (a new rank, by the normal scale-up path)",
        in_hash=False,
    )
    # A data-parallel deployment survives the loss of ranks (docs/architecture.md#faults), with or
    # without elastic EP: the dead ranks are removed by a recovery operation and their
    # requests migrate. False: a rank death ends the deployment (every request fails),
    # for those who restart it from outside.
    rank_recovery: bool = option(
        True,
        help="data parallel: survive the loss of ranks or hosts -- the dead ranks are "
        "removed while the others serve and their requests move (--no-rank-recovery: a "
        "rank death fails every request, for an outside restart)",
    )
    # The step-progress watchdog (docs/architecture.md#faults): a busy loop inside one iteration this
    # long, not waiting on its peers, is stuck, and its rank is killed and recovered from.
    # A step is at most ``max_num_batched_tokens`` (2048) tokens: a few seconds on CPU; a
    # GPU's first steps also compile Triton kernels (tens of seconds on a slow host). Two
    # minutes clears both with room, and still turns a hang into a recovery. The
    # frontend's watchdog, not the ranks'.
    engine_stall_timeout: Annotated[float, Meta(ge=0)] = option(
        120.0,
        help="seconds a rank's busy loop may stay inside one step (not waiting on its "
        "peers) before it counts as stuck, is killed and recovered from (0: no watchdog)",
        in_hash=False,
    )
    # A rank reached over TCP (--headless) has no launcher to die with its frontend: it
    # counts the frontend dead after this much silence and exits, freeing its device and
    # ports. Not below HEARTBEAT_TIMEOUT_S (3 s), and by default well above it: a frontend
    # event loop stalled by a burst of work must not make every rank exit.
    frontend_timeout: Annotated[float, Meta(ge=3)] = option(
        10.0,
        help="headless ranks: seconds without a heartbeat from the frontend (sent every "
        "0.5 s) before a rank counts it dead and exits",
        in_hash=False,
    )
    all2all_backend: Literal[
        "allgather_reducescatter", "all2all", "deepep_high_throughput", "deepep_low_latency"
    ] = option("allgather_reducescatter", help="expert-parallel token exchange")
    enable_eplb: bool = option(
        False, help="rebalance experts across ranks from their measured load"
    )
    num_redundant_experts: Annotated[int, Meta(ge=0)] = option(
        0, help="extra physical expert copies for EPLB to place"
    )
    eplb_window: Annotated[int, Meta(ge=1)] = option(
        1000, help="steps of expert load EPLB plans from"
    )
    eplb_interval: Annotated[int, Meta(ge=1)] = option(3000, help="steps between EPLB rebalances")
    dp_lb_policy: Literal["tidal", "vllm", "tidal-p2c"] = option(
        "tidal",
        help="request routing across ranks",
        in_hash=False,
    )
    # Authenticates the DP control plane when it runs over TCP (tidal/distributed/zmq_auth.py).
    # Never printed; not in the config hash, which peers see.
    data_parallel_auth_key: str | None = option(
        None,
        repr=False,
        help="shared secret that authenticates the DP control plane over TCP; the same on "
        "every host, required with --headless ranks (default: $TIDAL_DP_AUTH_KEY); "
        "visible in ps, prefer --data-parallel-auth-key-file or the variable",
        in_hash=False,
    )
    # Where engine ranks run (docs/architecture.md#launchers): what each can do is its
    # ``LauncherKind`` (tidal/frontend/launchers/registry.py). The frontend's choice, not
    # the ranks'.
    data_parallel_backend: Literal["mp", "ray"] = option(
        "mp",
        help="where engine ranks run: mp (local processes; other hosts with --headless) | "
        "ray (one Ray actor per rank in its own placement group, on the cluster of "
        "--ray-address; pip install 'tidal[ray]')",
        in_hash=False,
    )
    ray_address: str | None = option(
        None,
        help="Ray cluster to run the ranks on (auto | host:port | ray://host:port; "
        "default: $RAY_ADDRESS, else a local cluster started for this deployment)",
        in_hash=False,
    )
    ray_placement_timeout_s: Annotated[float, Meta(gt=0)] = option(
        30.0,
        help="Ray: seconds a rank's placement group may wait for resources before the "
        "launch or scale-up fails naming what is missing",
        in_hash=False,
    )
    # Ray, elastic EP: placement group + actor + warm engine launcher, their resources held.
    ray_warm_ranks: Annotated[int, Meta(ge=0)] = option(
        0,
        help="Ray, elastic EP: ranks kept started ahead (their resources held) so a "
        "scale-up takes them at once",
        in_hash=False,
    )
    # The rank's placement group's CPU bundle.
    ray_cpus_per_rank: Annotated[int, Meta(ge=1)] = option(
        1,
        help="Ray: logical CPUs each rank reserves on its node; on CPU the rank's engine "
        "runs that many threads",
        in_hash=False,
    )

    def __post_init__(self) -> None:
        check_options(self)

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
        EPLB). Excluded (``in_hash=False``): what differs per rank or host, what is the
        frontend's alone, and ``data_parallel_size``: that is the launch size, the live
        size is the topology's (docs/architecture.md#elastic-identity), so an engine
        joining a grown or shrunk deployment still matches."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if not f.metadata.get("in_hash", True):
                del d[f.name]
        return _digest(d)


@dataclass(frozen=True)
class FrontendConfig:
    """What one request may ask for. Checked where requests enter (the HTTP server, ``LLM``,
    ``AsyncLLM``); the engine re-checks the sizes (``check_sizes``) of what it is handed.
    Each is a flag of the same name because a deployment may need to raise it."""

    # OpenAI's own cap on ``n``; every choice is a sequence in the scheduler.
    max_n: Annotated[int, Meta(ge=1)] = option(128, help="most choices (n) one request may ask for")
    # A batch is one HTTP call, but each prompt is ``n`` engine requests.
    max_prompts_per_request: Annotated[int, Meta(ge=1)] = option(
        256, help="most prompts in one /v1/completions request"
    )
    # vLLM's flag and default (completion and prompt logprobs).
    max_logprobs: Annotated[int, Meta(ge=1)] = option(
        20, help="most top logprobs per position a request may ask for"
    )
    # Each is an engine request, however the call spells it (256 prompts x n=128 would be
    # 32,768 of them).
    max_choices_per_request: Annotated[int, Meta(ge=1)] = option(
        1024, help="most choices one request may ask for: prompts x n"
    )
    # Stop strings are matched against every new piece of text of every choice, on the
    # server's event loop: their number and length bound that work per token.
    max_stop_strings: Annotated[int, Meta(ge=1)] = option(
        64, help="most stop strings one request may give"
    )
    max_stop_string_length: Annotated[int, Meta(ge=1)] = option(
        1024, help="longest stop string, in characters"
    )
    # Deduplicated once accepted; every choice carries them to the engine, which keeps
    # them as a set.
    max_stop_token_ids: Annotated[int, Meta(ge=1)] = option(
        1024, help="most stop_token_ids one request may give"
    )
    # A prompt of a 128k-token context is under 1 MiB of JSON, as text or as token ids;
    # 8 MiB leaves room for batches and long chats and refuses a flood before it is read.
    max_request_body_bytes: Annotated[int, Meta(ge=1)] = option(
        8 * 1024 * 1024, help="largest HTTP request body; a larger one gets 413 unread"
    )
    # vLLM's flag. Off: a template is code, run by anyone who can send a request.
    trust_request_chat_template: bool = option(
        False,
        help="accept a chat_template in chat requests (rendered in a sandboxed, "
        "time-bounded worker process)",
    )
    # vLLM's flags and parser names (docs/operations.md#tool-calling-and-reasoning); the
    # parsers are the registries of tidal/launch/tool_parsers.py and reasoning.py.
    chat_template: str | None = option(
        None,
        help="chat template replacing the tokenizer's: a file, or the Jinja text itself",
    )
    tool_call_parser: Literal["hermes", "deepseek_v3"] | None = option(
        None,
        help="parse the model's own tool calls (tool_choice auto) in this format "
        "(hermes: Qwen's <tool_call> JSON)",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = option(
        None,
        help="put the <think> text of chat outputs in reasoning_content (qwen3: when the "
        "output or the prompt opens <think>; deepseek_r1: always until </think>)",
    )

    # Off by default: OpenTelemetry is an optional extra (docs/operations.md#tracing).
    otlp_traces_endpoint: str | None = option(
        None,
        help="send one OpenTelemetry span per request to this OTLP/HTTP traces URL "
        "(e.g. http://collector:4318/v1/traces; needs pip install 'tidal[otel]')",
    )

    def __post_init__(self) -> None:
        check_options(self)

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
    device: Literal["cpu", "cuda"] = option(
        "cpu", arg_default="auto", help="where the engines run (auto: cuda when available)"
    )
    moe_backend: Literal["auto", "torch", "triton", "reference"] = option(
        "auto", help="the MoE experts' kernels (auto: triton on CUDA, else torch)"
    )
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    # vLLM's flag (docs/architecture.md#cuda-graphs).
    enforce_eager: bool = option(
        False, help="run every step eagerly: no decode graphs (/stats counts why each step missed)"
    )
    # Decode graphs' implementation (tidal/executor/graphs.py). "emulated" runs on CPU: it
    # replays the eager step on the graphs' static buffers, for tests and rehearsals.
    graph_backend: Literal["auto", "cuda", "emulated"] = option(
        "auto",
        help="how decode steps replay as graphs: cuda = torch.cuda.CUDAGraph per padded "
        "batch size; emulated = the CPU stand-in (the eager step on the graphs' static "
        "buffers, which it checks never move); auto = cuda on CUDA, none on CPU",
    )
    # CPU: which path serves each op (tidal/kernels/select.py, whose ``MODES`` these are).
    # Not in the config hash: every path gives the same tokens, and ranks may differ
    # (their CPUs may).
    cpu_kernels: Literal["auto", "native", "onednn", "torch"] = option(
        "auto",
        help="the CPU path of every op (auto: each op's paths are timed at load on the "
        "model's shapes, the fastest kept, the timings cached); the others force one: "
        "native = the C++ kernels, onednn = oneDNN prepacked, torch = plain torch",
    )
    # Resolved: None is no cache (the user's None is the default folder, "" none).
    kernel_cache_dir: str | None = option(
        None,
        help="where the measured CPU kernel choices are cached (default: "
        "$XDG_CACHE_HOME/tidal/kernels; '' for none)",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def with_parallel(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, **changes))

    @property
    def kv_cache_torch_dtype(self) -> Any:
        """The dtype every KV cache of this deployment is allocated in (``--kv-cache-dtype``
        resolved against the model's)."""
        return self.cache.torch_dtype(self.model.torch_dtype)

    def config_hash(self) -> str:
        """What an engine joining the deployment must share with it (the startup
        handshake compares it): the model (architecture and config.json, not its path,
        which may differ per host), dtype, max_model_len, KV block size and dtype, MoE backend flag
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
                "kv_cache_dtype": str(self.kv_cache_torch_dtype).removeprefix("torch."),
                "moe_backend": self.moe_backend,
            }
        )


def engine_options() -> list[OptionSpec]:
    """Every engine option (``EngineArgs``' fields, the engine ``--flags``), in the order
    ``--help`` lists them."""
    classes = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig)
    return [s for cls in (*classes, FrontendConfig) for s in option_specs(cls)]


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# config.json keys that name where or by what the checkpoint was saved, not the model.
_HF_CONFIG_IGNORED = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def _hf_config_fields(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:  # a test's stand-in config
        return {}
    return {k: v for k, v in to_dict().items() if k not in _HF_CONFIG_IGNORED}
