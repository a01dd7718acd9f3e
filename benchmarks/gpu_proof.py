"""GPU proof, one step at a time: device facts, fused MoE (Triton) against the torch path
with a block-size sweep, the block-FP8 kernels against their references and the bf16
peers, and one CUDA engine rank (parity with transformers, throughput).

Run by ``benchmarks/gpu_proof.sh`` (which also runs the kernel tests and merges the parts);
each step writes one JSON file and never raises: a failure is recorded in the file.

    python benchmarks/gpu_proof.py facts  --out facts.json
    python benchmarks/gpu_proof.py moe    --out moe.json --config-dir DIR
    python benchmarks/gpu_proof.py engine --out engine.json
    python benchmarks/gpu_proof.py fp8    --out fp8.json --config-dir DIR
    python benchmarks/gpu_proof.py merge  --out gpu.json facts.json kernels.json ...

``--smoke`` runs each step on the CPU with toy shapes (the Triton interpreter for the
kernels): a rehearsal of this script, whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# Qwen3-30B-A3B's MoE layer: 128 experts, top-8, hidden 2048, expert intermediate 768.
MOE_SHAPE = {"E": 128, "top_k": 8, "H": 2048, "I": 768}
MOE_TOKENS = (1, 16, 64, 256, 2048)
REPORT_TOKENS = (1, 64, 2048)
SMOKE_MOE_SHAPE = {"E": 8, "top_k": 2, "H": 64, "I": 32}
SMOKE_TOKENS = (1, 8)
ROUTINGS = 8  # distinct routings cycled through, so repeated calls do not all hit in L2


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(json.dumps({"step": data.get("step"), "ok": data.get("ok")}), flush=True)


def _guarded(step: str, fn: Callable[[dict[str, Any]], None], out: Path) -> int:
    """Run ``fn(result)``; whatever it filled in is kept, and an exception is recorded."""
    result: dict[str, Any] = {"step": step, "ok": False}
    t0 = time.perf_counter()
    try:
        fn(result)
        result["ok"] = "error" not in result
    except BaseException as e:  # noqa: BLE001 - recorded, the next step still runs
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        _write(out, result)
    return 0


# ---- 1. device facts ------------------------------------------------------------------


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Mean milliseconds per call of ``fn`` between CUDA events (after ``warmup`` calls)."""
    from tune_moe import timer  # benchmarks/: this script's own folder is on sys.path

    return timer("cuda")(fn, iters, warmup) / 1e3


def facts(result: dict[str, Any], smoke: bool) -> None:
    import torch
    import triton

    result["torch"] = torch.__version__
    result["triton"] = triton.__version__
    result["python"] = sys.version.split()[0]
    if smoke:
        result["device"] = "cpu (smoke)"
        return
    props = torch.cuda.get_device_properties(0)
    result["device"] = torch.cuda.get_device_name(0)
    result["memory_gib"] = round(props.total_memory / 2**30, 1)
    result["sms"] = props.multi_processor_count
    result["cuda"] = torch.version.cuda
    # Copy bandwidth: bytes read plus bytes written by one large device-to-device copy_.
    n = 2**30  # 1 Gi bf16 elements = 2 GiB each way
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a), iters=10)
    result["copy_gbps_read_plus_write"] = round(2 * 2 * n / ms / 1e6, 1)
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms = cuda_time_ms(lambda: x @ y, iters=10, warmup=3)
    result["bf16_matmul_8192_tflops"] = round(2 * m**3 / ms / 1e9, 1)


# ---- 2. the kernel tests, compiled ---------------------------------------------------


def kernel_tests(result: dict[str, Any], timeout_s: float, workers: int) -> None:
    """``pytest tests/kernels`` (CUDA cases on, compiled Triton); failures are listed."""
    import subprocess
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory(prefix="tidal-kernel-tests-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}"]  # fmt: skip
        if workers > 1:
            cmd += ["-n", str(workers)]  # pytest-xdist: Triton compiles in parallel
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=timeout_s)  # fmt: skip
            result["returncode"] = proc.returncode
            result["tail"] = proc.stdout[-3000:] + proc.stderr[-1000:]
        except subprocess.TimeoutExpired as e:
            result["error"] = f"timed out after {timeout_s} s"
            result["tail"] = (e.stdout or b"")[-3000:].decode(errors="replace")
        if not xml.is_file():
            result.setdefault("error", "pytest wrote no report")
            return
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        failures = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                counts["failed"] += 1
                failures.append({"test": name, "message": (bad.get("message") or "")[:400]})
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        result.update(counts, failures=failures)
        if counts["failed"]:
            result["error"] = f"{counts['failed']} kernel tests failed"


# ---- 3. fused MoE ---------------------------------------------------------------------


