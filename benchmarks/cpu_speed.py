"""CPU speed of Tidal vs transformers and vLLM-CPU, in one run, on the checkpoints of
issue #13 (same prompts, greedy, float32; outputs checked against transformers).

    python benchmarks/cpu_speed.py                          # tiny + big, Tidal vs transformers
    python benchmarks/cpu_speed.py --vllm-python ~/.cache/tidal-peers/vllm/bin/python
    python benchmarks/cpu_speed.py --models big --rounds 3 --skip-e2e   # the MoE block only

Checkpoints (built once under ``--peers-dir`` by ``benchmarks/peers/make_models.py``):
tiny Qwen3-MoE (H256, 4 layers, 16 experts top-4) and big (H1024, 8 layers, 32 experts
top-4, I512). Each engine runs in its own process with the peer harness of
``benchmarks/peers/`` (what the issue's baseline was measured with): 1 stream x 128 new
tokens, and 32 requests x 64 new tokens, ``--rounds`` rounds, medians reported. vLLM runs
only with ``--vllm-python`` (its own venv, see ``benchmarks/peers/README.md``), with the
settings of ``env_vllm.sh`` (compiled; its first start compiles for a minute). Both
return token ids only (vLLM: ``detokenize=False``; Tidal the same flag, unless
``--tidal-detokenize``, the baseline's setting, asks it for text too).

Printed as one JSON document:

- ``e2e``: per model and engine, tok/s single and batch (medians), time to ready, and
  whether the greedy outputs equal transformers'; ``ratios``: Tidal / vLLM and Tidal /
  transformers;
- ``moe_block``: the MoE block (router + experts) on layer 0 of each checkpoint, ms per
  call at 1, 32 and 256 tokens: Tidal's MoE layer as a model runs it (``FusedMoE``: the
  C++ router and experts kernels, ``tidal/kernels/cpu_router.py`` and ``cpu_moe.py``, when
  ``pip install`` built them), the previous designs -- oneDNN-prepacked
  experts, and the best of the torch strategies bmm / grouped_mm / loop on K-major weights
  -- and, with vLLM, its ``cpu_fused_moe`` kernel (big checkpoint);
- ``gemm``: GFLOP/s of one [M, 1024] x [1024, 1024] float32 GEMM through MKL (torch's
  ``mm``), oneDNN with a prepacked weight, and Tidal's C++ linear (what ``Linear`` runs);
- ``roofline``: this machine's memory read bandwidth (a 1 GiB ``sum``), the bytes one
  batch-32 decode step of the big model reads (every expert of every layer, attention,
  lm_head), the roofline tok/s that implies, and Tidal's batch tok/s as a fraction of it;
- ``step_overhead``: Tidal in-process on the big model, batch 32 decode: wall time per
  step, the part spent in ``execute_model`` (input preparation, forward, sampling) and
  the rest (scheduler, output processing, detokenization); and the forward's parts (MoE
  blocks, attention with its projections, norms).
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
PEERS_SCRIPTS = HERE / "peers"
MODELS = {"tiny": "tiny-qwen3-moe", "big": "big-qwen3-moe"}


def log(msg: str) -> None:
    print(f"[cpu_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


# ------------------------------------------------------------------ checkpoints


def ensure_models(peers: Path) -> dict[str, Path]:
    paths = {tag: peers / name for tag, name in MODELS.items()}
    if not all((p / "tokenizer.json").exists() for p in paths.values()):
        log(f"building the checkpoints under {peers}")
        env = {**os.environ, "PEERS": str(peers)}
        subprocess.run([sys.executable, PEERS_SCRIPTS / "make_models.py"], env=env, check=True)
        subprocess.run(
            [sys.executable, PEERS_SCRIPTS / "make_tokenizer.py", *map(str, paths.values())],
            env=env,
            check=True,
        )
    return paths


# ------------------------------------------------------------------ end to end


@contextlib.contextmanager
def _private_tmpdir(env: dict[str, str] | None) -> Iterator[dict[str, str]]:
    """``env`` (else this process's) with TMPDIR a fresh directory, removed afterwards: a
    peer's leftovers go with it (vLLM leaves its ipc:// socket files in the temp
    directory, a few per run)."""
    tmp = tempfile.mkdtemp(prefix="cpu-speed-")
    try:
        yield {**(os.environ if env is None else env), "TMPDIR": tmp}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def run_e2e(tag: str, model: Path, opts: argparse.Namespace, results: Path) -> dict[str, Any]:
    ref = results / f"hf_{tag}.json"
    rows: dict[str, list[dict[str, Any]]] = {"transformers": [], "tidal": [], "vllm": []}
    py = sys.executable
    for r in range(opts.rounds):
        log(f"{tag}: round {r + 1}/{opts.rounds}: transformers")
        out = results / f"hf_{tag}_r{r}.json"
        hf = _run_json(
            [py, str(PEERS_SCRIPTS / "bench_hf.py"), "--model", str(model), "--skip", "bvar",
             "--out", str(out)],
            out,
        )  # fmt: skip
        if not ref.exists():
            ref.write_text(out.read_text())
        rows["transformers"].append(
            {"single": hf["a_single"]["tok_per_s"], "batch": hf["b_batch"]["out_tok_per_s"]}
        )
        if opts.vllm_python:
            log(f"{tag}: round {r + 1}: vLLM-CPU")
            out = results / f"vllm_{tag}_r{r}.json"
            v = _run_json(
                [opts.vllm_python, str(PEERS_SCRIPTS / "bench_vllm.py"), "--model", str(model),
                 "--hf-ref", str(ref), "--out", str(out)],
                out,
                env=_vllm_env(opts.peers_dir),
            )  # fmt: skip
            rows["vllm"].append(_engine_row(v))
        log(f"{tag}: round {r + 1}: Tidal")
        out = results / f"tidal_{tag}_r{r}.json"
        t = _run_json(
            [py, str(PEERS_SCRIPTS / "bench_tidal.py"), "--model", str(model), "--hf-ref",
             str(ref), "--out", str(out), "--detokenize", str(int(opts.tidal_detokenize))],
            out,
        )  # fmt: skip
        rows["tidal"].append(_engine_row(t))
    summary = {k: _median_rows(v) for k, v in rows.items() if v}
    ratios: dict[str, Any] = {}
    for peer in ("vllm", "transformers"):
        if peer in summary:
            ratios[f"tidal_over_{peer}"] = {
                k: _r(summary["tidal"][k] / summary[peer][k]) for k in ("single", "batch")
            }
    return {"engines": summary, "ratios": ratios}


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


def moe_block(model: Path, opts: argparse.Namespace, results: Path) -> dict[str, Any]:
    """Router + experts of layer 0, as ``bench_vllm_moe_kernel.py`` times vLLM's."""
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open

    from tidal.kernels.cpu_ext import kernel_available, kernel_status
    from tidal.kernels.fused_moe_torch import PackedExperts, fused_experts_torch, k_major_experts
    from tidal.moe.layer import FusedMoE
    from tidal.moe.reference import fused_experts_reference

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
    k13, k2 = k_major_experts(w13, w2)
    packed = PackedExperts(w13, w2)
    if not kernel_available():
        log(f"the C++ kernels are missing ({kernel_status()}): the tidal_ms rows are null")
    # What a model runs: the layer itself (the C++ router and experts when built).
    layer = FusedMoE(n_exp, top_k, cfg["hidden_size"], w2.shape[2], renormalize=True)
    for param, value in ((layer.gate, gate_w), (layer.w13, w13), (layer.w2, w2)):
        param.data.copy_(value)
    layer.weights_updated()

    def route(x: Any) -> tuple[Any, Any]:
        p = torch.softmax(F.linear(x, gate_w), -1, dtype=torch.float)
        tw, ti = torch.topk(p, top_k, -1)
        return tw / tw.sum(-1, keepdim=True), ti

    rows: dict[str, Any] = {}
    for tokens in (1, 32, 256):
        x = torch.randn(
            1, tokens, cfg["hidden_size"], generator=torch.Generator().manual_seed(tokens)
        )[0]
        with torch.inference_mode():
            tw, ti = route(x)
            want = fused_experts_reference(x, w13, w2, tw, ti)
            err = (layer(x) - want).abs().max().item()
            kernel = _timeit(lambda x=x: layer(x)) if kernel_available() else None
            onednn = _timeit(lambda x=x: fused_experts_torch(x, w13, w2, *route(x), packed=packed))
            before = {
                s: _timeit(lambda x=x, s=s: fused_experts_torch(x, k13, k2, *route(x), strategy=s))
                for s in ("bmm", "grouped_mm", "loop")
            }
        rows[tokens] = {
            "tidal_ms": _r(kernel),
            "tidal_onednn_ms": _r(onednn),
            "tidal_torch_best_ms": _r(min(before.values())),
            "tidal_torch_ms": {k: _r(v) for k, v in before.items()},
            "max_abs_err_vs_reference": err,
        }
        log(
            f"moe block {model.name} T={tokens}: kernel {kernel and round(kernel, 3)} ms, "
            f"onednn {onednn:.3f}, torch best {min(before.values()):.3f}"
        )
    if opts.vllm_python:
        out = results / f"vllm_moe_kernel_{model.name}.json"
        proc = _run(
            [
                opts.vllm_python,
                str(PEERS_SCRIPTS / "bench_vllm_moe_kernel.py"),
                str(model),
                str(out),
            ],
            _vllm_env(opts.peers_dir),
        )
        if proc.returncode == 0 and out.exists():
            per_t = json.loads(out.read_text())["per_T"]
            for tokens, row in rows.items():
                v = per_t[str(tokens)]
                row["vllm_block_ms"] = _r(v["block_median_ms"])
                best = row["tidal_ms"] or row["tidal_onednn_ms"]
                row["tidal_over_vllm_time"] = _r(best / v["block_median_ms"])
        else:
            log(f"vLLM's MoE kernel bench failed: {proc.stderr[-2000:]}")
    return rows


