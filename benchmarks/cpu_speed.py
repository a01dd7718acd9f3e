"""CPU speed of Tidal vs transformers and vLLM-CPU, in one run, on the peer checkpoints
(same prompts, greedy, float32; outputs checked against transformers),
with every CPU path of Tidal's and the machine's memory bandwidth measured in the same run.

    python benchmarks/cpu_speed.py --vllm-python ~/.cache/tidal-peers/vllm/bin/python
    python benchmarks/cpu_speed.py --models tiny --paths auto,torch --skip-kernels
    python benchmarks/cpu_speed.py --models big --rounds 3 --skip-e2e   # kernels only
    python benchmarks/cpu_speed.py --dtype fp8 --models moe64 --rounds 3

Checkpoints (built once under ``--peers-dir``): tiny Qwen3-MoE (H256, 4 layers, 16 experts
top-4) and big (H1024, 8 layers, 32 experts top-4, I512) by ``benchmarks/peers/
make_models.py``, and ``moe64`` (H512, 8 layers, 64 experts top-8, I256), made here with
the same recipe (a shape class held back from tuning). Each engine runs in its own process
with the peer harness of ``benchmarks/peers/``: 1 stream x 128 new tokens, and 32
requests x 64 new tokens, ``--rounds`` rounds, medians reported. vLLM runs only with
``--vllm-python`` (its own venv), with the settings of ``env_vllm.sh``. Both return token
ids only (vLLM: ``detokenize=False``; Tidal the same flag, unless ``--tidal-detokenize``).

Tidal runs once per ``--paths`` entry: ``auto`` (the default: each op's path measured at
load, ``tidal/kernels/select.py``, into a kernel-choice cache private to this run, so the
first start's trial is in its ready time) and each forced path (``--cpu-kernels native |
onednn | torch``). The goals are checked from the same run: the default
within 5% of Tidal's fastest path, single and batch; >= 1.2x vLLM batch and >= 1.0x vLLM
single (big, moe64); never slower than transformers; >= 75% of the measured bandwidth at
batch 1 for the MoE and linear kernels.

Printed as one JSON document:

- ``machine``: CPU model and flags (/proc/cpuinfo), cores, torch, the load average at the
  start and the end (2 shared cores: numbers move with it);
- ``e2e``: per model and engine (``tidal_<path>``), tok/s single and batch (medians), time
  to ready, greedy outputs vs transformers; ``choices``: the default's path per op with
  the trial's timings; ``ratios`` and ``goals``;
- ``kernels``: batch-1 bandwidth of the linear (a pool of 1024x1024 weights) and of the
  MoE experts (64 experts of the big shape, 4 random a call) on every path and prefetch
  hint, interleaved round by round with a 1 GiB ``sum`` (the machine's read bandwidth):
  GB/s and the fraction of the sum's; the path the selection would take, and its fraction;
- ``moe_block``: the MoE layer (router + experts) on layer 0 of each checkpoint, ms per
  call at 1, 32 and 256 tokens, on every path; with vLLM, its ``cpu_fused_moe``;
- ``gemm``: GFLOP/s of [M, 1024] x [1024, 1024] through MKL, oneDNN prepacked and the C++
  linear with each hint;
- ``roofline``: bytes a batch-32 decode step of the big model reads, the tok/s the
  bandwidth allows, and the default's batch tok/s as a fraction of it; the measured decode
  step against the bandwidth floor, and the batch's prefill in GFLOP/s (against the best
  ``gemm`` rate where that ran): the two phases of the batch run, each near its own limit;
- ``memory``: per model, the default engine in a fresh process (in-process ``LLM``): VmRSS
  after serving and the peak (``ru_maxrss``) against checkpoint bytes + KV cache; the
  same for a rank's own process, with its private bytes (USS) and what it holds above the
  runtime floor (a process that has only imported the engine);
- ``--dtype fp8`` (``main_fp8``): per model, the bf16 cast quantized to FP8 in 128x128
  blocks (DeepSeek-V3's layout) and that dequantized to bf16; ``e2e``: Tidal FP8, Tidal
  bf16 and transformers bf16 (the last two on the dequantized weights), single and batch,
  the FP8/bf16 ratio per round and its median, the goal (single >= 1.5x), each Tidal's
  measured choices; no other section;
- ``step_overhead``: Tidal in-process on the big model, batch 32 decode: per step,
  ``execute_model`` and the rest; the forward's parts; the median decode step, and the
  batch run's prefill (32 x 32 tokens) timed alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import agreement  # noqa: E402 - a sibling module
from kmp_registrations import registrations, remove_dead  # noqa: E402 - a sibling module

PEERS_SCRIPTS = HERE / "peers"
MODELS = {"tiny": "tiny-qwen3-moe", "big": "big-qwen3-moe", "moe64": "moe64-qwen3-moe"}
# The 64-expert top-8 checkpoint: the recipe of make_models.py, another shape.
MOE64 = {
    "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 64, "num_experts_per_tok": 8,
}  # fmt: skip
TIDAL_PATHS = ("auto", "native", "onednn", "torch")
DTYPES = ("float32", "bfloat16", "fp8")
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2}


def log(msg: str) -> None:
    print(f"[cpu_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _section(name: str, part: Any) -> None:
    """A finished section on stderr: a run stopped before its end keeps what it measured."""
    log(f"{name}: {json.dumps(part)}")


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


# ------------------------------------------------------------------ checkpoints


def ensure_models(peers: Path, tags: list[str]) -> dict[str, Path]:
    paths = {tag: peers / MODELS[tag] for tag in tags}
    env = {**os.environ, "PEERS": str(peers)}
    made = []
    if any(not (paths[t] / "tokenizer.json").exists() for t in tags if t in ("tiny", "big")):
        log(f"building the tiny and big checkpoints under {peers}")
        subprocess.run(
            [sys.executable, PEERS_SCRIPTS / "make_models.py"],
            env=env,
            check=True,
            stdout=sys.stderr,  # stdout carries the JSON document only
        )
        made += [peers / MODELS["tiny"], peers / MODELS["big"]]
    if "moe64" in tags and not (paths["moe64"] / "tokenizer.json").exists():
        log(f"building the 64-expert checkpoint under {peers}")
        make_moe64(paths["moe64"])
        made.append(paths["moe64"])
    if made:
        subprocess.run(
            [sys.executable, PEERS_SCRIPTS / "make_tokenizer.py", *map(str, made)],
            env=env,
            check=True,
            stdout=sys.stderr,
        )
    return paths


def make_moe64(path: Path) -> None:
    """make_models.py's recipe (config fields, seeding, fp32, fixed-length generation)
    at the ``MOE64`` shape."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(8642)
    cfg = Qwen3MoeConfig(
        vocab_size=4096, max_position_embeddings=2048, hidden_act="silu", rms_norm_eps=1e-6,
        initializer_range=0.02, tie_word_embeddings=False, attention_bias=False,
        use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, output_router_logits=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        dtype="float32", **MOE64,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path), safe_serialization=True)


