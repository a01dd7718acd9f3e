"""Teacher-forced agreement of reduced-precision engines with a float32 reference, on one
checkpoint and a fixed prompt set, each engine in its own process, in one run.

    python benchmarks/agreement.py --model DIR --dtype bfloat16
    python benchmarks/agreement.py --model DIR --dtype bfloat16 \\
        --vllm-python ~/.cache/tidal-peers/vllm/bin/python --tidal-paths auto,torch

The reference is transformers at float32 on the checkpoint's own weights (a bf16
checkpoint upcast: "dequantized to float32", so only the engine's arithmetic differs). It
greedy-generates ``--new-tokens`` tokens after each of ``--prompts`` seeded prompts; then
every engine reads prompt + that continuation as one prompt (teacher-forced) and gives, at
each continuation position, its most likely next token and the log-probability of the
reference's token there:

- ``top1_agreement``: the fraction of positions whose argmax is the reference's token;
- ``max_abs_logprob_diff`` (and the mean): |engine - reference| log-probability of the
  reference's token.

Engines: ``transformers_<dtype>``, ``tidal_<path>`` (``LLM(dtype=..., cpu_kernels=path)``,
``prompt_logprobs=1``) and, with ``--vllm-python``, ``vllm_<dtype>`` (vLLM-CPU's
``SamplingParams(prompt_logprobs=1)``, in its own venv with ``peers/env_vllm.sh``).
Printed as one JSON document with the CPU model and flags and the load average; the
reduced-precision goal (Tidal agrees at least as often as vLLM-CPU) is evaluated when vLLM
ran.
At float32 Tidal's agreement is 1.0 (it is token-exact against transformers).

This module imports neither tidal nor transformers at the top: the vLLM venv runs its
``--engine-run vllm`` mode, and ``cpu_speed.py`` imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kmp_registrations import registrations, remove_dead  # noqa: E402 - a sibling module

ENV_VLLM = HERE / "peers" / "env_vllm.sh"
DTYPES = ("float32", "bfloat16", "float16")
# A position's outcome: the engine's most likely next token and its log-probability of
# the reference's token.
Position = tuple[int, float]


# ------------------------------------------------------------------ the metric


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` seeded prompts of ``length`` token ids in [3, vocab) (bench_hf.py's range:
    below 3 are the specials)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def positions_from_logits(logits: Any, seq: list[int], prompt_len: int) -> list[Position]:
    """Teacher-forced outcomes at the continuation positions of ``seq``.

    logits: [len(seq), V] (row i predicts seq[i + 1]); the continuation is
    seq[prompt_len:], predicted by rows prompt_len - 1 .. len(seq) - 2.
    """
    import torch

    rows = logits[prompt_len - 1 : len(seq) - 1].float()  # [N, V]
    lp = torch.log_softmax(rows, dim=-1)
    targets = torch.tensor(seq[prompt_len:], dtype=torch.long)  # [N]
    chosen = lp.gather(1, targets[:, None])[:, 0]  # [N]
    return list(zip(rows.argmax(dim=-1).tolist(), chosen.tolist()))


def positions_from_prompt_logprobs(
    prompt_logprobs: list[Any], seq: list[int], prompt_len: int
) -> list[Position]:
    """The same outcomes from an engine's ``prompt_logprobs=1`` (Tidal's and vLLM's
    layout: entry i is {token: Logprob(logprob, rank)} for seq[i] given seq[:i], None
    at 0; it holds seq[i] and the top-1)."""
    out = []
    for i in range(prompt_len, len(seq)):
        entry = prompt_logprobs[i]
        target = entry[seq[i]]
        if target.rank == 1:  # nothing more likely: the target is (one of) the argmax
            top = seq[i]
        else:
            top = max((t for t in entry if t != seq[i]), key=lambda t: entry[t].logprob)
        out.append((top, float(target.logprob)))
    return out


def score(
    reference: list[list[Position]], engine: list[list[Position]], tokens: list[list[int]]
) -> dict[str, Any]:
    """Agreement of ``engine`` with ``reference`` (per sequence, per position) on the
    reference's continuation ``tokens``."""
    if len(reference) != len(engine) or len(reference) != len(tokens):
        raise ValueError("reference, engine and tokens must cover the same sequences")
    agree = total = 0
    diffs: list[float] = []
    first_miss: list[int | None] = []
    for ref, eng, toks in zip(reference, engine, tokens):
        if not len(ref) == len(eng) == len(toks):
            raise ValueError("a sequence's positions differ in number between engines")
        miss = None
        for j, ((_, ref_lp), (top, lp), tok) in enumerate(zip(ref, eng, toks)):
            agree += top == tok
            total += 1
            diffs.append(abs(lp - ref_lp))
            if top != tok and miss is None:
                miss = j
        first_miss.append(miss)
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 6) if total else None,
        "max_abs_logprob_diff": round(max(diffs), 6) if diffs else None,
        "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 6) if diffs else None,
        "first_disagreement_per_prompt": first_miss,
    }


