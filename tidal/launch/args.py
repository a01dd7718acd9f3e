"""The engine's command-line flags: every ``EngineArgs`` field becomes a ``--kebab-case``
flag (aliases and help below), and argparse errors name the flag.

Shared by ``launch`` (spawn.py) and ``tidal generate`` (cli.py); it lives apart from both
so neither imports the other for it (cli dispatches to spawn).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

from tidal.config import EngineConfig
from tidal.launch.api_key import read_secret_file
from tidal.launch.engine_args import ALL2ALL_BACKENDS, AUTH_KEY_ENV, EngineArgs
from tidal.protocol.messages import ENGINE_STALL_TIMEOUT_S

_ALIASES = {
    "data_parallel_size": ["--dp"],
    "tensor_parallel_size": ["-tp"],
    "enable_expert_parallel": ["--ep"],
    "num_gpu_blocks_override": ["--num-kv-blocks"],
}
_HELP = {
    "model": "Hugging Face checkpoint folder (default: the embedded tiny Qwen3-MoE model)",
    "tokenizer": "tokenizer folder (default: --model)",
    "generation_config": "where the default sampling values come from (temperature, top_p, "
    "top_k, min_p, repetition_penalty; max_new_tokens caps an unset max_tokens): auto (the "
    "model's generation_config.json, as vLLM) | none (temperature 1, no top-k/top-p) | a "
    "folder holding a generation_config.json",
    "dtype": "auto | float32 | float16 | bfloat16 (auto: the checkpoint's dtype)",
    "seed": "random seed of each engine process",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory_bytes": "KV cache bytes per rank",
    "num_gpu_blocks_override": "KV cache blocks per rank (overrides --kv-cache-memory-bytes)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "max_num_batched_tokens": "token budget of one step (default: 2048)",
    "max_num_seqs": "most requests running at once per rank",
    "enable_chunked_prefill": "split long prompts across steps",
    "data_parallel_size": "number of data-parallel engine ranks",
    "data_parallel_rank": "this process's rank (set per spawned engine; rarely by hand)",
    "data_parallel_size_local": "ranks started on this host (default: all of them)",
    "data_parallel_start_rank": "first rank started on this host (with --headless)",
    "data_parallel_address": "host the frontend and rank 0's groups listen on",
    "data_parallel_rpc_port": "frontend handshake port headless ranks connect to (0: pick)",
    "data_parallel_master_port": "TCPStore port of the DP/EP process groups (0: pick)",
    "tensor_parallel_size": "worker processes (devices) per data-parallel rank, each with a "
    "shard of the model (attention heads, dense MLP, vocabulary; MoE experts' intermediate "
    "dimension, or with --ep the experts, over every rank's workers)",
    "enable_expert_parallel": "shard MoE experts across the data-parallel ranks (and their "
    "tensor-parallel workers)",
    "enable_elastic_ep": "elastic expert parallelism: the deployment can grow and shrink "
    "while serving; runs the DP coordinator and wave loop even with one rank",
    "elastic_restore": "elastic EP: after a rank died and the deployment recovered without "
    "it, scale back up to the size it had (a new rank, by the normal scale-up path)",
    "rank_recovery": "data parallel: survive the loss of ranks or hosts -- the dead ranks "
    "are removed while the others serve and their requests move (default on; "
    "--no-rank-recovery: a rank death fails every request, for an outside restart)",
    "engine_stall_timeout": "seconds a rank's busy loop may stay inside one step (not "
    "waiting on its peers) before it counts as stuck, is killed and recovered from "
    f"(0: no watchdog; default {ENGINE_STALL_TIMEOUT_S:g})",
    "all2all_backend": "expert-parallel token exchange: " + " | ".join(ALL2ALL_BACKENDS),
    "enable_eplb": "rebalance experts across ranks from their measured load",
    "num_redundant_experts": "extra physical expert copies for EPLB to place",
    "eplb_window": "steps of expert load EPLB plans from",
    "eplb_interval": "steps between EPLB rebalances",
    "dp_lb_policy": "request routing across ranks: tidal | tidal-p2c | vllm",
    "data_parallel_auth_key": "shared secret that authenticates the DP control plane over "
    f"TCP; the same on every host, required with --headless ranks (default: ${AUTH_KEY_ENV}); "
    "visible in ps, prefer --data-parallel-auth-key-file or the variable",
    "data_parallel_backend": "where engine ranks run: mp (local processes; other hosts "
    "with --headless) | ray (one Ray actor per rank in its own placement group, on the "
    "cluster of --ray-address; pip install 'tidal[ray]')",
    "ray_address": "Ray cluster to run the ranks on (auto | host:port | ray://host:port; "
    "default: $RAY_ADDRESS, else a local cluster started for this deployment)",
    "ray_placement_timeout_s": "Ray: seconds a rank's placement group may wait for "
    "resources before the launch or scale-up fails naming what is missing",
    "ray_warm_ranks": "Ray, elastic EP: ranks kept started ahead (their resources held) "
    "so a scale-up takes them at once",
    "ray_cpus_per_rank": "Ray: logical CPUs each rank reserves on its node; on CPU the "
    "rank's engine runs that many threads",
    "device": "auto | cpu | cuda",
    "moe_backend": "auto | torch | triton | reference (auto: triton on CUDA, else torch)",
    "cpu_kernels": "auto | native | onednn | torch: the CPU path of every op (auto: each "
    "op's paths are timed at load on the model's shapes, the fastest kept, the timings "
    "cached); the others force one: native = the C++ kernels, onednn = oneDNN prepacked, "
    "torch = plain torch",
    "cpu_affinity": "auto | off | explicit groups, one per local rank (0-7|8-15): pin each "
    "CPU rank's threads to its own group of cores, shared by its TP workers (auto: where "
    "the host runs several ranks, with at least a core for each of their workers)",
    "kernel_cache_dir": "where the measured CPU kernel choices are cached (default: "
    "$XDG_CACHE_HOME/tidal/kernels; '' for none)",
    "max_n": "most choices (n) one request may ask for",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "max_logprobs": "most top logprobs per position a request may ask for",
    "max_choices_per_request": "most choices one request may ask for: prompts x n",
    "max_stop_strings": "most stop strings one request may give",
    "max_stop_string_length": "longest stop string, in characters",
    "max_stop_token_ids": "most stop_token_ids one request may give",
    "max_request_body_bytes": "largest HTTP request body; a larger one gets 413 unread",
    "trust_request_chat_template": "accept a chat_template in chat requests (rendered in a "
    "sandboxed, time-bounded worker process)",
}

_ENV_DEFAULTS = {"data_parallel_auth_key": AUTH_KEY_ENV}
# Secrets that may come from a file instead (``--<flag>-file``), out of the process list.
_FILE_FLAGS = ("data_parallel_auth_key",)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        names = [flag, *_ALIASES.get(f.name, [])]
        hint = hints[f.name]
        help_ = _HELP.get(f.name)
        # Secrets come from the environment here and only here; the config carries them on.
        default = (
            os.environ.get(_ENV_DEFAULTS[f.name], f.default)
            if f.name in _ENV_DEFAULTS
            else f.default
        )
        if hint is bool:
            parser.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
            )
        else:
            parser.add_argument(
                *names, dest=f.name, type=_scalar(hint), default=default, help=help_
            )
        if f.name in _FILE_FLAGS:
            parser.add_argument(
                f"{flag}-file",
                dest=f"{f.name}_file",
                default=None,
                metavar="PATH",
                help=f"read {flag} from this file (its first line), out of the process list",
            )


def _scalar(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return base if base in (int, float, str) else str


def _read_secret_files(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Fills each ``_FILE_FLAGS`` field from its file when one is given; the file wins
    over the environment variable, like a flag does, but not over the flag itself."""
    for name in _FILE_FLAGS:
        path = getattr(ns, f"{name}_file", None)
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        given = getattr(ns, name)
        if given != parser.get_default(name):  # the flag itself (its default: the variable)
            parser.error(f"{flag}-file: give either {flag} or {flag}-file, not both")
        setattr(ns, name, read_secret_file(parser, f"{flag}-file", path))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def build_engine_config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> EngineConfig:
    """EngineArgs -> EngineConfig, turning validation errors into CLI errors naming the flag.
    Secrets given as files are read here, into ``ns``."""
    _read_secret_files(parser, ns)
    try:
        return engine_args_from(ns).create_engine_config()
    except ValueError as e:
        field = str(e).split(" ", 1)[0].rstrip(":")
        flag = "--" + field.replace("_", "-")
        parser.error(f"{flag}: {e}" if hasattr(EngineArgs, field) else str(e))