# ------------------------------------------------------------------ end to end


@contextlib.contextmanager
def _private_tmpdir(env: dict[str, str] | None) -> Iterator[dict[str, str]]:
    """``env`` (else this process's) with TMPDIR a fresh directory, removed afterwards: a
    peer's leftovers go with it (vLLM leaves its ipc:// socket files in the temp
    directory, a few per run)."""
    tmp = tempfile.mkdtemp(prefix="cpu-speed-")
    kmp_before = registrations()
    try:
        yield {**(os.environ if env is None else env), "TMPDIR": tmp}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_dead(registrations() - kmp_before)  # the peer has exited: no wait


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    with _private_tmpdir(env) as child_env:
        return subprocess.run(cmd, env=child_env, capture_output=True, text=True)


def _run_json(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = _run(cmd, env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{cmd[1]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _vllm_env(peers: Path) -> dict[str, str]:
    """The exports of env_vllm.sh, applied to this environment."""
    script = f"export PEERS={peers}; . {PEERS_SCRIPTS / 'env_vllm.sh'}; env -0"
    raw = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and os.path.exists(p)]
    env["LD_PRELOAD"] = ":".join(preload)  # a missing tcmalloc is optional
    return env


def run_e2e(
    tag: str, model: Path, opts: argparse.Namespace, results: Path, kernel_cache: Path
) -> dict[str, Any]:
    ref = results / f"hf_{tag}.json"
    engines = ["transformers", *(["vllm"] if opts.vllm_python else []), *_tidal_names(opts)]
    rows: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for r in range(opts.rounds):
        if r < opts.peer_rounds:  # --peer-rounds (at least round 0: the reference)
            _peer_round(tag, model, opts, results, r, ref, rows)
        _tidal_round(tag, model, opts, results, kernel_cache, r, ref, rows)
    summary = {k: _median_rows(v) for k, v in rows.items() if v}
    default = summary.get("tidal_auto")
    ratios: dict[str, Any] = {}
    if default:
        for peer in ("vllm", "transformers"):
            if peer in summary:
                ratios[f"default_over_{peer}"] = _ratio_pair(default, summary[peer])
        own = [summary[n] for n in _tidal_names(opts)]
        best = {k: max(e[k] for e in own) for k in ("single", "batch")}
        ratios["default_over_best_own_path_of_medians"] = _ratio_pair(default, best)
        # Paired: each round's default against that round's best own path, minutes
        # apart at most, then the median over rounds. The machine's bandwidth drifts by
        # up to 40% between minutes, which the medians of far-apart runs keep.
        ratios["default_over_best_own_path"] = _paired_ratio(rows, _tidal_names(opts))
    return {
        "engines": summary,
        "ratios": ratios,
        "goals": _goals(tag, ratios),
        "choices": _choices(kernel_cache, list(results.glob(f"tidal_{tag}_auto_r*.json"))),
    }


def _peer_round(
    tag: str,
    model: Path,
    opts: argparse.Namespace,
    results: Path,
    r: int,
    ref: Path,
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    """Round ``r`` of transformers and (``--vllm-python``) vLLM on ``model``, into ``rows``;
    round 0 writes ``ref``, the prompts and outputs every engine is checked against."""
    py = sys.executable
    log(f"{tag}: round {r + 1}/{opts.rounds}: transformers")
    out = results / f"hf_{tag}_r{r}.json"
    hf = _run_json(
        [py, str(PEERS_SCRIPTS / "bench_hf.py"), "--model", str(model), "--skip", "bvar",
         "--out", str(out), "--dtype", opts.engine_dtype],
        out,
    )  # fmt: skip
    if r == 0:  # this run's prompts and reference outputs (the checkpoint may be new)
        ref.write_text(out.read_text())
    rows["transformers"].append(
        {"single": hf["a_single"]["tok_per_s"], "batch": hf["b_batch"]["out_tok_per_s"]}
    )
    if opts.vllm_python:
        log(f"{tag}: round {r + 1}: vLLM-CPU")
        out = results / f"vllm_{tag}_r{r}.json"
        v = _run_json(
            [opts.vllm_python, str(PEERS_SCRIPTS / "bench_vllm.py"), "--model", str(model),
             "--hf-ref", str(ref), "--out", str(out), "--dtype", opts.engine_dtype],
            out,
            env=_vllm_env(opts.peers_dir),
        )  # fmt: skip
        rows["vllm"].append(_engine_row(v))


def _tidal_round(
    tag: str,
    model: Path,
    opts: argparse.Namespace,
    results: Path,
    kernel_cache: Path,
    r: int,
    ref: Path,
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    """Round ``r`` of every Tidal path (``--paths``) on ``model``, into ``rows``."""
    # Rotated each round: no path always runs first (or right after vLLM's exit).
    for path in opts.paths[r % len(opts.paths) :] + opts.paths[: r % len(opts.paths)]:
        log(f"{tag}: round {r + 1}: Tidal, --cpu-kernels {path}")
        out = results / f"tidal_{tag}_{path}_r{r}.json"
        rows[f"tidal_{path}"].append(_tidal_run(model, path, opts, out, kernel_cache, ref))


def _tidal_run(
    model: Path, path: str, opts: argparse.Namespace, out: Path, kernel_cache: Path, ref: Path
) -> dict[str, Any]:
    """One bench_tidal.py run of ``model`` with ``--cpu-kernels path``: its engine row."""
    extra = {"cpu_kernels": path, "kernel_cache_dir": str(kernel_cache)}
    t = _run_json(
        [sys.executable, str(PEERS_SCRIPTS / "bench_tidal.py"), "--model", str(model),
         "--hf-ref", str(ref), "--out", str(out), "--detokenize",
         str(int(opts.tidal_detokenize)), "--dtype", opts.engine_dtype, "--extra",
         json.dumps(extra)],
        out,
    )  # fmt: skip
    return _engine_row(t)


def _paired_ratio(rows: dict[str, list[dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """Median over rounds of the default's tok/s over the best own path's in that round."""
    out: dict[str, Any] = {}
    for k in ("single", "batch"):
        per_round = []
        for r, row in enumerate(rows["tidal_auto"]):
            best = max((rows[n][r].get(k) or 0.0) for n in names if len(rows[n]) > r)
            if row.get(k) and best:
                per_round.append(row[k] / best)
        out[k] = _r(statistics.median(per_round)) if per_round else None
        out[f"{k}_per_round"] = [_r(x) for x in per_round]
    return out


def _tidal_names(opts: argparse.Namespace) -> list[str]:
    return [f"tidal_{p}" for p in opts.paths]


def _ratio_pair(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {k: _r(a[k] / b[k]) if a.get(k) and b.get(k) else None for k in ("single", "batch")}


def _goals(tag: str, ratios: dict[str, Any]) -> dict[str, bool | None]:
    """The end-to-end goals, as this run measured them."""

    def at_least(key: str, part: str, bound: float) -> bool | None:
        v = ratios.get(key, {}).get(part)
        return None if v is None else v >= bound

    goals = {
        "default_within_5pct_of_best_single": at_least(
            "default_over_best_own_path", "single", 0.95
        ),
        "default_within_5pct_of_best_batch": at_least("default_over_best_own_path", "batch", 0.95),
        "not_slower_than_transformers_single": at_least("default_over_transformers", "single", 1.0),
        "not_slower_than_transformers_batch": at_least("default_over_transformers", "batch", 1.0),
    }
    if tag != "tiny":  # the vLLM goals are on big and the 64-expert checkpoint
        goals["vllm_batch_ge_1.2x"] = at_least("default_over_vllm", "batch", 1.2)
        goals["vllm_single_ge_1.0x"] = at_least("default_over_vllm", "single", 1.0)
    return goals


def _choices(kernel_cache: Path, run_outputs: list[Path]) -> dict[str, Any]:
    """The default's path per op and the trial's timings, from the run's private kernel
    choice cache (the same decision ``select.decide`` makes from them at load). When the
    trials were not cached (the machine was oversubscribed while they ran, so every start
    measured again), what the newest of ``run_outputs`` reports served instead."""
    from tidal.kernels.select import Candidate, decide

    out: dict[str, Any] = {}
    for file in sorted(kernel_cache.glob("cpu-kernels-*.json")):
        doc = json.loads(file.read_text())
        for op, timings in doc.get("ops", {}).items():
            cands = [Candidate.parse(n) for n in timings.get("decode", {})]
            weights = op.startswith(("linear", "moe", "router", "fp8_"))
            c = decide(cands, timings, holds_weights=weights)
            out[op] = {**{k: v.name for k, v in c.by_class().items()}, "timings_ms": timings}
        out["_cpu"] = doc.get("fingerprint", {}).get("cpu_model")
    if out:
        return out
    for file in sorted(run_outputs, key=lambda f: f.stat().st_mtime, reverse=True):
        kernels = json.loads(file.read_text()).get("cpu_kernels") or [None]
        report = kernels[0]  # rank 0's
        if report:
            out = {
                op: {k: c.get(k) for k in ("decode", "batch", "prefill", "timings_ms")}
                for op, c in report["ops"].items()
            }
            out["_cpu"] = report.get("cpu")
            out["_source"] = f"{file.name}: trials not cached (machine oversubscribed)"
            return out
    return out


def _engine_row(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "single": d["a_single"]["tok_per_s"],
        "batch": d["b_batch"]["out_tok_per_s"],
        "ready_s": d.get("init_s"),
        "single_identical": d.get("a_identical"),
        "batch_rows_identical": d.get("b_rows_identical"),
    }


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if isinstance(rows[0][key], bool):
            out[key] = all(r[key] for r in rows)
        elif vals:
            out[key] = _r(statistics.median(vals), 2)
    out["rounds"] = len(rows)
    return out


# ------------------------------------------------------------------ kernels


def _timeit(fn: Any, budget_s: float = 0.3) -> float:
    """Median ms per call of 3 repetitions of ~budget_s each (after a warm-up)."""
    for _ in range(3):
        fn()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    iters = max(3, int(budget_s / max(one, 1e-6)))
    reps = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        reps.append((time.perf_counter() - t) / iters)
    return statistics.median(reps) * 1e3


def _forced_layer_paths() -> list[Any]:
    """Every candidate path of a weight-holding op here (select.py's list)."""
    import torch

    from tidal.kernels.select import weight_candidates

    return weight_candidates(torch.float32)


def moe_block(model: Path, opts: argparse.Namespace, results: Path) -> dict[str, Any]:
    """Router + experts of layer 0 (``FusedMoE`` on each path), as
    ``bench_vllm_moe_kernel.py`` times vLLM's."""
    import torch
    from safetensors import safe_open

    from tidal.kernels.fused_moe_torch import k_major_experts
    from tidal.kernels.select import Choice
    from tidal.moe.layer import FusedMoE
    from tidal.moe.reference import fused_experts_reference
    from tidal.moe.router import softmax_topk

    torch.set_num_threads(opts.threads)
    cfg = json.loads((model / "config.json").read_text())
    n_exp, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    pre = "model.layers.0.mlp."
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        gate_w = f.get_tensor(pre + "gate.weight").contiguous()

        def stack(part: str) -> Any:
            return torch.stack(
                [f.get_tensor(f"{pre}experts.{e}.{part}.weight") for e in range(n_exp)]
            )

        w13 = torch.cat([stack("gate_proj"), stack("up_proj")], 1).contiguous()
        w2 = stack("down_proj").contiguous()
    layers = {}
    for cand in _forced_layer_paths():
        layer = FusedMoE(n_exp, top_k, cfg["hidden_size"], w2.shape[2], renormalize=True)
        layer.w13.data, layer.w2.data = k_major_experts(w13, w2)
        layer.gate.data.copy_(gate_w)
        for op in ("experts", "router"):
            layer.set_cpu_path(op, Choice.fixed(cand, cand.path))
        layer.pack_weights()
        layers[cand.name] = layer
    rows: dict[str, Any] = {}
    for tokens in (1, 32, 256):
        x = torch.randn(
            1, tokens, cfg["hidden_size"], generator=torch.Generator().manual_seed(tokens)
        )[0]
        with torch.inference_mode():
            tw, ti = softmax_topk(x @ gate_w.T, top_k, True)
            want = fused_experts_reference(x, w13, w2, tw, ti)
            ms = {name: _timeit(lambda x=x, m=m: m(x)) for name, m in layers.items()}
            err = max((m(x) - want).abs().max().item() for m in layers.values())
        rows[tokens] = {"tidal_ms": {k: _r(v) for k, v in ms.items()}, "max_abs_err": err}
        rows[tokens]["tidal_best_ms"] = _r(min(ms.values()))
        log(
            f"moe block {model.name} T={tokens}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
        )
    if opts.vllm_python:
        out = results / f"vllm_moe_kernel_{model.name}.json"
        proc = _run(
            [opts.vllm_python, str(PEERS_SCRIPTS / "bench_vllm_moe_kernel.py"), str(model),
             str(out)],
            _vllm_env(opts.peers_dir),
        )  # fmt: skip
        if proc.returncode == 0 and out.exists():
            per_t = json.loads(out.read_text())["per_T"]
            for tokens, row in rows.items():
                v = per_t[str(tokens)]
                row["vllm_block_ms"] = _r(v["block_median_ms"])
                row["tidal_best_over_vllm_time"] = _r(row["tidal_best_ms"] / v["block_median_ms"])
        else:
            log(f"vLLM's MoE kernel bench failed: {proc.stderr[-2000:]}")
    return rows


def gemm(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tidal.kernels.cpu_ext import PREFETCH_HINTS, kernel_available
    from tidal.kernels.cpu_linear import linear_cpu, pack_linear_weight

    torch.set_num_threads(opts.threads)
    out: dict[str, Any] = {}
    for m in (1, 4, 32, 256):
        x, w = torch.randn(m, 1024), torch.randn(1024, 1024)
        wt = w.t().contiguous()
        flops = 2 * m * 1024 * 1024
        mkl = _timeit(lambda x=x, wt=wt: torch.mm(x, wt), 0.1)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        dnn = _timeit(
            lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
            0.1,
        )
        out[m] = {"mkl_gflops": _r(flops / mkl / 1e6, 1), "onednn_gflops": _r(flops / dnn / 1e6, 1)}
        if kernel_available():  # the C++ linear, each prefetch hint
            ours = pack_linear_weight(w)
            for hint, code in PREFETCH_HINTS.items():
                ms = _timeit(lambda x=x, p=ours, c=code: linear_cpu(x, p, 1024, None, c), 0.1)
                out[m][f"tidal_cpp_{hint}_gflops"] = _r(flops / ms / 1e6, 1)
    return out


def kernel_bandwidth(opts: argparse.Namespace) -> dict[str, Any]:
    """Batch 1, weights streamed from memory: a pool of linear weights (1024x1024, 4 MiB
    each) read once per pass, and the experts of a 64-expert layer of the big shape (H1024,
    I512) of which each call reads 4 at random (as a decode step does), on every path and
    hint, interleaved with a 1 GiB ``sum`` round by round; GB/s of weights read, and each
    round's fraction of the sum's bandwidth (the median reported)."""
    import random

    import torch

    from tidal.kernels.cpu_ext import PREFETCH_HINTS
    from tidal.kernels.cpu_paths import HeldExperts, HeldLinear
    from tidal.kernels.fused_moe_torch import fused_experts_torch, k_major_experts
    from tidal.kernels.select import CLASSES, Candidate, decide

    torch.set_num_threads(opts.threads)
    buf = torch.ones(256 * 1024 * 1024)  # 1 GiB float32
    n_lin, k = opts.pool_matrices, 1024
    base = torch.randn(k, k) * 0.03
    lin: dict[str, Any] = {"torch": [base.t().contiguous().t().clone() for _ in range(n_lin)]}
    held = {p: [HeldLinear(p, base) for _ in range(n_lin)] for p in ("native", "onednn")}
    experts, hidden, inter, top_k = 64, 1024, 512, 4
    w13 = torch.randn(experts, 2 * inter, hidden) * 0.03
    w2 = torch.randn(experts, hidden, inter) * 0.03
    k13, k2 = k_major_experts(w13, w2)
    moe_held = {p: HeldExperts(p, w13, w2) for p in ("native", "onednn")}
    del w13, w2
    x1, xh = torch.randn(1, k), torch.randn(1, hidden)
    rng = random.Random(0)
    picks = [rng.sample(range(experts), top_k) for _ in range(16)]
    routes = [(torch.full((1, top_k), 1 / top_k), torch.tensor([p])) for p in picks]
    expert_bytes = 3 * hidden * inter * 4

    def linear_pass(name: str) -> float:
        path, _, hint = name.partition(":")
        t = time.perf_counter()
        if path == "torch":
            for w in lin["torch"]:
                torch.nn.functional.linear(x1, w)
        else:
            for h in held[path]:
                h(x1, None, hint)
        return n_lin * k * k * 4 / (time.perf_counter() - t)

    def moe_pass(name: str) -> float:
        path, _, hint = name.partition(":")
        t = time.perf_counter()
        for tw, ti in routes:
            if path == "torch":
                fused_experts_torch(xh, k13, k2, tw, ti)
            else:
                moe_held[path](xh, tw, ti, None, True, hint)
        return len(routes) * top_k * expert_bytes / (time.perf_counter() - t)

    names = [f"native:{h}" for h in PREFETCH_HINTS] + ["onednn", "torch"]
    sums: list[float] = []
    got: dict[str, dict[str, list[float]]] = {"linear": {}, "moe": {}}
    with torch.inference_mode():
        for fn in (linear_pass, moe_pass):  # warm-up: first touches, packs' pages
            for n in names:
                fn(n)
        for _ in range(opts.bandwidth_rounds):
            t = time.perf_counter()
            buf.sum()
            sums.append(buf.numel() * 4 / (time.perf_counter() - t))
            for kind, fn in (("linear", linear_pass), ("moe", moe_pass)):
                for n in names:
                    got[kind].setdefault(n, []).append(fn(n))
    out: dict[str, Any] = {"sum_gb_s": _r(statistics.median(sums) / 1e9, 1)}
    for kind, per in got.items():
        frac = {n: statistics.median(b / s for b, s in zip(v, sums)) for n, v in per.items()}
        gbs = {n: statistics.median(v) / 1e9 for n, v in per.items()}
        # What the selection keeps (decode class): the fastest here, as it measures it.
        ms = {n: 1.0 / g for n, g in gbs.items()}
        choice = decide([Candidate.parse(n) for n in names], dict.fromkeys(CLASSES, ms))
        out[kind] = {
            "gb_s": {n: _r(v, 1) for n, v in gbs.items()},
            "fraction_of_sum": {n: _r(v) for n, v in frac.items()},
            "chosen": choice.decode.name,
            "chosen_fraction_of_sum": _r(frac[choice.decode.name]),
        }
        log(f"{kind} at batch 1: " + ", ".join(f"{n} {gbs[n]:.1f} GB/s" for n in names))
    log(f"sum: {out['sum_gb_s']} GB/s")
    return out


def layer_weights(c: dict[str, Any]) -> tuple[int, int, int]:
    """Parameters of one decoder layer: the attention projections (q, k, v, o), the
    router, and one expert (gate, up, down)."""
    h = c["hidden_size"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    proj = h * (heads + 2 * kv) * hd + heads * hd * h
    return proj, c["num_local_experts"] * h, 3 * h * c["moe_intermediate_size"]


def layer_flops_per_token(c: dict[str, Any], context: int) -> float:
    """FLOPs (2 x multiply-adds) of one token through the decoder layers: projections,
    router, top-k experts, and attention over ``context`` earlier tokens (no lm_head: a
    prefill computes logits for each prompt's last token only)."""
    proj, router, expert = layer_weights(c)
    attend = 2 * c["num_attention_heads"] * c["head_dim"] * context
    experts = c["num_experts_per_tok"] * expert
    return 2.0 * c["num_hidden_layers"] * (proj + router + experts + attend)


def roofline(
    model: Path, opts: argparse.Namespace, tidal_batch: float | None, steps: dict[str, Any]
) -> dict[str, Any]:
    """The batch run's two phases against this machine's limits: a decode step streams every
    weight once (bandwidth-bound at 32 rows), the 32 x 32-token prefill is compute-bound
    (its GFLOP/s against the best GEMM rate of ``gemm``, where that section ran)."""
    import torch

    torch.set_num_threads(opts.threads)
    buf = torch.ones(256 * 1024 * 1024)  # 1 GiB float32
    sec = _timeit(buf.sum, 0.5) / 1e3
    bandwidth = buf.numel() * 4 / sec
    c = json.loads((model / "config.json").read_text())
    h = c["hidden_size"]
    proj, router, expert = layer_weights(c)
    layer = proj + router + c["num_local_experts"] * expert  # every expert: 32 rows use all
    step_bytes = WEIGHT_BYTES[opts.engine_dtype] * (
        c["num_hidden_layers"] * layer + c["vocab_size"] * h
    )
    roof = 32 * bandwidth / step_bytes  # tok/s of a batch-32 decode step at full bandwidth
    out = {
        "read_bandwidth_gb_s": _r(bandwidth / 1e9, 1),
        "batch32_step_bytes": step_bytes,
        "roofline_tok_s": _r(roof, 1),
        "tidal_batch_tok_s": tidal_batch,
        "tidal_fraction_of_roofline": _r(tidal_batch / roof) if tidal_batch else None,
    }
    if steps.get("decode_step_ms"):
        floor_ms = step_bytes / bandwidth * 1e3
        out["decode_step_floor_ms"] = _r(floor_ms)
        out["decode_step_ms"] = steps["decode_step_ms"]
        out["decode_fraction_of_roofline"] = _r(floor_ms / steps["decode_step_ms"])
    if steps.get("prefill_s"):
        tokens, prompt_len = steps["prefill_tokens"], steps["prefill_prompt_len"]
        flops = tokens * layer_flops_per_token(c, prompt_len // 2)  # causal: half on average
        flops += tokens // prompt_len * 2.0 * c["vocab_size"] * h  # one row of logits a prompt
        gflop_s = flops / steps["prefill_s"] / 1e9
        out["prefill_gflop_s"] = _r(gflop_s, 1)
        if steps.get("best_gemm_gflop_s"):
            out["prefill_fraction_of_best_gemm"] = _r(gflop_s / steps["best_gemm_gflop_s"])
    return out


def step_overhead(model: Path, opts: argparse.Namespace, kernel_cache: Path) -> dict[str, Any]:
    """In-process Tidal, 32 requests decoding: per step, execute_model vs the rest, and
    where the model's forward goes (MoE blocks, attention with its projections, norms)."""
    import torch
    from torch.nn.modules import module as nn_module

    from tidal import LLM, SamplingParams
    from tidal.layers.norm import RMSNorm
    from tidal.models.common import Attention, MoECausalLM
    from tidal.moe.layer import FusedMoE

    torch.set_num_threads(opts.threads)
    kinds = {FusedMoE: "moe", Attention: "attention", RMSNorm: "norm", MoECausalLM: "model"}
    parts = dict.fromkeys(kinds.values(), 0.0)
    started: dict[int, float] = {}

    in_add_norm = [0]  # inside RMSNorm.add_norm: its own norm call is already timed

    def pre(mod: Any, _args: Any) -> None:
        if isinstance(mod, RMSNorm) and in_add_norm[0]:
            return
        if type(mod) in kinds or isinstance(mod, MoECausalLM):
            started[id(mod)] = time.perf_counter()

    add_norm = RMSNorm.add_norm

    def timed_add_norm(self: RMSNorm, x: Any, delta: Any) -> Any:
        # The residual add + norm pass is a method, not a forward: timed as "norm" here.
        t0 = time.perf_counter()
        in_add_norm[0] += 1
        try:
            return add_norm(self, x, delta)
        finally:
            in_add_norm[0] -= 1
            parts["norm"] += time.perf_counter() - t0

    def post(mod: Any, _args: Any, _out: Any) -> None:
        t0 = started.pop(id(mod), None)
        if t0 is not None:
            kind = kinds.get(type(mod), "model")
            parts[kind] += time.perf_counter() - t0

    hooks = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post),
    ]
    RMSNorm.add_norm = timed_add_norm
    llm = LLM(
        str(model), dtype=opts.engine_dtype, multiprocess=False, kernel_cache_dir=str(kernel_cache)
    )
    try:
        engine = llm.client.engine
        timing = {"forward": 0.0, "steps": 0}
        step_ms: list[tuple[int, float]] = []  # (tokens scheduled, ms) per execute_model
        runner = engine.executor.worker.model_runner
        run = runner.execute_model

        def timed(sched: Any) -> Any:
            t = time.perf_counter()
            try:
                return run(sched)
            finally:
                dt = time.perf_counter() - t
                timing["forward"] += dt
                timing["steps"] += 1
                step_ms.append((sched.total_num_scheduled_tokens, dt * 1e3))

        runner.execute_model = timed
        prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        timing.update(forward=0.0, steps=0)
        parts.update(dict.fromkeys(parts, 0.0))
        step_ms.clear()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        decode = [ms for tokens, ms in step_ms if tokens == len(prompts)]
        steps = timing["steps"]  # the counts above, before the prefill runs below add to them
        forward_s = timing["forward"]
        per_step = {k: _r(v / steps * 1e3) for k, v in parts.items()}
        prefill = _prefill_s(
            llm, vocab=json.loads((model / "config.json").read_text())["vocab_size"]
        )
    finally:
        for h in hooks:
            h.remove()
        RMSNorm.add_norm = add_norm
        llm.shutdown()
    return {
        "steps": steps,
        "step_ms": _r(wall / steps * 1e3),
        "execute_model_ms": _r(forward_s / steps * 1e3),
        "overhead_ms": _r((wall - forward_s) / steps * 1e3),
        "overhead_fraction": _r((wall - forward_s) / wall),
        # Inside execute_model: the model's forward and its parts (attention includes the
        # q/k/v and o projections); the rest of execute_model is input preparation, the
        # lm_head and sampling. A decode step on the CPU decode plan calls the kernels
        # without the modules whose hooks time the parts: its whole forward counts in
        # forward_ms only, so the parts cover the prefill and the pieces the plan leaves
        # to their modules.
        "forward_ms": per_step.pop("model"),
        "forward_parts_ms": per_step,
        "decode_step_ms": _r(statistics.median(decode)) if decode else None,
        **prefill,
    }


def _prefill_s(llm: Any, vocab: int, batch: int = 32, prompt_len: int = 32) -> dict[str, Any]:
    """The batch run's prefill alone (``bench_hf.py``'s shape: 32 random 32-token prompts,
    one output token): the median of 3, new prompts each time so no prefix is cached."""
    import torch

    from tidal import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(2)
    times = []
    for _ in range(3):
        ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return {
        "prefill_tokens": batch * prompt_len,
        "prefill_prompt_len": prompt_len,
        "prefill_s": _r(statistics.median(times)),
    }


# ------------------------------------------------------------------ memory


def memory(model: Path, kernel_cache: Path, dtype: str) -> dict[str, Any]:
    """The default engine in a fresh process (``--memory-probe``): its resident memory
    after loading and serving a few requests, and its peak, against the checkpoint's bytes
    plus the KV cache (<= 1.15x), in the caller's process and as a rank's own
    process."""
    cmd = [
        sys.executable,
        __file__,
        "--memory-probe",
        str(model),
        "--kernel-cache",
        str(kernel_cache),
        "--dtype",
        dtype,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open(f"/proc/{pid}/status") as f:
        rows = (line.split(":", 1) for line in f)
        return {k: int(v.split()[0]) * 1024 for k, v in rows if k in keys}


def memory_probe(model: str, kernel_cache: str, dtype: str) -> None:
    """Two measures: the engine in this process (``LLM(multiprocess=False)``: the rank plus
    the frontend's tokenizer and transformers), and the rank alone, an engine process
    beside its frontend (``LLM(multiprocess=True)``, as ``launch`` runs it)."""
    import psutil

    from tidal import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 4
    before = _proc_status()
    llm = LLM(model, dtype=dtype, multiprocess=False, kernel_cache_dir=kernel_cache)
    try:
        llm.generate(prompts, params, use_tqdm=False)
        served = _proc_status()
        runner = llm.client.engine.executor.worker.model_runner
        kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    finally:
        llm.shutdown()
    # The rank's own process, its trial cached by the run above (as at a restart).
    llm = LLM(model, dtype=dtype, multiprocess=True, kernel_cache_dir=kernel_cache)
    try:
        llm.generate(prompts, params, use_tqdm=False)
        engines = [
            c for c in psutil.Process().children(recursive=True)
            if "tidal.engine_core.entry" in " ".join(c.cmdline())
        ]  # fmt: skip
        rank = _proc_status(engines[0].pid) if len(engines) == 1 else None
        if rank is not None:  # private to the rank: what its exit would give back
            full = engines[0].memory_full_info()
            rank["uss"], rank["pss"] = full.uss, full.pss
    finally:
        llm.shutdown()
    floor = _runtime_floor()
    ckpt = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    # VmHWM: the process's own peak (ru_maxrss keeps the parent's from before the exec).
    out = {
        "dtype": dtype,
        "checkpoint_bytes": ckpt,
        "kv_cache_bytes": kv,
        "rss_before_load": before["VmRSS"],
        "rss_serving": served["VmRSS"],
        "rss_anon": served["RssAnon"],
        "rss_file": served["RssFile"],
        "peak_rss": served["VmHWM"],
        "rss_over_ckpt_plus_kv": _r(served["VmRSS"] / (ckpt + kv)),
        "peak_over_ckpt_plus_kv": _r(served["VmHWM"] / (ckpt + kv)),
    }
    if rank is not None:
        out["rank_process"] = {
            "rss_serving": rank["VmRSS"],
            "peak_rss": rank["VmHWM"],
            "uss_serving": rank["uss"],
            "pss_serving": rank["pss"],
            "rss_over_ckpt_plus_kv": _r(rank["VmRSS"] / (ckpt + kv)),
            "peak_over_ckpt_plus_kv": _r(rank["VmHWM"] / (ckpt + kv)),
            "uss_over_ckpt_plus_kv": _r(rank["uss"] / (ckpt + kv)),
            # What the rank holds beyond a process that has only imported the engine.
            "above_runtime_over_ckpt_plus_kv": _r((rank["VmRSS"] - floor["rss"]) / (ckpt + kv)),
        }
        out["runtime_floor"] = floor
    print(json.dumps(out))


def _runtime_floor() -> dict[str, int]:
    """Resident and private bytes of a process that has imported what a rank imports
    (torch, the engine) and loaded nothing: the fixed cost below any checkpoint."""
    code = (
        "import json, psutil, tidal.engine_core.entry\n"
        "m = psutil.Process().memory_full_info()\n"
        "print(json.dumps({'rss': m.rss, 'uss': m.uss}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ reduced precision

FP8_GOAL = 1.5  # FP8 single stream >= 1.5x Tidal's own bf16 (half the weight bytes)


def fp8_checkpoints(path: Path) -> tuple[Path, Path]:
    """The FP8 checkpoint of the peer one at ``path`` -- its bf16 cast quantized in 128x128
    blocks in DeepSeek-V3's layout (``tidal.models.tiny.make_tiny_fp8_checkpoint``) -- and
    that FP8 checkpoint dequantized to bf16 (the same values: every e4m3 times its scale,
    rounded to bf16 once), which transformers and Tidal's bf16 run. Built once, beside it."""
    from tidal.models.tiny import dequantize_checkpoint, make_tiny_fp8_checkpoint

    bf16 = _converted(path, "bfloat16")
    fp8 = path.with_name(f"{path.name}-fp8")
    deq = path.with_name(f"{path.name}-fp8-dequantized-bfloat16")
    for dst, make in (
        (fp8, lambda tmp: make_tiny_fp8_checkpoint(str(tmp), source=str(bf16))),
        (deq, lambda tmp: dequantize_checkpoint(str(fp8), str(tmp), "bfloat16")),
    ):
        if not (dst / "config.json").exists():
            log(f"building {dst.name}")
            tmp = dst.with_name(dst.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            make(tmp)
            tmp.rename(dst)
    return fp8, deq


def run_fp8_e2e(
    tag: str, fp8: Path, deq: Path, opts: argparse.Namespace, results: Path, kernel_cache: Path
) -> dict[str, Any]:
    """Tidal on the FP8 checkpoint against Tidal bf16 and transformers bf16 on its
    dequantized weights, ``--rounds`` interleaved rounds (the order rotated), each with its
    measured default paths (``auto``); the FP8/bf16 ratio per round, then the median."""
    ref = results / f"hf_{tag}.json"
    rows: dict[str, list[dict[str, Any]]] = {"transformers": [], "tidal_fp8": [], "tidal_bf16": []}
    runs = {"tidal_fp8": fp8, "tidal_bf16": deq}
    for r in range(opts.rounds):
        if r < opts.peer_rounds:
            _peer_round(tag, deq, opts, results, r, ref, rows)
        names = list(runs)[r % 2 :] + list(runs)[: r % 2]
        for name in names:
            log(f"{tag}: round {r + 1}/{opts.rounds}: {name}")
            out = results / f"{name}_{tag}_r{r}.json"
            cache = kernel_cache / name  # FP8's choices and bf16's apart
            rows[name].append(_tidal_run(runs[name], "auto", opts, out, cache, ref))
    summary = {k: _median_rows(v) for k, v in rows.items() if v}
    per_round = {
        k: [_r(a[k] / b[k]) for a, b in zip(rows["tidal_fp8"], rows["tidal_bf16"]) if a[k] and b[k]]
        for k in ("single", "batch")
    }
    ratios = {
        "fp8_over_bf16": {k: _r(statistics.median(v)) if v else None for k, v in per_round.items()},
        "fp8_over_bf16_per_round": per_round,
        "fp8_over_transformers": _ratio_pair(summary["tidal_fp8"], summary["transformers"]),
        "bf16_over_transformers": _ratio_pair(summary["tidal_bf16"], summary["transformers"]),
    }
    single = ratios["fp8_over_bf16"]["single"]
    return {
        "checkpoints": {"fp8": str(fp8), "dequantized_bf16": str(deq)},
        "engines": summary,
        "ratios": ratios,
        "goals": {f"fp8_single_ge_{FP8_GOAL}x_bf16": None if single is None else single >= FP8_GOAL},
        "choices": {
            n: _choices(kernel_cache / n, list(results.glob(f"{n}_{tag}_r*.json"))) for n in runs
        },
    }


def main_fp8(opts: argparse.Namespace, tags: list[str]) -> None:
    """``--dtype fp8``: ``run_fp8_e2e`` per model, one JSON document."""
    t0 = time.monotonic()
    opts.engine_dtype = "bfloat16"  # FP8 weights, bf16 activations and the rest bf16
    opts.vllm_python = None  # the peers here: Tidal bf16 and transformers
    paths = ensure_models(opts.peers_dir, tags)
    results = opts.peers_dir / "results" / "fp8"
    results.mkdir(parents=True, exist_ok=True)
    kernel_cache = Path(tempfile.mkdtemp(prefix="cpu-speed-kernels-"))
    doc: dict[str, Any] = {"benchmark": "cpu_speed", "dtype": "fp8", "machine": machine(opts)}
    doc["e2e"] = {}
    try:
        for tag in tags:
            fp8, deq = fp8_checkpoints(paths[tag])
            doc["e2e"][tag] = run_fp8_e2e(tag, fp8, deq, opts, results, kernel_cache / tag)
            _section(f"e2e {tag}", doc["e2e"][tag])
    finally:
        shutil.rmtree(kernel_cache, ignore_errors=True)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    doc["elapsed_s"] = _r(time.monotonic() - t0, 1)
    print(json.dumps(doc, indent=1), flush=True)


def _converted(path: Path, dtype: str) -> Path:
    """The checkpoint at ``path`` cast to ``dtype`` (built once, beside it)."""
    dst = path.with_name(f"{path.name}-{dtype}")
    if not (dst / "config.json").exists():
        log(f"casting {path.name} to {dtype}")
    return agreement.convert_checkpoint(path, dst, dtype)


def active_bytes_per_token(c: dict[str, Any], weight_bytes: int) -> int:
    """Weight bytes one decode token reads at batch 1: per layer the attention projections,
    the router and its top-k experts; then the lm_head (an embedding row is negligible)."""
    proj, router, expert = layer_weights(c)
    per_layer = proj + router + c["num_experts_per_tok"] * expert
    return weight_bytes * (c["num_hidden_layers"] * per_layer + c["vocab_size"] * c["hidden_size"])


def dtype_goals(doc: dict[str, Any], paths: dict[str, Path], opts: argparse.Namespace) -> Any:
    """The reduced-precision goals, per model, from this run: the vLLM ratios (in
    ``e2e``'s goals: big and moe64), agreement at least vLLM's, batch-1 decode at >= 75%
    of the measured read bandwidth for the dtype's bytes (from the single-stream tok/s,
    whose 32-token prefill makes it a lower bound), and the rank's resident memory
    <= 1.15x (weights + KV cache)."""
    bandwidth = (doc.get("roofline") or {}).get("read_bandwidth_gb_s")
    out: dict[str, Any] = {"read_bandwidth_gb_s": bandwidth}
    for tag in doc["e2e"]:
        c = json.loads((paths[tag] / "config.json").read_text())
        per_token = active_bytes_per_token(c, WEIGHT_BYTES[opts.engine_dtype])
        single = doc["e2e"][tag]["engines"].get("tidal_auto", {}).get("single")
        frac = single * per_token / (bandwidth * 1e9) if single and bandwidth else None
        agree = (doc.get("agreement") or {}).get(tag, {})
        rank = (doc.get("memory") or {}).get(tag, {}).get("rank_process", {})
        e2e_goals = doc["e2e"][tag].get("goals", {})
        out[tag] = {
            "decode_bytes_per_token": per_token,
            "single_fraction_of_bandwidth": _r(frac),
            "decode_batch1_ge_75pct_bandwidth": None if frac is None else frac >= 0.75,
            "agreement_tidal_ge_vllm": agree.get("goals", {}).get(
                "tidal_agrees_at_least_as_often_as_vllm"
            ),
            "rank_rss_le_1.15x_weights_plus_kv": (
                rank["rss_over_ckpt_plus_kv"] <= 1.15 if rank else None
            ),
            "rank_above_runtime_le_1.15x_weights_plus_kv": (
                rank["above_runtime_over_ckpt_plus_kv"] <= 1.15 if rank else None
            ),
            **{k: v for k, v in e2e_goals.items() if k.startswith("vllm_")},
        }
    return out


# ------------------------------------------------------------------ main


def machine(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tidal.kernels.cpu_ext import kernel_status
    from tidal.kernels.select import cpu_description

    cpu = cpu_description()
    return {
        "cpu_model": cpu["model"],
        "cpu_flags": cpu["flags"],
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "threads": opts.threads,
        "cpu_kernels": kernel_status(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,big,moe64", help="any of tiny, big, moe64")
    p.add_argument("--paths", default=",".join(TIDAL_PATHS), help="Tidal's --cpu-kernels runs")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--peer-rounds",
        type=int,
        default=None,
        help="rounds of transformers and vLLM (default: --rounds); Tidal runs every round",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU 0.32 venv")
    p.add_argument(
        "--peers-dir",
        type=Path,
        default=Path(os.environ.get("PEERS", Path.home() / ".cache" / "tidal-peers")),
    )
    p.add_argument("--skip-e2e", action="store_true", help="kernels, roofline and overhead only")
    p.add_argument("--skip-kernels", action="store_true", help="end to end and memory only")
    p.add_argument("--pool-matrices", type=int, default=64, help="linear weights streamed")
    p.add_argument("--bandwidth-rounds", type=int, default=7)
    p.add_argument(
        "--tidal-detokenize",
        action="store_true",
        help="Tidal detokenizes its outputs (the baseline's harness); by default it returns "
        "token ids only, as bench_vllm.py asks of vLLM (detokenize=False)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="bfloat16: every checkpoint cast to bf16 once (the same weights, beside the "
        "float32 one) and every engine at bf16; fp8: the bf16 cast quantized to FP8 in "
        "128x128 blocks, Tidal on it against Tidal bf16 and transformers bf16 on its "
        "dequantized weights (end to end only; --paths, vLLM and the kernel sections "
        "do not apply)",
    )
    p.add_argument(
        "--agreement-prompts",
        type=int,
        default=8,
        help="prompts of benchmarks/agreement.py per model (0: no agreement section)",
    )
    p.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kernel-cache", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.memory_probe:
        memory_probe(opts.memory_probe, opts.kernel_cache, opts.dtype)
        return
    opts.paths = [x.strip() for x in opts.paths.split(",") if x.strip()]
    bad = [x for x in opts.paths if x not in TIDAL_PATHS]
    if bad or "auto" not in opts.paths:
        p.error(f"--paths: a list of {', '.join(TIDAL_PATHS)} with auto (the default) in it")
    if opts.rounds < 1:
        p.error("--rounds must be >= 1")
    opts.peer_rounds = opts.rounds if opts.peer_rounds is None else opts.peer_rounds
    if not 1 <= opts.peer_rounds <= opts.rounds:
        p.error(
            "--peer-rounds: between 1 (the first round's outputs are the reference) and --rounds"
        )
    tags = [t.strip() for t in opts.models.split(",") if t.strip()]
    if any(t not in MODELS for t in tags):
        p.error(f"--models: any of {', '.join(MODELS)}")
    if opts.agreement_prompts < 0:
        p.error("--agreement-prompts must be >= 0")
    if opts.dtype == "fp8":
        main_fp8(opts, tags)
        return
    opts.engine_dtype = opts.dtype

    t0 = time.monotonic()
    paths = ensure_models(opts.peers_dir, sorted(set(tags) | {"big"}))
    float32_paths = paths  # the kernel sections below measure float32 kernels
    results = opts.peers_dir / "results"
    if opts.dtype != "float32":
        paths = {t: _converted(p_, opts.dtype) for t, p_ in paths.items()}
        results = results / opts.dtype  # apart from float32's reference outputs
    results.mkdir(parents=True, exist_ok=True)
    # The kernel choices this run measures (per model) and reuses: never an older run's.
    kernel_cache = Path(tempfile.mkdtemp(prefix="cpu-speed-kernels-"))
    try:
        doc: dict[str, Any] = {
            "benchmark": "cpu_speed",
            "dtype": opts.dtype,
            "checkpoints": {t: str(paths[t]) for t in tags},
            "machine": machine(opts),
            "e2e": {},
            "tidal_detokenize": opts.tidal_detokenize,
        }
        if not opts.skip_e2e:
            for tag in tags:
                if opts.agreement_prompts:
                    doc.setdefault("agreement", {})[tag] = agreement.measure(
                        str(paths[tag]), opts.dtype, prompts=opts.agreement_prompts,
                        tidal_paths=opts.paths, vllm_python=opts.vllm_python,
                        peers=opts.peers_dir,
                        tidal_extra={"kernel_cache_dir": str(kernel_cache / tag)},
                    )  # fmt: skip
                    _section(f"agreement {tag}", doc["agreement"][tag])
                doc["e2e"][tag] = run_e2e(tag, paths[tag], opts, results, kernel_cache / tag)
                _section(f"e2e {tag}", doc["e2e"][tag])
            doc["memory"] = {}
            for tag in tags:
                doc["memory"][tag] = memory(paths[tag], kernel_cache / tag, opts.dtype)
                _section(f"memory {tag}", doc["memory"][tag])
        if not opts.skip_kernels:
            doc["kernels_dtype"] = "float32"
            doc["kernels"] = kernel_bandwidth(opts)
            doc["moe_block"] = {tag: moe_block(float32_paths[tag], opts, results) for tag in tags}
            doc["gemm"] = gemm(opts)
        big = doc["e2e"].get("big", {}).get("engines", {}).get("tidal_auto", {}).get("batch")
        doc["step_overhead"] = step_overhead(paths["big"], opts, kernel_cache / "big")
        steps = dict(doc["step_overhead"])
        if "gemm" in doc:  # the best rate any path reached at 256 rows
            steps["best_gemm_gflop_s"] = max(doc["gemm"][256].values())
        doc["roofline"] = roofline(paths["big"], opts, big, steps)
        if opts.dtype != "float32":
            doc["dtype_goals"] = dtype_goals(doc, paths, opts)
    finally:
        shutil.rmtree(kernel_cache, ignore_errors=True)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    doc["elapsed_s"] = _r(time.monotonic() - t0, 1)
    print(json.dumps(doc, indent=1), flush=True)


if __name__ == "__main__":
    main()