def sweep_configs(tokens: int) -> list[dict[str, int]]:
    """The block sizes tried at ``tokens`` (a few dozen in all): BLOCK_SIZE_M near the rows an
    expert gets, the rest around the shapes that stream the weights well."""

    def cfg(m: int, n: int, k: int, g: int, w: int, s: int) -> dict[str, int]:
        return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k,
                "GROUP_SIZE_M": g, "num_warps": w, "num_stages": s}  # fmt: skip

    if tokens <= 256:
        out = [cfg(16, n, k, 1, 4, s) for n in (32, 64, 128) for k in (64, 128, 256)
               for s in (3, 4)]  # fmt: skip
        if tokens >= 64:
            out += [cfg(32, n, 64, 4, 4, 3) for n in (64, 128)]
        return out
    return [cfg(64, n, k, 8, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8)
            for s in (3, 4)] + [cfg(128, n, 64, 8, w, s) for n in (128, 256) for w in (4, 8)
            for s in (3, 4)]  # fmt: skip


def _moe_problem(shape: dict[str, int], tokens: int, device: str, seed: int):
    """Activations and ``ROUTINGS`` routings of ``tokens`` tokens (the weights are shared)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed + tokens)
    x = torch.randn(tokens, shape["H"], generator=gen)
    routings = []
    for _ in range(ROUTINGS):
        logits = torch.randn(tokens, shape["E"], generator=gen)
        w, ids = torch.topk(torch.softmax(logits, dim=-1), shape["top_k"], dim=-1)
        routings.append((w.contiguous().to(device), ids.contiguous().to(device)))
    return x, routings


def _expert_bytes(shape: dict[str, int], routings, elem: int) -> float:
    """Mean bytes of expert weights one call touches (each distinct expert's w13 and w2)."""
    per_expert = 3 * shape["H"] * shape["I"] * elem
    return sum(len(set(ids.flatten().tolist())) * per_expert for _, ids in routings) / len(
        routings
    )


def _precompile(
    worker: Callable[[Any, list], int], head: Any, jobs: list, procs: int
) -> dict[str, Any]:
    """Compile every sweep config in parallel processes (Triton's disk cache then serves the
    timing process): compiling one config takes seconds, timing it milliseconds. Each
    process runs ``worker(head, its share of jobs)``, which returns its failures."""
    import multiprocessing as mp

    if not jobs or procs <= 1:
        return {"precompiled": 0}
    t0 = time.perf_counter()
    chunks = [jobs[i::procs] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.starmap(worker, [(head, chunk) for chunk in chunks if chunk]))
    return {"precompiled": len(jobs), "precompile_failed": failed,
            "precompile_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _compile_worker(shape: dict[str, int], jobs: list[tuple[int, dict[str, int]]]) -> int:
    import torch

    from tidal.kernels.fused_moe import fused_experts_with_config
    from tidal.kernels.moe_config import MoeKernelConfig

    w13, w2 = _moe_weights(shape, "cuda", torch.bfloat16)
    failed = 0
    for tokens, raw in jobs:
        x, routings = _moe_problem(shape, tokens, "cuda", seed=0)
        tw, ids = routings[0]
        try:
            fused_experts_with_config(x.to("cuda", torch.bfloat16), w13, w2, tw, ids, None,
                                      True, MoeKernelConfig.from_json(raw))  # fmt: skip
        except Exception:  # noqa: BLE001 - the timing process records it
            failed += 1
    torch.cuda.synchronize()
    return failed


def _moe_weights(shape: dict[str, int], device: str, dtype):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    e, h, i = shape["E"], shape["H"], shape["I"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(device, dtype)
    return w13, w2


def _graph_time_ms(call: Callable[[int], object], n: int, replays: int) -> float:
    """Device time per call: ``call(r)`` for r in range(n) captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for r in range(n):  # warm-up on the side stream, as capture requires
            call(r)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(n):
            call(r)
    return cuda_time_ms(graph.replay, iters=replays) / n


def _kernels_us(call: Callable[[int], object], n: int) -> dict[str, float] | str:
    """Device microseconds per call of each kernel ``call(r)`` launches, by the profiler,
    ``r`` cycling over ``n`` problems (so weights come from memory, not L2)."""
    import torch

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for r in range(n):
                call(r)
            torch.cuda.synchronize()
        return {
            e.key[:60]: round(e.device_time_total / n, 2)
            for e in prof.key_averages()
            if e.device_time_total > 0
        }
    except Exception as e:  # noqa: BLE001 - the profile is a detail, not the proof
        return f"{type(e).__name__}: {e}"


def _align_paths(config, triton_call, rate) -> dict[str, Any]:
    """The best config with moe_align's one-program path and with its chunked kernels (the
    one-program path cuts 5 launches to 1 where every slot fits one tile), eager and
    graph-replayed, plus each run's device kernels by the profiler."""

    from tidal.kernels import moe_align

    out: dict[str, Any] = {}
    saved = moe_align._SMALL_TILE_ELEMENTS
    try:
        for name, limit in (("one_program", saved), ("chunked", 0)):
            moe_align._SMALL_TILE_ELEMENTS = limit
            call = triton_call(config)
            eager = cuda_time_ms(lambda: [call(r) for r in range(ROUTINGS)], iters=5) / ROUTINGS  # noqa: B023
            entry = {"eager": rate(eager), "graph": rate(_graph_time_ms(call, ROUTINGS, 10))}
            entry["kernels_us"] = _kernels_us(call, ROUTINGS)
            out[name] = entry
    finally:
        moe_align._SMALL_TILE_ELEMENTS = saved
    return out


def moe(result: dict[str, Any], smoke: bool, config_dir: Path, procs: int) -> None:
    import torch

    from tidal.kernels.fused_moe import fused_experts_with_config, is_interpreted
    from tidal.kernels.fused_moe_torch import fused_experts_torch
    from tidal.kernels.moe_config import (
        MoeKernelConfig,
        config_file_name,
        default_config,
        dump_config_file,
    )
    from tidal.moe.reference import fused_experts_reference

    shape = SMOKE_MOE_SHAPE if smoke else MOE_SHAPE
    tokens_list = SMOKE_TOKENS if smoke else MOE_TOKENS
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    result.update(shape=shape, dtype=str(dtype).removeprefix("torch."), cases=[])
    configs_by_t = {t: sweep_configs(t)[: 2 if smoke else None] for t in tokens_list}
    if smoke:
        configs_by_t = {
            t: [{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32,
                 "GROUP_SIZE_M": 1, "num_warps": 1, "num_stages": 1}]
            for t in tokens_list
        }  # fmt: skip
    else:
        jobs = [(t, c) for t in tokens_list for c in configs_by_t[t]]
        result["precompile"] = _precompile(_compile_worker, shape, jobs, procs)
    w13, w2 = _moe_weights(shape, device, dtype)
    elem = w13.element_size()
    best_table: dict[int, MoeKernelConfig] = {}
    for tokens in tokens_list:
        x, routings = _moe_problem(shape, tokens, device, seed=0)
        x = x.to(device, dtype)
        flops = 2 * tokens * shape["top_k"] * 3 * shape["H"] * shape["I"]
        touched = _expert_bytes(shape, routings, elem)
        want = fused_experts_reference(x.float(), w13.float(), w2.float(), *routings[0])
        scale = float(want.abs().max().clamp_min(1e-6))

        def err_of(got) -> float:
            return float((got.float() - want).abs().max()) / scale  # noqa: B023

        case: dict[str, Any] = {"T": tokens, "expert_mb_touched": round(touched / 1e6, 1),
                                "gflop": round(flops / 1e9, 3)}  # fmt: skip

        def rate(ms: float) -> dict[str, float]:
            return {"ms": round(ms, 4), "gbps": round(touched / ms / 1e6, 1),  # noqa: B023
                    "tflops": round(flops / ms / 1e9, 2)}  # noqa: B023  # fmt: skip

        def triton_call(config: MoeKernelConfig) -> Callable[[int], object]:
            return lambda r: fused_experts_with_config(x, w13, w2, *routings[r], None, True, config)  # noqa: B023

        def time_triton(config: MoeKernelConfig) -> dict[str, Any]:
            call = triton_call(config)
            entry: dict[str, Any] = {"rel_err": round(err_of(call(0)), 5)}
            if smoke:
                return entry
            eager = cuda_time_ms(lambda: [call(r) for r in range(ROUTINGS)], iters=5) / ROUTINGS
            entry["eager"] = rate(eager)
            entry["graph"] = rate(_graph_time_ms(call, ROUTINGS, replays=10))
            return entry

        default = default_config(tokens, shape["E"], shape["top_k"], is_interpreted())
        case["triton_default"] = {"config": default.to_json(), **time_triton(default)}
        # The torch path (what the CPU serves with), each GEMM strategy it has on CUDA.
        for strategy in ("auto", "loop", "bmm", "grouped_mm"):
            def torch_call(r: int, strategy: str = strategy) -> object:
                return fused_experts_torch(x, w13, w2, *routings[r], strategy=strategy)  # noqa: B023

            try:
                entry = {"rel_err": round(err_of(torch_call(0)), 5)}
                if not smoke:
                    ms = cuda_time_ms(lambda: [torch_call(r) for r in range(ROUTINGS)],  # noqa: B023
                                      iters=3) / ROUTINGS  # fmt: skip
                    entry["eager"] = rate(ms)
            except Exception as e:  # noqa: BLE001 - a strategy this device cannot run
                entry = {"error": f"{type(e).__name__}: {e}"}
            case[f"torch_{strategy}"] = entry
        sweep = []
        for raw in configs_by_t[tokens]:
            config = MoeKernelConfig.from_json(raw)
            try:
                entry = {"config": raw, **time_triton(config)}
            except Exception as e:  # noqa: BLE001 - e.g. too much shared memory
                sweep.append({"config": raw, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            sweep.append(entry)
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
        ok = [s for s in sweep if "error" not in s and s["rel_err"] < tol]
        case["sweep_tried"], case["sweep_rejected"] = len(sweep), len(sweep) - len(ok)
        if ok:
            key = (lambda s: s["graph"]["ms"]) if not smoke else (lambda s: s["rel_err"])
            best = min(ok, key=key)
            case["triton_best"] = best
            best_table[tokens] = MoeKernelConfig.from_json(best["config"])
        case["sweep_errors"] = [s for s in sweep if "error" in s][:5]
        if ok and not smoke:
            case["align_paths"] = _align_paths(best_table[tokens], triton_call, rate)
        result["cases"].append(case)
        print(json.dumps({"T": tokens, "default": case["triton_default"].get("graph"),
                          "best": case.get("triton_best", {}).get("graph"),
                          "torch": case["torch_auto"].get("eager")}), flush=True)  # fmt: skip
    if best_table:
        name = torch.cuda.get_device_name(0) if not smoke else "interpreter"
        fname = config_file_name(shape["E"], shape["I"], name, dtype)
        config_dir.mkdir(parents=True, exist_ok=True)
        # Saved as tuned_moe_config.json (the device tool returns plain file names only);
        # ``config_file`` is the name it ships under in tidal/kernels/configs/.
        (config_dir / "tuned_moe_config.json").write_text(dump_config_file(best_table))
        result["config_file"] = fname


# ---- 3b. block-FP8 (w8a8) kernels --------------------------------------------------------

# The layer shapes of the issue: Qwen3-30B-A3B's and DeepSeek-V3's (256 experts, top-8,
# hidden 7168, expert intermediate 2048), FP8 in 128x128 blocks as both ship.
FP8_MOE_SHAPES = {
    "qwen3_30b_a3b": {"E": 128, "top_k": 8, "H": 2048, "I": 768},
    "deepseek_v3": {"E": 256, "top_k": 8, "H": 7168, "I": 2048},
}
FP8_TOKENS = (1, 64, 2048)
# (N, K) of dense FP8 linears: DeepSeek-V3's o_proj (16384 -> 7168) and its shared
# expert's gate (7168 -> 2048).
FP8_LINEARS = ((7168, 16384), (2048, 7168))
LINEAR_STREAM_BYTES = 160 * 10**6  # FP8 weight bytes a timed graph cycles over (H200 L2: 50 MB)
SMOKE_FP8 = {"toy": {"E": 8, "top_k": 2, "H": 64, "I": 48}}
SMOKE_FP8_LINEARS = ((40, 96),)
SMOKE_FP8_SWEEP = [{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32,
                           "GROUP_SIZE_M": 1, "num_warps": 1, "num_stages": 1}]  # fmt: skip


def _fp8_cfg(m: int, n: int, k: int, g: int, w: int, s: int, split: int = 1) -> dict[str, int]:
    cfg = {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g,
           "num_warps": w, "num_stages": s}  # fmt: skip
    return cfg | ({"SPLIT_K": split} if split > 1 else {})


def fp8_linear_sweep(tokens: int) -> list[dict[str, int]]:
    """The FP8 linear's candidates at ``tokens`` rows, for its tuned tables: at decode
    sizes narrow tiles with k split 1-8 ways (a decode's few output tiles alone leave most
    SMs idle), at prefill sizes wide tiles."""
    if tokens <= 64:
        return [_fp8_cfg(16, n, 128, 1, 4, 4, split) for n in (32, 64, 128)
                for split in (1, 2, 4, 8)] + [_fp8_cfg(32, 64, 128, 4, 4, 3)]  # fmt: skip
    return [_fp8_cfg(m, n, 128, 8, w, 3) for m, n, w in ((64, 128, 4), (128, 128, 8),
            (64, 256, 8), (128, 256, 8))] + [_fp8_cfg(64, 128, 128, 8, 4, 3, 2)]  # fmt: skip


def fp8_moe_sweep(tokens: int) -> list[dict[str, int]]:
    """The FP8 fused MoE's candidates at ``tokens`` tokens: 128-deep k tiles (one scale
    block) or 64 (two tiles a block), at decode sizes narrow row blocks with deeper
    pipelines, at prefill sizes wide tiles with more warps."""
    if tokens <= 64:
        out = [_fp8_cfg(16, n, 128, 1, 4, s) for n in (32, 64, 128) for s in (3, 4, 5)]
        out += [_fp8_cfg(16, n, 64, 1, 4, 4) for n in (64, 128)]
        if tokens >= 64:
            out += [_fp8_cfg(32, n, 128, 4, 4, 3) for n in (64, 128)]
        return out
    return [_fp8_cfg(m, n, k, 8, w, s) for m, n, k, w, s in (
        (64, 128, 128, 4, 3), (64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 4, 3),
        (64, 256, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 64, 8, 4))]  # fmt: skip


def _fp8_compile_worker(smoke: bool, jobs: list[tuple[str, int, dict[str, int]]]) -> int:
    import torch

    from tidal.kernels.fp8_triton import (
        fused_experts_fp8,
        per_token_group_quant_fp8,
        w8a8_block_fp8_gemm,
    )
    from tidal.kernels.moe_config import MoeKernelConfig

    device, act, group = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 128)
    # Every size a multiple of 16, as the timed shapes' (Triton specializes on that).
    shape = SMOKE_FP8["toy"] if smoke else {"E": 16, "top_k": 8, "H": 1024, "I": 512}
    _, _, q13, q2, s13, s2 = _fp8_experts(shape, device, act, group)
    wq, ws = q2[0], s2[0]  # [H, I] and its scales
    failed = 0
    for kind, tokens, raw in jobs:
        config = MoeKernelConfig.from_json(raw)
        x, routings = _moe_problem(shape, tokens, device, seed=0)
        x = x.to(device, act)
        try:
            if kind == "moe":
                fused_experts_fp8(x, q13, q2, s13, s2, group, *routings[0], config=config)
            else:
                xq, xs = per_token_group_quant_fp8(x[:, : shape["I"]].contiguous(), group)
                w8a8_block_fp8_gemm(xq, xs, wq, ws, group, act, None, config)
        except Exception:  # noqa: BLE001 - the timing process records it
            failed += 1
    if not smoke:
        torch.cuda.synchronize()
    return failed


def _fp8_experts(shape: dict[str, int], device: str, act_dtype, group: int):
    """Seeded experts in ``act_dtype`` and their FP8 form (128x128 blocks, row scales),
    quantized one expert at a time (DeepSeek-V3's whole layer in float32 would be 90 GB)."""
    import torch

    from tidal.kernels.fp8_torch import quantize_fp8_blocks, row_scales

    gen = torch.Generator(device=device).manual_seed(1)
    e, h, i = shape["E"], shape["H"], shape["I"]
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=act_dtype) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=act_dtype) / i**0.5
    parts: list[list[Any]] = [[], [], [], []]
    for ex in range(e):
        for j, w in enumerate((w13[ex], w2[ex])):
            q, sc = quantize_fp8_blocks(w, (group, group))
            parts[j].append(q)
            parts[2 + j].append(row_scales(sc, *w.shape, (group, group)))
    q13, q2, s13, s2 = (torch.stack(p) for p in parts)
    return w13, w2, q13, q2, s13, s2


def fp8(result: dict[str, Any], smoke: bool, config_dir: Path, procs: int) -> None:
    """The block-FP8 kernels on the GPU: the quantizer's bytes against torch's, the w8a8
    linear and fused MoE against their float32 references, and their times against the
    bf16 peers (cuBLAS for the linear, the bf16 Triton fused MoE, tuned table if one
    ships) in the same run; sweeps (compiled first in ``procs`` processes) write the FP8
    tables of each MoE shape and linear."""
    import torch
    import torch.nn.functional as F

    from tidal.kernels import fp8_torch as ft
    from tidal.kernels.fp8_triton import (
        fp8_linear,
        fused_experts_fp8,
        per_token_group_quant_fp8,
        w8a8_block_fp8_gemm,
    )
    from tidal.kernels.fused_moe import fused_experts
    from tidal.kernels.moe_config import (
        MoeKernelConfig,
        config_file_name,
        dump_config_file,
        linear_config_file_name,
    )

    device = "cpu" if smoke else "cuda"
    act = torch.float32 if smoke else torch.bfloat16
    group = 32 if smoke else 128
    shapes = SMOKE_FP8 if smoke else FP8_MOE_SHAPES
    tokens_list = (1, 5) if smoke else FP8_TOKENS
    result.update(group=group, act_dtype=str(act).removeprefix("torch."), quant=[],
                  linear=[], moe=[])  # fmt: skip

    def ms_of(fn: Callable[[], object]) -> float | None:  # device time, in a CUDA graph
        return None if smoke else round(_graph_time_ms(lambda r: fn(), ROUTINGS, 10), 4)

    def rel(got, want) -> float:
        return round(float((got.float() - want.float()).abs().max() / want.float().abs().max()), 6)

    gen = torch.Generator(device="cpu").manual_seed(0)
    linear_tables: dict[tuple[int, int], dict[int, MoeKernelConfig]] = {}
    for t in tokens_list:  # the quantizer: bytes equal to the torch reference
        x = (torch.randn(t, 7168 if not smoke else 96, generator=gen) * 3).to(device, act)
        q, sc = per_token_group_quant_fp8(x, group)
        want_q, want_s = ft.per_token_group_quant_fp8_torch(x, group)
        result["quant"].append({
            "T": t, "bytes_differing": int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum()),
            "scales_equal": bool(torch.equal(sc, want_s)),
            "ms": ms_of(lambda: per_token_group_quant_fp8(x, group)),  # noqa: B023
        })  # fmt: skip
    moe_sweep = (lambda t: SMOKE_FP8_SWEEP) if smoke else fp8_moe_sweep
    smoke_split = [SMOKE_FP8_SWEEP[0] | {"SPLIT_K": 2}]  # the split-K path rehearsed too
    linear_sweep = (lambda t: SMOKE_FP8_SWEEP + smoke_split) if smoke else fp8_linear_sweep
    jobs = [("moe", t, raw) for t in tokens_list for raw in moe_sweep(t)]
    jobs += [("linear", t, raw) for t in tokens_list for raw in linear_sweep(t)]
    try:  # the FP8 workers on small problems of the timed shapes' specialization
        result["precompile"] = _precompile(
            _fp8_compile_worker, smoke, jobs, min(procs, 2) if smoke else procs
        )
    except Exception as e:  # noqa: BLE001 - recorded; the sweep compiles what is missing
        result["precompile"] = {"precompile_error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(result["precompile"]), flush=True)
    # The fused MoE first: it is what the step is for, should its time box run out.
    moe_tables: dict[str, dict[int, MoeKernelConfig]] = {}
    for name, shape in shapes.items():
        w13, w2, q13, q2, s13, s2 = _fp8_experts(shape, device, act, group)
        for t in tokens_list:
            x, routings = _moe_problem(shape, t, device, seed=0)
            x = x.to(device, act)
            tw, ids = routings[0]
            got = fused_experts_fp8(x, q13, q2, s13, s2, group, tw, ids)
            want = ft.fused_experts_fp8_torch(x, q13, q2, s13, s2, group, tw, ids)
            case: dict[str, Any] = {
                "shape": name, "T": t, "rel_err_vs_w8a8_reference": rel(got, want),
                "rel_err_vs_bf16": rel(got, fused_experts(x, w13, w2, tw, ids)),
            }  # fmt: skip

            def fp8_call(r: int, config=None) -> object:
                return fused_experts_fp8(x, q13, q2, s13, s2, group, *routings[r],  # noqa: B023
                                         config=config)  # fmt: skip

            def bf16_call(r: int) -> object:
                return fused_experts(x, w13, w2, *routings[r])  # noqa: B023

            if not smoke:  # the default (or shipped table) against the bf16 kernel
                case["fp8_graph_ms"] = round(_graph_time_ms(fp8_call, ROUTINGS, 10), 4)
                case["bf16_graph_ms"] = round(_graph_time_ms(bf16_call, ROUTINGS, 10), 4)
                case["fp8_speedup"] = round(case["bf16_graph_ms"] / case["fp8_graph_ms"], 3)
            sweep = []  # rehearsed too: one config, picked by its error
            for raw in moe_sweep(t):
                config = MoeKernelConfig.from_json(raw)
                try:
                    err = rel(fp8_call(0, config), want)
                    ms = None if smoke else round(
                        _graph_time_ms(lambda r: fp8_call(r, config), ROUTINGS, 10), 4)  # noqa: B023
                    sweep.append({"config": raw, "rel_err": err, "graph_ms": ms})
                except Exception as e:  # noqa: BLE001 - e.g. too much shared memory
                    sweep.append({"config": raw, "error": f"{type(e).__name__}: {e}"[:200]})
            ok = [c for c in sweep if "error" not in c and c["rel_err"] < 5e-2]
            if ok:
                best = min(ok, key=lambda c: c["rel_err"] if smoke else c["graph_ms"])
                tuned = MoeKernelConfig.from_json(best["config"])
                moe_tables.setdefault(name, {})[t] = tuned
                case["sweep_best"] = best
                if not smoke:
                    case["tuned_fp8_speedup"] = round(case["bf16_graph_ms"] / best["graph_ms"], 3)
                    case["fp8_kernels_us"] = _kernels_us(lambda r: fp8_call(r, tuned), ROUTINGS)  # noqa: B023
                    case["bf16_kernels_us"] = _kernels_us(bf16_call, ROUTINGS)
            case["sweep"] = sweep
            result["moe"].append(case)
            print(json.dumps({k: case.get(k) for k in (
                "shape", "T", "rel_err_vs_w8a8_reference", "fp8_graph_ms", "bf16_graph_ms",
                "fp8_speedup", "tuned_fp8_speedup")}), flush=True)  # fmt: skip
    for n, k in SMOKE_FP8_LINEARS if smoke else FP8_LINEARS:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, act)
        wq, wsc = ft.quantize_fp8_blocks(w, (group, group))
        ws = ft.row_scales(wsc, n, k, (group, group))
        # Device time of a CUDA graph cycling over copies of the weights that together
        # outgrow L2 (as a model's layers do), so both sides read them from memory; a
        # per-call event time would be the Triton launch's host cost.
        copies = 1 if smoke else max(2, -(-LINEAR_STREAM_BYTES // wq.numel()))
        fp8_w = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies - 1)]
        bf16_w = [w] + [w.clone() for _ in range(copies - 1)]

        def graph_ms(call: Callable[[int], object]) -> float | None:
            return None if smoke else round(_graph_time_ms(call, copies, 10), 4)  # noqa: B023

        for t in tokens_list:
            x = torch.randn(t, k, generator=gen).to(device, act)
            got = fp8_linear(x, wq, ws, group)
            case = {"N": n, "K": k, "T": t, "weight_copies": copies,
                    "rel_err_vs_w8a8_reference": rel(got, ft.w8a8_linear_torch(x, wq, ws, group)),
                    "rel_err_vs_bf16": rel(got, F.linear(x, w)),
                    "fp8_graph_ms": graph_ms(lambda r: fp8_linear(x, *fp8_w[r], group)),  # noqa: B023
                    "bf16_graph_ms": graph_ms(lambda r: F.linear(x, bf16_w[r]))}  # noqa: B023  # fmt: skip
            if case["fp8_graph_ms"]:
                case["fp8_speedup"] = round(case["bf16_graph_ms"] / case["fp8_graph_ms"], 3)
            # The sweep (rehearsed too: one config, picked by its error).
            want = ft.w8a8_linear_torch(x, wq, ws, group)
            sweep = []
            for raw in linear_sweep(t):
                config = MoeKernelConfig.from_json(raw)

                def run(r: int, config: MoeKernelConfig = config) -> object:
                    xq, xs = per_token_group_quant_fp8(x, group)  # noqa: B023
                    return w8a8_block_fp8_gemm(xq, xs, *fp8_w[r], group, act, None, config)  # noqa: B023

                try:
                    err = rel(run(0), want)
                    sweep.append({"config": raw, "rel_err": err, "graph_ms": graph_ms(run)})
                except Exception as e:  # noqa: BLE001 - e.g. too much shared memory
                    sweep.append({"config": raw, "error": f"{type(e).__name__}: {e}"[:200]})
            ok = [c for c in sweep if "error" not in c and c["rel_err"] < 1e-2]
            if ok:
                best = min(ok, key=lambda c: c["rel_err"] if smoke else c["graph_ms"])
                case["sweep_best"] = best
                tuned = MoeKernelConfig.from_json(best["config"])
                if not smoke:
                    case["tuned_fp8_speedup"] = round(case["bf16_graph_ms"] / best["graph_ms"], 3)
                    case["fp8_kernels_us"] = _kernels_us(lambda r: run(r, tuned), copies)  # noqa: B023
                    case["bf16_kernels_us"] = _kernels_us(
                        lambda r: F.linear(x, bf16_w[r]), copies  # noqa: B023
                    )
                linear_tables.setdefault((n, k), {})[t] = tuned
            case["sweep"] = sweep
            result["linear"].append(case)
            print(json.dumps({k: case.get(k) for k in (
                "N", "K", "T", "rel_err_vs_w8a8_reference", "fp8_graph_ms", "bf16_graph_ms",
                "fp8_speedup",
                "tuned_fp8_speedup")}), flush=True)  # fmt: skip
    bad = [c for c in result["quant"] if c["bytes_differing"] or not c["scales_equal"]]
    bad += [c for c in result["linear"] if c["rel_err_vs_w8a8_reference"] > 1e-2]
    bad += [c for c in result["moe"] if c["rel_err_vs_w8a8_reference"] > 5e-2]
    if bad:
        result["error"] = f"{len(bad)} FP8 cases differ from their references"
    if linear_tables:
        config_dir.mkdir(parents=True, exist_ok=True)
        result["linear_config_files"] = {}
        for (n, k), found in linear_tables.items():
            # Plain names for the device tool; ``linear_config_files`` maps each to the
            # name it ships under in tidal/kernels/configs/.
            plain = f"tuned_fp8_linear_N{n}_K{k}.json"
            (config_dir / plain).write_text(dump_config_file(found))
            name = "interpreter" if smoke else torch.cuda.get_device_name(0)
            ship = linear_config_file_name(n, k, name, ft.FP8_DTYPE)
            result["linear_config_files"][plain] = ship
    if moe_tables:
        config_dir.mkdir(parents=True, exist_ok=True)
        result["config_files"] = {}
        for name, found in moe_tables.items():
            plain = f"tuned_moe_fp8_{name}.json"  # shipped as its config_files entry
            (config_dir / plain).write_text(dump_config_file(found))
            shape = shapes[name]
            device_name = "interpreter" if smoke else torch.cuda.get_device_name(0)
            result["config_files"][plain] = config_file_name(
                shape["E"], shape["I"], device_name, ft.FP8_DTYPE
            )