# ------------------------------------------------------------------ engines


def convert_checkpoint(src: Path, dst: Path, dtype: str) -> Path:
    """``src`` with its floating-point tensors cast to ``dtype`` (the same weights, rounded
    once) and ``dtype`` in its config, into ``dst``; the other files copied. Built once:
    an existing ``dst`` with a config is kept."""
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    want = _torch_dtype(dtype)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            cast = {k: v.to(want) if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(cast, str(tmp / f.name), metadata={"format": "pt"})
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["dtype"] = cfg["torch_dtype"] = dtype
            (tmp / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _hf_model(model: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("AGREEMENT_THREADS", "2")))
    return AutoModelForCausalLM.from_pretrained(model, dtype=_torch_dtype(dtype)).eval()


def run_reference(model: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers at float32: greedy continuations, then the teacher-forced outcomes on
    prompt + continuation (their argmax must be the continuation: ``self_agreement``)."""
    import torch

    hf = _hf_model(model, "float32")
    seqs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            seqs.append(out[0].tolist())
    return {"sequences": seqs, "positions": run_transformers(model, seqs, prompts, "float32", hf)}


def run_transformers(
    model: str, seqs: list[list[int]], prompts: list[list[int]], dtype: str, hf: Any = None
) -> list[list[Position]]:
    import torch

    hf = hf if hf is not None else _hf_model(model, dtype)
    out = []
    with torch.inference_mode():
        for seq, p in zip(seqs, prompts):
            logits = hf(input_ids=torch.tensor([seq])).logits[0]  # [L, V]
            out.append(positions_from_logits(logits, seq, len(p)))
    return out


def _prompt_logprob_positions(llm: Any, params: Any, seqs: list[list[int]], prompts: Any) -> Any:
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    return [
        positions_from_prompt_logprobs(o.prompt_logprobs, s, len(p))
        for o, s, p in zip(outs, seqs, prompts)
    ]


def run_tidal(
    model: str, seqs: list[list[int]], prompts: list[list[int]], dtype: str, extra: dict
) -> list[list[Position]]:
    from tidal import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **extra)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        return _prompt_logprob_positions(llm, params, seqs, prompts)
    finally:
        llm.shutdown()


def run_vllm(
    model: str, seqs: list[list[int]], prompts: list[list[int]], dtype: str, extra: dict
) -> list[list[Position]]:
    from vllm import LLM, SamplingParams  # pyright: ignore[reportMissingImports] - its own venv

    kw = {
        "model": model, "dtype": dtype, "max_model_len": 512, "seed": 0,
        "skip_tokenizer_init": True, "enable_prefix_caching": False, **extra,
    }  # fmt: skip
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    return _prompt_logprob_positions(llm, params, seqs, prompts)


def engine_run(opts: argparse.Namespace) -> None:
    """One engine in this process (``--engine-run``): reads the sequences, writes the
    outcomes."""
    job = json.loads(Path(opts.job).read_text())
    t0 = time.perf_counter()
    res: dict[str, Any]
    match opts.engine_run:
        case "reference":
            res = run_reference(job["model"], job["prompts"], job["new_tokens"])
        case "transformers":
            pos = run_transformers(job["model"], job["sequences"], job["prompts"], job["dtype"])
            res = {"positions": pos}
        case "tidal":
            pos = run_tidal(
                job["model"], job["sequences"], job["prompts"], job["dtype"], job["extra"]
            )
            res = {"positions": pos}
        case "vllm":
            pos = run_vllm(
                job["model"], job["sequences"], job["prompts"], job["dtype"], job["extra"]
            )
            res = {"positions": pos}
        case other:
            raise ValueError(f"--engine-run: unknown engine {other!r}")
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    Path(opts.out).write_text(json.dumps(res))


def vllm_env(peers: Path) -> dict[str, str]:
    """This environment plus the exports of env_vllm.sh (a missing tcmalloc is optional)."""
    script = f"export PEERS={peers}; . {ENV_VLLM}; env -0"
    raw = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
    env["LD_PRELOAD"] = ":".join(
        p for p in env.get("LD_PRELOAD", "").split(":") if p and os.path.exists(p)
    )
    return env


class EngineFailed(RuntimeError):
    """An engine process that exited without its result; ``stderr`` is all of its own."""

    def __init__(self, engine: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{engine} failed ({returncode}):\n{stderr[-3000:]}")
        self.stderr = stderr


def spawn_engine(
    python: str,
    engine: str,
    job: dict,
    tmp: Path,
    env: dict[str, str] | None = None,
    script: Path = Path(__file__).resolve(),
) -> dict[str, Any]:
    """``engine`` in a fresh process of ``python`` running ``script --engine-run engine``
    (this module's by default; ``models.py`` has its own) in its own temp directory (vLLM
    leaves socket files there)."""
    job_file, out = tmp / f"{engine}-job.json", tmp / f"{engine}-out.json"
    job_file.write_text(json.dumps(job))
    out.unlink(missing_ok=True)
    child_tmp = Path(tempfile.mkdtemp(prefix="agree-", dir=tmp))
    cmd = [python, str(script), "--engine-run", engine,
           "--job", str(job_file), "--out", str(out)]  # fmt: skip
    env = {**(os.environ if env is None else env), "TMPDIR": str(child_tmp)}
    kmp_before = registrations()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:  # vLLM's OpenMP leaves /dev/shm files behind its exited processes
        remove_dead(registrations() - kmp_before)
    if proc.returncode != 0 or not out.exists():
        raise EngineFailed(engine, proc.returncode, proc.stderr)
    return json.loads(out.read_text())


# ------------------------------------------------------------------ one run


def measure(
    model: str,
    dtype: str,
    *,
    prompts: int = 8,
    prompt_len: int = 32,
    new_tokens: int = 32,
    tidal_paths: list[str] | None = None,
    tidal_extra: dict | None = None,
    vllm_python: str | None = None,
    peers: Path | None = None,
    reference_model: str | None = None,
) -> dict[str, Any]:
    """Every engine's agreement at ``dtype`` on ``model`` against transformers float32 on
    ``reference_model`` (default: the same checkpoint, upcast)."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ps = make_prompts(vocab, prompts, prompt_len)
    tmp = Path(tempfile.mkdtemp(prefix="agreement-"))
    try:
        py = sys.executable
        base = {"model": reference_model or model, "prompts": ps, "new_tokens": new_tokens}
        ref = spawn_engine(py, "reference", base, tmp)
        seqs = ref["sequences"]
        tokens = [s[len(p) :] for s, p in zip(seqs, ps)]
        job = {"model": model, "prompts": ps, "sequences": seqs, "dtype": dtype, "extra": {}}
        runs: dict[str, dict[str, Any]] = {}  # engine -> {"positions", "elapsed_s"}
        runs[f"transformers_{dtype}"] = spawn_engine(py, "transformers", job, tmp)
        for path in tidal_paths or ["auto"]:
            extra = {"cpu_kernels": path, **(tidal_extra or {})}
            runs[f"tidal_{path}"] = spawn_engine(py, "tidal", {**job, "extra": extra}, tmp)
        if vllm_python:
            env = vllm_env(peers or Path.home() / ".cache" / "tidal-peers")
            # vLLM-CPU 0.32 now and then aborts while it starts on these hosts ("terminate
            # called without an active exception", -6): one fresh start more, not a
            # benchmark lost.
            for attempt in (1, 2):
                try:
                    runs[f"vllm_{dtype}"] = spawn_engine(vllm_python, "vllm", job, tmp, env)
                    break
                except EngineFailed as e:
                    if attempt == 2:
                        raise
                    first = str(e).splitlines()[0]
                    print(f"agreement: {first}; starting vLLM once more", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    engines = {
        name: {**score(ref["positions"], r["positions"], tokens), "elapsed_s": r["elapsed_s"]}
        for name, r in runs.items()
    }
    self_check = score(ref["positions"], ref["positions"], tokens)["top1_agreement"]
    return {
        "model": model,
        "reference": f"transformers float32 on {reference_model or model}",
        "reference_self_agreement": self_check,  # 1.0: its argmax is its greedy token
        "dtype": dtype,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "engines": engines,
        "goals": goals(engines, dtype),
    }


def goals(engines: dict[str, dict[str, Any]], dtype: str) -> dict[str, bool | None]:
    """Reduced precision's goal: Tidal's default agrees with the reference at least as often as vLLM-CPU
    at the same dtype (None without vLLM); float32 stays exact."""
    tidal = engines.get("tidal_auto", {}).get("top1_agreement")
    vllm = engines.get(f"vllm_{dtype}", {}).get("top1_agreement")
    out: dict[str, bool | None] = {
        "tidal_agrees_at_least_as_often_as_vllm": (
            None if tidal is None or vllm is None else tidal >= vllm
        )
    }
    if dtype == "float32":
        out["tidal_float32_exact"] = None if tidal is None else tidal == 1.0
    return out


def machine() -> dict[str, Any]:
    from tidal.kernels.select import cpu_description

    cpu = cpu_description()
    return {"cpu_model": cpu["model"], "cpu_flags": cpu["flags"], "load_avg": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument(
        "--convert",
        action="store_true",
        help="first cast the checkpoint's weights to --dtype, into MODEL-DTYPE beside it "
        "(kept for the next run); every engine and the reference read that copy",
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tidal-paths", default="auto", help="Tidal's --cpu-kernels runs")
    p.add_argument("--tidal-extra", default="{}", help="JSON of more LLM(...) arguments")
    p.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU 0.32 venv")
    p.add_argument(
        "--peers-dir",
        type=Path,
        default=Path(os.environ.get("PEERS", Path.home() / ".cache" / "tidal-peers")),
    )
    p.add_argument("--engine-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.engine_run:
        engine_run(opts)
        return
    if not opts.model or not (Path(opts.model) / "config.json").exists():
        p.error("--model: a checkpoint directory (with config.json)")
    for flag in ("prompts", "prompt_len", "new_tokens"):
        if getattr(opts, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        extra = json.loads(opts.tidal_extra)
    except json.JSONDecodeError as e:
        p.error(f"--tidal-extra: not JSON ({e})")
    model = Path(opts.model).resolve()
    if opts.convert and opts.dtype != "float32":
        model = convert_checkpoint(model, model.with_name(f"{model.name}-{opts.dtype}"), opts.dtype)
    doc = {"benchmark": "agreement", "machine": machine()}
    doc.update(
        measure(
            str(model),
            opts.dtype,
            prompts=opts.prompts,
            prompt_len=opts.prompt_len,
            new_tokens=opts.new_tokens,
            tidal_paths=[x.strip() for x in opts.tidal_paths.split(",") if x.strip()],
            tidal_extra=extra,
            vllm_python=opts.vllm_python,
            peers=opts.peers_dir,
        )  # fmt: skip
    )
    doc["machine"]["load_avg_end"] = os.getloadavg()
    print(json.dumps(doc, indent=1), flush=True)


if __name__ == "__main__":
    main()
