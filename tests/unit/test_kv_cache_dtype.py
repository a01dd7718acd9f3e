"""A KV cache in another dtype than the model's (``--kv-cache-dtype``) and 16-bit CPU
kernels: the C++ decode attention reading a bfloat16 / float16 cache against the float64
oracle, the cache writes' casts against ``index_copy_``, the attention layer's decode and
prefill paths (C++ and torch) on every pairing of query and cache dtypes, the 16-bit
RMSNorm against transformers' formula, and the paths the measured choice offers."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.kernels.cpu_attention import decode_attention_cpu, write_kv_cpu, write_kv_cpu_ok
from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.cpu_norm import rms_norm_cpu, rms_norm_cpu_ok
from tidal.kernels.select import Candidate, Choice, kernel_candidates
from tidal.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    decode_attention_reference,
    kv_cache_shape,
)
from tidal.layers.norm import RMSNorm, _rms_norm_hf, rms_norm_heads

needs_kernel = pytest.mark.skipif(not kernel_available(), reason=kernel_status())

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (query / model dtype, cache dtype): the model's own 16-bit cache, a 16-bit cache under a
# float32 model, and a float32 cache under a 16-bit model.
PAIRS = [(F32, BF16), (F32, F16), (BF16, BF16), (F16, F16), (BF16, F32), (F16, BF16)]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """float32 math on 16-bit inputs: float32 outputs agree with the float64 oracle to
    float32 rounding; 16-bit outputs to one rounding of their own (the torch path also
    rounds its scores and probabilities to the queries' dtype)."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 3e-2, "rtol": 2e-2}


def _ids(pairs):
    return [f"q-{str(q)[6:]}-cache-{str(c)[6:]}" for q, c in pairs]


# ---- the C++ kernels ---------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS, ids=_ids(PAIRS))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (6, 2, 24), (16, 4, 32)])
def test_decode_attention_kernel_reads_a_16bit_cache(
    threads, q_dtype, cache_dtype, heads, kv_heads, head_dim
):
    """Paged (shuffled blocks of 4), six sequences of odd lengths, GQA, strided query rows;
    head_dim 64 takes the kernel's register path, 24 its scalar tails."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(heads + head_dim)
        cache = torch.randn(2, 32, kv_heads, 4, head_dim, generator=g).to(cache_dtype)
        lengths = [1, 4, 5, 17, 20, 9]
        perm = torch.randperm(32, generator=g).tolist()
        tables = [perm[i * 5 : i * 5 + 5] for i in range(len(lengths))]
        q = torch.randn(len(lengths), heads + 3, head_dim, generator=g)[:, :heads].to(q_dtype)
        got = decode_attention_cpu(
            q, cache, torch.tensor(tables), torch.tensor(lengths), head_dim**-0.5
        )
        assert got.dtype == q_dtype
        want = decode_attention_reference(q, cache, list(zip(lengths, tables)))
        # One rounding to the output dtype apart at most (float32 math on both sides).
        tol = {"atol": 2e-6, "rtol": 1e-5} if q_dtype == F32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(got, want, **tol)
    finally:
        torch.set_num_threads(old)


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS[:4], ids=_ids(PAIRS[:4]))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 64), (8, 2, 128)])
def test_decode_attention_over_many_chunks_of_16_keys(
    q_dtype, cache_dtype, heads, kv_heads, head_dim
):
    """Long enough that a 16-bit cache's rows are widened a chunk of 16 keys at a time for
    the whole query group and its sums carried from chunk to chunk: lengths at, around
    and across several chunk edges, in shuffled blocks of 16."""
    g = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(2, 40, kv_heads, 16, head_dim, generator=g).to(cache_dtype)
    lengths = [16, 31, 33, 48, 70]
    perm = torch.randperm(40, generator=g).tolist()
    tables = [perm[i * 5 : i * 5 + 5] for i in range(len(lengths))]  # 80 keys each at most
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(q_dtype)
    got = decode_attention_cpu(
        q, cache, torch.tensor(tables), torch.tensor(lengths), head_dim**-0.5
    )
    want = decode_attention_reference(q, cache, list(zip(lengths, tables)))
    tol = {"atol": 2e-6, "rtol": 1e-5} if q_dtype == F32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("src_dtype", [F32, BF16, F16])
def test_write_kv_casts_like_index_copy(cache_dtype, src_dtype):
    """The C++ write rounds as torch's ``.to()`` does (nearest even), into the slots."""
    kv_heads, head_dim, tokens = 3, 24, 7
    cache = torch.randn(2, 16, kv_heads, 4, head_dim).to(cache_dtype)
    want = cache.clone()
    qkv = (torch.randn(tokens, 2 + 2 * kv_heads, head_dim) * 100).to(src_dtype)
    k, v = qkv[:, 2 : 2 + kv_heads], qkv[:, 2 + kv_heads :]
    slots = torch.randperm(16 * 4)[:tokens]
    for t, slot in enumerate(slots.tolist()):
        want[0, slot // 4, :, slot % 4] = k[t].to(cache_dtype)
        want[1, slot // 4, :, slot % 4] = v[t].to(cache_dtype)
    assert write_kv_cpu_ok(cache, k, v)
    write_kv_cpu(cache, slots, k, v)
    assert torch.equal(cache, want)


@needs_kernel
def test_kernels_refuse_other_dtypes():
    cache = torch.zeros(2, 4, 1, 4, 16, dtype=BF16)
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="float32/bfloat16/float16"):
        decode_attention_cpu(q, cache.double(), torch.tensor([[1]]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="one type"):
        k = torch.randn(1, 1, 16)
        write_kv_cpu(cache, torch.tensor([0]), k, k.to(BF16))
    assert not write_kv_cpu_ok(cache.double(), q, q)
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm_cpu(torch.randn(2, 8, dtype=BF16), torch.randn(8), 1e-6)
    assert not rms_norm_cpu_ok(torch.randn(2, 8, dtype=BF16), torch.randn(8))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("shape", [(1, 1024), (33, 100), (7, 16), (4, 6, 64), (0, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_16bit_matches_transformers(threads, dtype, shape, with_weight):
    """transformers' 16-bit RMSNorm (float32 statistics, the row rounded, then times the
    weight in the row's dtype): equal but for the sum's order, which can move a value by
    one unit in the last place."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(sum(shape))
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        got = rms_norm_cpu(x, w if with_weight else None, 1e-6)
        assert got.dtype == dtype and got.shape == x.shape
        want = _rms_norm_hf(x, w if with_weight else torch.ones(1, dtype=dtype), 1e-6)
        ulp = 2.0**-7 if dtype == BF16 else 2.0**-10
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=ulp)
        assert (got != want).sum().item() <= 0.01 * got.numel()  # nearly all bit-equal
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_16bit_norm_layers_on_both_paths(kernel, dtype, monkeypatch):
    """``RMSNorm`` and ``rms_norm_heads`` (Qwen3's q/k norm) on bf16 / fp16 activations:
    the C++ path and the torch path give transformers' result."""
    if kernel and not kernel_available():
        pytest.skip(kernel_status())
    if not kernel:
        monkeypatch.setattr("tidal.layers.norm.rms_norm_cpu_ok", lambda *a: False)
    norm = RMSNorm(48, 1e-6, dtype=dtype)
    norm.weight.data.copy_(torch.randn(48))
    x = torch.randn(5, 48).to(dtype)
    ulp = {"atol": 0, "rtol": 2.0**-7 if dtype == BF16 else 2.0**-10}
    torch.testing.assert_close(norm(x), _rms_norm_hf(x, norm.weight, 1e-6), **ulp)
    qk = torch.randn(5, 6, 16).to(dtype)
    wq, wk = torch.randn(16).to(dtype), torch.randn(16).to(dtype)
    want = torch.cat([_rms_norm_hf(qk[:, :4], wq, 1e-6), _rms_norm_hf(qk[:, 4:], wk, 1e-6)], 1)
    got = rms_norm_heads(qk, (wq, wk), (4, 2), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **ulp)


def test_measured_choice_offers_the_kernels_for_16bit():
    native = [Candidate("native")] if kernel_available() else []
    for dtype in (F32, BF16, F16):
        assert kernel_candidates(dtype) == [*native, Candidate("torch")]
    assert kernel_candidates(torch.float64) == [Candidate("torch")]
    assert RMSNorm(16, 1e-6, dtype=BF16).cpu_ops()["norm"].candidates == tuple(
        kernel_candidates(BF16)
    )
    attn = PagedAttention(4, 2, 16, dtype=BF16)
    assert attn.cpu_ops()["decode"].candidates == tuple(kernel_candidates(BF16))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_trials_run_in_the_models_dtype(dtype):
    """The choice's trials time the model's dtype, not float32 stand-ins."""
    torch_path = Candidate("torch")
    step = PagedAttention(4, 2, 16, dtype=dtype).cpu_trial("decode", torch_path, 1)(2)
    assert step().dtype == dtype
    norm_step = RMSNorm(16, 1e-6, dtype=dtype).cpu_trial("norm", torch_path, 1)(2)
    assert norm_step().dtype == dtype


# ---- the attention layer -----------------------------------------------------------------

BS = 4  # block size


@pytest.fixture(params=["cpp", "torch", "torch_lazy_rows"])
def decode_path(request, monkeypatch):
    """The C++ kernel; the torch path where the kernel is missing; the torch path after
    the step's rows expected the kernel (its rows built lazily)."""
    if request.param == "cpp" and not kernel_available():
        pytest.skip(kernel_status())
    if request.param != "cpp":
        monkeypatch.setattr("tidal.layers.attention.decode_attention_cpu_ok", lambda *a: False)
        monkeypatch.setattr("tidal.layers.attention.write_kv_cpu_ok", lambda *a: False)
    if request.param == "torch":
        monkeypatch.setattr(
            "tidal.layers.attention.decode_attention_cpu_supports", lambda *a: False
        )
    return request.param


def _layer(q_dtype, cache_dtype, lengths, heads=4, kv_heads=2, num_blocks=48):
    attn = PagedAttention(heads, kv_heads, 16, dtype=q_dtype)
    g = torch.Generator().manual_seed(num_blocks)
    cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, 16), generator=g)
    attn.kv_cache = cache.to(cache_dtype)
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    return attn, [[free.pop() for _ in range(-(-n // BS))] for n in lengths]


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), PAIRS, ids=_ids(PAIRS))
def test_attention_layer_on_a_cache_of_another_dtype(q_dtype, cache_dtype, decode_path):
    """Decode rows, a prefill continuing a cached prefix and a fresh prefill in one step:
    the new K/V land in the cache cast to its dtype, the decode rows and the prefill's
    last query match the oracle reading that cache, the output is the queries' dtype."""
    attn, blocks = _layer(q_dtype, cache_dtype, [7, 9, 13, 2])
    seqs = [(6, 1, blocks[0]), (6, 3, blocks[1]), (12, 1, blocks[2]), (0, 2, blocks[3])]
    meta = AttentionMetadata.build(seqs, BS, "cpu")
    q, k, v = (torch.randn(7, h, 16).to(q_dtype) for h in (4, 2, 2))
    out = attn(q, k, v, meta)
    assert out.dtype == q_dtype
    cache = attn.kv_cache
    assert cache is not None and cache.dtype == cache_dtype
    block, offset = blocks[2][12 // BS], 12 % BS  # the third sequence's new token
    assert torch.equal(cache[0, block, :, offset], k[4].to(cache_dtype))
    assert torch.equal(cache[1, block, :, offset], v[4].to(cache_dtype))
    want = decode_attention_reference(q[[0, 4]], cache, [(7, blocks[0]), (13, blocks[2])])
    torch.testing.assert_close(out[[0, 4]], want, **_tol(q_dtype))
    last = decode_attention_reference(q[3:4], cache, [(9, blocks[1])])
    torch.testing.assert_close(out[3:4], last, **_tol(q_dtype))


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(F32, BF16), (BF16, F32)])
def test_windowed_and_sink_layers_on_a_cache_of_another_dtype(q_dtype, cache_dtype):
    """GPT-OSS's layers (torch paths only) read a cache of another dtype too."""
    attn, blocks = _layer(q_dtype, cache_dtype, [12, 11])
    attn.sliding_window, attn.sinks = 5, torch.randn(4).to(q_dtype)
    seqs = [(11, 1, blocks[0]), (6, 5, blocks[1])]
    meta = AttentionMetadata.build(seqs, BS, "cpu")
    q, k, v = (torch.randn(6, h, 16).to(q_dtype) for h in (4, 2, 2))
    out = attn(q, k, v, meta)
    cache = attn.kv_cache
    assert cache is not None
    for row, (length, table) in ((0, (12, blocks[0])), (5, (11, blocks[1]))):
        want = decode_attention_reference(q[row : row + 1], cache, [(length, table)], 5, attn.sinks)
        torch.testing.assert_close(out[row : row + 1], want, **_tol(q_dtype))


@needs_kernel
def test_measured_torch_choice_still_reads_the_16bit_cache():
    """A layer whose measured choice is the torch path serves a bf16 cache under a
    float32 model with the same result as the kernel (to float32 rounding)."""
    lengths = [5, 16, 3]
    outs = []
    for path in ("native", "torch"):
        attn, blocks = _layer(F32, BF16, lengths)
        cand = Candidate(path)
        attn.set_cpu_path("decode", Choice.fixed(cand, None))
        meta = AttentionMetadata.build([(n - 1, 1, b) for n, b in zip(lengths, blocks)], BS, "cpu")
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(3, h, 16, generator=g) for h in (4, 2, 2))
        outs.append(attn(q, k, v, meta))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


# ---- --kv-cache-dtype: the option, the budget, the runner's caches ------------------------


def test_flag_refuses_float8_and_unknown_values_naming_it(qwen3_ckpt, capsys):
    from tidal.launch import spawn
    from tidal.launch.args import build_engine_config
    from tidal.launch.engine_args import EngineArgs

    for bad in ("fp8", "fp8_e4m3", "int8"):
        with pytest.raises(ValueError, match=f"^kv_cache_dtype must be one of .*got '{bad}'"):
            EngineArgs(model=qwen3_ckpt, kv_cache_dtype=bad).create_engine_config()
    parser = spawn.make_parser()
    with pytest.raises(SystemExit):
        build_engine_config(parser, parser.parse_args(["--model", qwen3_ckpt, "--kv-cache-dtype", "fp8"]))
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8" in err


@pytest.mark.parametrize(
    ("model_dtype", "kv", "want"),
    [("float32", "auto", F32), ("bfloat16", "auto", BF16), ("float32", "bfloat16", BF16),
     ("bfloat16", "float32", F32), ("float32", "float16", F16)],
)  # fmt: skip
def test_auto_is_the_models_dtype_and_the_hash_holds_the_resolved_one(
    qwen3_ckpt, model_dtype, kv, want
):
    from tidal.launch.engine_args import EngineArgs

    def config(dtype, kv_dtype):
        args = EngineArgs(model=qwen3_ckpt, dtype=dtype, kv_cache_dtype=kv_dtype)
        return args.create_engine_config()

    cfg = config(model_dtype, kv)
    assert cfg.kv_cache_torch_dtype == want
    # Ranks compare what their caches hold, not how it was asked for.
    same = config(model_dtype, str(want).removeprefix("torch."))
    assert same.config_hash() == cfg.config_hash()
    other = F32 if want != F32 else BF16
    assert config(model_dtype, str(other)[6:]).config_hash() != cfg.config_hash()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"], ids=["gqa-kv", "mla-latent"])
def test_a_16bit_cache_holds_twice_the_tokens_and_serves_the_model(tiny_ckpt, model_type):
    """float32 model: a bfloat16 cache takes half the bytes per token, so the same
    --kv-cache-memory-bytes gives twice the blocks; the runner allocates it in bfloat16
    (GQA's K/V and MLA's latent), the model writes into it and reads it back (a prefill,
    decode steps, a prefill continuing the cached prefix) with logits close to those of a
    float32 cache."""
    from tidal.executor.model_runner import ModelRunner
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.loader import load_model

    budget = 80 * 1024  # whole float32 blocks of either layout: 8 KiB (GQA), 5 KiB (MLA)
    runners = {}
    for kv in ("float32", "bfloat16"):
        args = EngineArgs(
            model=tiny_ckpt(model_type), device="cpu", dtype="float32", kv_cache_dtype=kv,
            kv_cache_memory_bytes=budget, max_model_len=64, cpu_kernels="native",
        )  # fmt: skip
        runner = ModelRunner(args.create_engine_config(), torch.device("cpu"))
        runner.model = runners["float32"].model if runners else load_model(runner.config)
        runners[kv] = runner
    f32, bf16 = runners["float32"], runners["bfloat16"]
    assert 2 * bf16.kv_bytes_per_block() == f32.kv_bytes_per_block()
    assert bf16.kv_cache_info()["bytes_per_token"] * 2 == f32.kv_cache_info()["bytes_per_token"]
    assert bf16.kv_cache_info()["dtype"] == "bfloat16"
    blocks = {kv: r.determine_num_blocks() for kv, r in runners.items()}
    assert blocks["bfloat16"] == 2 * blocks["float32"] == 2 * (budget // f32.kv_bytes_per_block())
    assert bf16.kv_cache_bytes(blocks["bfloat16"]) <= budget

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (21,), generator=g).tolist()
    logits = {}
    for kv, runner in runners.items():
        runner.initialize_kv_cache(blocks[kv])
        assert {c.dtype for c in runner.kv_caches} == {getattr(torch, kv)}
        table = list(range(1, 6))  # 5 blocks of 16 cover the 24 positions
        steps = [(0, prompt[:9]), (9, prompt[9:10]), (10, prompt[10:11]), (11, prompt[11:])]
        out = []
        for start, toks in steps:
            meta = AttentionMetadata.build([(start, len(toks), table)], 16, "cpu")
            pos = torch.arange(start, start + len(toks))
            out.append(runner.model.compute_logits(runner.model(torch.tensor(toks), pos, meta)))
        logits[kv] = torch.cat(out)  # [21, V]
        assert torch.count_nonzero(runner.kv_caches[0]) > 0  # written
    # The first chunk attends its own (float32) K/V: equal; later ones read the rounded cache.
    assert torch.equal(logits["bfloat16"][:9], logits["float32"][:9])
    err = (logits["bfloat16"][9:] - logits["float32"][9:]).abs().max().item()
    assert 0 < err < 0.05


def test_a_joining_engine_gets_the_cache_dtype(qwen3_ckpt):
    """An elastic scale-up starts its new ranks from the launcher's config (cold or from
    the warm zygote) through the launch payload: the cache dtype crosses it, so the new
    rank's runner allocates the same cache, and its config hash (checked at the join)
    equals the deployment's."""
    from tidal.engine_core.entry import decode_engine_launch, encode_engine_launch
    from tidal.launch.engine_args import EngineArgs

    config = EngineArgs(
        model=qwen3_ckpt, dtype="float32", kv_cache_dtype="bfloat16"
    ).create_engine_config()
    joining = config.with_parallel(data_parallel_rank=3)
    got = decode_engine_launch(encode_engine_launch(joining, 3, "tcp://127.0.0.1:1")).config
    assert got.cache.kv_cache_dtype == "bfloat16" and got.kv_cache_torch_dtype == BF16
    assert got.config_hash() == config.config_hash()