# ---- 4. one CUDA engine rank ----------------------------------------------------------

ENGINE_MODEL = {
    "arch": "qwen3_moe", "hidden_size": 2048, "num_layers": 4, "num_experts": 128,
    "top_k": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "num_heads": 32, "num_kv_heads": 4, "head_dim": 128, "vocab_size": 32768,
    "max_position_embeddings": 4096, "dtype": "bfloat16",
}  # fmt: skip
SMOKE_ENGINE_MODEL = {"arch": "qwen3_moe", "hidden_size": 64, "num_layers": 2, "num_experts": 8,
                      "top_k": 2, "vocab_size": 512}  # fmt: skip
PARITY_PROMPTS = [
    "The tide comes in twice a day",
    "A mixture of experts sends each token",
    "Once upon a time there was a small boat",
    "def add(a, b): return",
]


def _hf_greedy(path: str, prompts: list[str], max_new: int, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([tok(p).input_ids], device=device)
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False)
            outs.append(gen[0, ids.shape[1]:].tolist())
    del model
    return outs


def _hf_throughput(path: str, batch: int, prompt_len: int, new: int, device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(10, 30000, (batch, prompt_len), generator=gen).to(device)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return batch * new / elapsed


def engine(result: dict[str, Any], smoke: bool, workdir: Path, hf_peer: bool) -> None:
    import torch

    from tidal import LLM, SamplingParams
    from tidal.models.tiny import make_tiny_checkpoint

    device = "cpu" if smoke else "cuda"
    spec = SMOKE_ENGINE_MODEL if smoke else ENGINE_MODEL
    path = str(workdir / "qwen3-moe")
    t0 = time.perf_counter()
    make_tiny_checkpoint(path, init_device=device, **spec)
    result["model"] = spec
    result["checkpoint_s"] = round(time.perf_counter() - t0, 1)
    max_new = 8 if smoke else 32
    # Ground truth: transformers on the same folder, float32, one prompt at a time.
    want = _hf_greedy(path, PARITY_PROMPTS, max_new, device)
    torch.cuda.empty_cache() if not smoke else None
    common = {"device": device, "kv_cache_memory_bytes": (256 if smoke else 8192) << 20}
    t0 = time.perf_counter()
    with LLM(path, dtype="float32", multiprocess=True, **common) as llm:
        result["fp32_ready_s"] = round(time.perf_counter() - t0, 1)
        outs = llm.generate(PARITY_PROMPTS, SamplingParams(temperature=0, max_tokens=max_new),
                            use_tqdm=False)  # fmt: skip
    got = [list(o.outputs[0].token_ids) for o in outs]
    result["parity"] = {
        "prompts": len(PARITY_PROMPTS),
        "identical": sum(g == w for g, w in zip(got, want)),
        "tokens_compared": sum(len(w) for w in want),
        "mismatches": [{"prompt": i, "tidal": g, "transformers": w}
                       for i, (g, w) in enumerate(zip(got, want)) if g != w][:2],
    }  # fmt: skip
    # Offline bf16 throughput at 1, 32 and 256 concurrent requests.
    prompt_len, new = (8, 8) if smoke else (32, 128)
    sizes = (1, 4) if smoke else (1, 32, 256)
    tput: dict[str, Any] = {"prompt_len": prompt_len, "output_len": new}
    t0 = time.perf_counter()
    with LLM(path, dtype="bfloat16", max_num_seqs=max(sizes), multiprocess=True, **common) as llm:
        tput["ready_s"] = round(time.perf_counter() - t0, 1)
        gen = torch.Generator().manual_seed(0)
        vocab = spec["vocab_size"]

        def prompts(n: int) -> list[dict[str, Any]]:
            return [{"prompt_token_ids": torch.randint(10, vocab - 10, (prompt_len,),
                                                       generator=gen).tolist()}
                    for _ in range(n)]  # fmt: skip

        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                detokenize=False)  # fmt: skip
        t0 = time.perf_counter()
        for n in sizes:  # warm-up: compiles the kernels at every batch shape seen below
            llm.generate(prompts(n), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)  # fmt: skip
        tput["warmup_s"] = round(time.perf_counter() - t0, 1)
        for n in sizes:
            batch = prompts(n)
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            tput[f"tidal_{n}"] = {"out_tok_s": round(generated / elapsed, 1),
                                  "elapsed_s": round(elapsed, 2)}  # fmt: skip
            print(json.dumps({"concurrency": n, **tput[f"tidal_{n}"]}), flush=True)
    if hf_peer and not smoke:
        for n in (1, 32):
            try:
                tput[f"transformers_{n}"] = {
                    "out_tok_s": round(_hf_throughput(path, n, prompt_len, new, device), 1)
                }
            except Exception as e:  # noqa: BLE001 - the peer is a reference, not the proof
                tput[f"transformers_{n}"] = {"error": f"{type(e).__name__}: {e}"}
    result["throughput_bf16"] = tput