def gemm(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tidal.kernels.cpu_ext import kernel_available
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
        if kernel_available():  # what Linear runs now (tidal/kernels/cpu_linear.py)
            ours = pack_linear_weight(w)
            cpp = _timeit(lambda x=x, p=ours: linear_cpu(x, p, 1024), 0.1)
            out[m]["tidal_cpp_gflops"] = _r(flops / cpp / 1e6, 1)
    return out


def roofline(model: Path, opts: argparse.Namespace, tidal_batch: float | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(opts.threads)
    buf = torch.ones(256 * 1024 * 1024)  # 1 GiB float32
    sec = _timeit(buf.sum, 0.5) / 1e3
    bandwidth = buf.numel() * 4 / sec
    c = json.loads((model / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    experts = c["num_local_experts"] * 3 * h * c["moe_intermediate_size"]
    attention = h * (heads + 2 * kv) * hd + heads * hd * h + c["num_local_experts"] * h
    step_bytes = 4 * (layers * (experts + attention) + c["vocab_size"] * h)
    roof = 32 * bandwidth / step_bytes  # tok/s of a batch-32 decode step at full bandwidth
    return {
        "read_bandwidth_gb_s": _r(bandwidth / 1e9, 1),
        "batch32_step_bytes": step_bytes,
        "roofline_tok_s": _r(roof, 1),
        "tidal_batch_tok_s": tidal_batch,
        "tidal_fraction_of_roofline": _r(tidal_batch / roof) if tidal_batch else None,
    }


def step_overhead(model: Path, opts: argparse.Namespace) -> dict[str, Any]:
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

    def pre(mod: Any, _args: Any) -> None:
        if type(mod) in kinds or isinstance(mod, MoECausalLM):
            started[id(mod)] = time.perf_counter()

    def post(mod: Any, _args: Any, _out: Any) -> None:
        t0 = started.pop(id(mod), None)
        if t0 is not None:
            kind = kinds.get(type(mod), "model")
            parts[kind] += time.perf_counter() - t0

    hooks = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post),
    ]
    llm = LLM(str(model), dtype="float32", multiprocess=False)
    try:
        engine = llm.client.engine
        timing = {"forward": 0.0, "steps": 0}
        run = engine.executor.execute_model

        def timed(sched: Any) -> Any:
            t = time.perf_counter()
            try:
                return run(sched)
            finally:
                timing["forward"] += time.perf_counter() - t
                timing["steps"] += 1

        engine.executor.execute_model = timed
        prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        timing.update(forward=0.0, steps=0)
        parts.update(dict.fromkeys(parts, 0.0))
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        for h in hooks:
            h.remove()
        llm.shutdown()
    steps = timing["steps"]
    per_step = {k: _r(v / steps * 1e3) for k, v in parts.items()}
    return {
        "steps": steps,
        "step_ms": _r(wall / steps * 1e3),
        "execute_model_ms": _r(timing["forward"] / steps * 1e3),
        "overhead_ms": _r((wall - timing["forward"]) / steps * 1e3),
        "overhead_fraction": _r((wall - timing["forward"]) / wall),
        # Inside execute_model: the model's forward and its parts (attention includes the
        # q/k/v and o projections); the rest of execute_model is input preparation, the
        # lm_head and sampling.
        "forward_ms": per_step.pop("model"),
        "forward_parts_ms": per_step,
    }


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,big", help="tiny, big or both")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU 0.32 venv")
    p.add_argument(
        "--peers-dir",
        type=Path,
        default=Path(os.environ.get("PEERS", Path.home() / ".cache" / "tidal-peers")),
    )
    p.add_argument("--skip-e2e", action="store_true", help="kernels, roofline and overhead only")
    p.add_argument(
        "--tidal-detokenize",
        action="store_true",
        help="Tidal detokenizes its outputs (the baseline's harness); by default it returns "
        "token ids only, as bench_vllm.py asks of vLLM (detokenize=False)",
    )
    opts = p.parse_args(argv)
    import torch

    from tidal.kernels.cpu_ext import kernel_status

    t0 = time.monotonic()
    paths = ensure_models(opts.peers_dir)
    results = opts.peers_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "cpu_speed",
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "threads": opts.threads,
            "moe_kernel": kernel_status(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "e2e": {},
        "tidal_detokenize": opts.tidal_detokenize,
    }
    tags = [t.strip() for t in opts.models.split(",") if t.strip()]
    if not opts.skip_e2e:
        for tag in tags:
            doc["e2e"][tag] = run_e2e(tag, paths[tag], opts, results)
    big = paths["big"]
    doc["moe_block"] = {tag: moe_block(paths[tag], opts, results) for tag in tags}
    doc["gemm"] = gemm(opts)
    batch = doc["e2e"].get("big", {}).get("engines", {}).get("tidal", {}).get("batch")
    doc["roofline"] = roofline(big, opts, batch)
    doc["step_overhead"] = step_overhead(big, opts)
    doc["elapsed_s"] = _r(time.monotonic() - t0, 1)
    print(json.dumps(doc, indent=1), flush=True)


if __name__ == "__main__":
    main()