# ---- merge ------------------------------------------------------------------------------


def merge(out: Path, parts: list[Path]) -> int:
    merged: dict[str, Any] = {"bench": "gpu_proof"}
    for part in parts:
        if part.is_file():
            try:
                data = json.loads(part.read_text())
            except ValueError as e:
                data = {"step": part.stem, "ok": False, "error": f"unreadable: {e}"}
        else:
            data = {"step": part.stem, "ok": False, "error": "not run (time box or crash)"}
        merged[data.get("step", part.stem)] = data
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps({k: v.get("ok") for k, v in merged.items() if isinstance(v, dict)}))
    return 0


def _time_box_reached(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}: the step's time box ran out")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=("facts", "kernels", "moe", "fp8", "engine", "merge"))
    p.add_argument("parts", nargs="*", type=Path, help="merge: the step files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal with toy shapes")
    p.add_argument("--config-dir", type=Path, default=None, help="moe: where the tuned JSON goes")
    p.add_argument("--procs", type=int, default=12, help="moe, fp8: parallel Triton compiles")
    p.add_argument("--timeout", type=float, default=150, help="kernels: pytest's time box")
    p.add_argument("--workers", type=int, default=8, help="kernels: pytest-xdist workers")
    p.add_argument("--no-hf-peer", action="store_true", help="engine: skip transformers' tok/s")
    args = p.parse_intermixed_args(argv)
    # A time box's SIGTERM becomes an exception, so the step's file keeps what it measured.
    signal.signal(signal.SIGTERM, _time_box_reached)
    if args.smoke and args.step in ("moe", "fp8"):
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if args.step == "merge":
        return merge(args.out, args.parts)
    if args.step == "facts":
        return _guarded("facts", lambda r: facts(r, args.smoke), args.out)
    if args.step == "kernels":
        return _guarded(
            "kernels", lambda r: kernel_tests(r, args.timeout, args.workers), args.out
        )
    config_dir = args.config_dir or args.out.parent
    if args.step == "moe":
        return _guarded("moe", lambda r: moe(r, args.smoke, config_dir, args.procs), args.out)
    if args.step == "fp8":
        return _guarded("fp8", lambda r: fp8(r, args.smoke, config_dir, args.procs), args.out)
    with tempfile.TemporaryDirectory(prefix="tidal-gpu-proof-") as tmp:
        return _guarded(
            "engine", lambda r: engine(r, args.smoke, Path(tmp), not args.no_hf_peer), args.out
        )


if __name__ == "__main__":
    sys.exit(main())
