"""Fast CPU paths vs their slow references: MoE expert strategies and weight layouts,
input-major Linear weights, and the paged decode attention (batched bmm path vs a
per-sequence oracle, and the cache rows it writes)."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from tidal.kernels.cpu_ext import kernel_available, kernel_status
from tidal.kernels.cpu_moe import CpuPackedExperts
from tidal.kernels.fused_moe_torch import (
    STRATEGIES,
    PackedExperts,
    _choose,
    fused_experts_torch,
    is_k_major,
    k_major_experts,
)
from tidal.kernels.onednn import SMALL_WEIGHT, onednn_available, prefers_packed
from tidal.kernels.select import Candidate, Choice
from tidal.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    decode_attention_reference,
    kv_cache_shape,
)
from tidal.layers.linear import Linear
from tidal.moe.layer import FusedMoE, build_expert_map
from tidal.moe.reference import fused_experts_reference
from tidal.moe.router import softmax_topk

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


# ---- MoE experts -----------------------------------------------------------------------


def _moe_problem(tokens: int, experts: int, top_k: int, local: int, skew: float = 0.0):
    x = torch.randn(tokens, 32)
    w13 = torch.randn(local, 2 * 16, 32) * 0.2
    w2 = torch.randn(local, 32, 16) * 0.2
    logits = torch.randn(tokens, experts)
    logits[:, 0] += skew  # skew > 0 sends most tokens to expert 0
    weights, ids = softmax_topk(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _experts(x, w13, w2, weights, ids, emap=None, apply=True, *, strategy="auto"):
    """``fused_experts_torch`` with the strategy pinned; ``onednn`` and ``cpp`` get their
    packed copies."""
    if strategy == "onednn" and not onednn_available(w13.dtype):
        pytest.skip(f"no oneDNN prepacked linear for {w13.dtype} in this torch")
    if strategy == "cpp" and (w13.dtype != torch.float32 or not kernel_available()):
        pytest.skip(f"the C++ kernel is float32 only and {kernel_status()}")
    packed = None
    if strategy == "onednn":
        packed = PackedExperts(w13, w2)
    elif strategy == "cpp":
        packed = CpuPackedExperts(w13, w2)
    return fused_experts_torch(
        x, w13, w2, weights, ids, emap, apply, strategy=strategy, packed=packed
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize(
    "tokens,experts,top_k,local,skew",
    [(1, 8, 2, None, 0.0), (3, 16, 4, None, 0.0), (32, 16, 4, None, 0.0), (40, 8, 2, None, 6.0),
     (33, 8, 3, [6, 1, 3], 0.0), (20, 8, 2, [2], 0.0), (17, 8, 2, [7, 6, 5, 4, 3, 2, 1, 0], 0.0)],
)  # fmt: skip
@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_experts_strategies_and_layouts_match_reference(
    strategy, k_major, tokens, experts, top_k, local, skew, apply_router_weight
):
    nloc = experts if local is None else len(local)
    x, w13, w2, weights, ids = _moe_problem(tokens, experts, top_k, nloc, skew)
    emap = None if local is None else build_expert_map(experts, local)
    want = fused_experts_reference(x, w13, w2, weights, ids, emap, apply_router_weight)
    if k_major:
        w13, w2 = k_major_experts(w13, w2)
        assert is_k_major(w13) and is_k_major(w2)
    got = _experts(x, w13, w2, weights, ids, emap, apply_router_weight, strategy=strategy)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_experts_bf16_close_to_float32(strategy):
    x, w13, w2, weights, ids = _moe_problem(24, 8, 2, 8)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    b13, b2 = k_major_experts(w13.bfloat16(), w2.bfloat16())
    got = _experts(x.bfloat16(), b13, b2, weights, ids, strategy=strategy)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_k_major_experts_keeps_shape_values_and_takes_in_place_writes():
    _, w13, w2, _, _ = _moe_problem(1, 4, 1, 4)
    k13, k2 = k_major_experts(w13, w2)
    assert k13.shape == w13.shape and k2.shape == w2.shape
    assert torch.equal(k13, w13) and torch.equal(k2, w2)
    assert not is_k_major(w13) and k13.transpose(1, 2).is_contiguous()
    # What the loader and EPLB do: write a slot through a view; the kernel sees it.
    k13[2] = 0.0
    x, _, _, weights, _ = _moe_problem(5, 4, 1, 4)
    ids = torch.full((5, 1), 2)
    assert torch.count_nonzero(fused_experts_torch(x, k13, k2, weights, ids)) == 0


def test_experts_ids_out_of_range_without_map_contribute_zero():
    x, w13, w2, weights, _ = _moe_problem(4, 8, 2, 4)
    ids = torch.tensor([[0, 5], [-1, 1], [7, 4], [3, 3]])
    want = fused_experts_reference(x, w13, w2, weights, ids)
    for strategy in STRATEGIES:
        got = _experts(x, w13, w2, weights, ids, strategy=strategy)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.count_nonzero(want[2]) == 0  # both of token 2's experts are elsewhere


def _forced(path: str) -> Choice:
    """A choice serving every call by ``path`` (skips where that path is not here)."""
    if path == "native" and not kernel_available():
        pytest.skip(kernel_status())
    if path == "onednn" and not onednn_available():
        pytest.skip("no oneDNN prepacked linear")
    cand = Candidate(path, "nta" if path == "native" else "")
    return Choice.fixed(cand, path)


@pytest.mark.parametrize("path", ["native", "onednn", "torch"])
def test_moe_layer_holds_one_copy_and_follows_every_weight_write(path):
    """Each CPU path of the MoE layer (the C++ kernels, oneDNN, torch) holds the experts
    and the router's gate once, in its own layout; ``read_weights`` rebuilds them exactly
    (an attribute read of a released one fails loudly), and what ``write_weights`` writes
    (expert moves, EPLB; ``set_local_experts`` then an install) is what the next forward
    computes with."""
    choice = _forced(path)
    moe = FusedMoE(8, 2, 32, 16, True)
    moe.set_cpu_path("experts", choice)
    moe.set_cpu_path("router", choice)
    x, w13, w2, _, _ = _moe_problem(12, 8, 2, 8)
    moe.w13.data.copy_(w13)  # the loader's way: views of the parameters, before packing
    moe.w2.data.copy_(w2)
    moe.gate.data.copy_(torch.randn(8, 32))
    moe.pack_weights()
    packed = path != "torch"
    names = ("w13", "w2", "gate")
    assert all(moe.is_released(n) == packed for n in names)
    assert all((n in moe._parameters) != packed for n in names)  # one copy of each
    if packed:
        with pytest.raises(AttributeError, match=r"read_weights\(\['w13'\]\)"):
            moe.w13  # noqa: B018 - the read is the test
    got = moe.read_weights(["w13", "w2"])
    assert torch.equal(got["w13"], w13) and torch.equal(got["w2"], w2)  # rebuilt exactly
    assert torch.equal(moe.expert_weights([6, 1])[0], w13[[6, 1]])
    assert torch.equal(moe.state_dict()["w2"], w2)

    def want() -> torch.Tensor:
        w = moe.read_weights()
        weights, ids = softmax_topk(torch.nn.functional.linear(x, w["gate"]), 2, True)
        return fused_experts_reference(x, w["w13"], w["w2"], weights, ids, moe._map_arg)

    torch.testing.assert_close(moe(x), want(), atol=ATOL, rtol=0)
    assert all((n in moe._parameters) != packed for n in names)  # the reads kept nothing
    # Transfers rebuild just their slots from the layout that holds them, none included
    # (an install that keeps none of a worker's experts: few per worker with TP).
    got13, got2 = moe.expert_weights([6, 1])
    assert torch.equal(got13, w13[[6, 1]]) and torch.equal(got2, w2[[6, 1]])
    none13, none2 = moe.expert_weights([])
    assert none13.shape == (0, *w13.shape[1:]) and none2.shape == (0, *w2.shape[1:])
    moe.write_weights({"gate": torch.randn(8, 32)})  # a new router
    before = moe(x)
    torch.testing.assert_close(before, want(), atol=ATOL, rtol=0)
    flipped = moe.read_weights(["w13"])["w13"]
    flipped[3] *= -1.0  # one expert rewritten, as EPLB and expert installs do
    moe.write_weights({"w13": flipped})  # w2 stays as it was, rebuilt from the pack
    after = moe(x)
    torch.testing.assert_close(after, want(), atol=ATOL, rtol=0)
    assert not torch.allclose(after, before)
    assert torch.equal(moe.read_weights(["w2"])["w2"], w2)
    assert all((n in moe._parameters) != packed for n in names)  # still one copy of each
    moe.set_local_experts([5, 6, 7])  # fewer experts: new storage, map and pack
    moe.set_expert_weights([w13[5:], w2[5:]])
    torch.testing.assert_close(moe(x), want(), atol=ATOL, rtol=0)
    assert all((n in moe._parameters) != packed for n in ("w13", "w2"))  # packed again
    with pytest.raises(ValueError, match=r"'w13' must be \(3, 32, 32\)"):
        moe.write_weights({"w13": w13})  # the old count: named, nothing written


def test_auto_strategy_choice():
    x = torch.zeros(1, 32)
    balanced, skewed, big = [8, 7, 9, 8, 8, 6, 8, 10], [50, 1, 1, 1, 1, 1, 1, 1], [300] * 8
    assert _choose("auto", [1, 1, 0, 0, 0, 0, 0, 0], 2, x, 16) == "loop"  # few busy experts
    assert _choose("auto", balanced, 64, x, 16) == "grouped_mm"  # one thread: no bmm
    torch.set_num_threads(2)  # the fixture restores the count
    assert _choose("auto", balanced, 64, x, 16) == "bmm"
    assert _choose("auto", skewed, 57, x, 16) == "grouped_mm"  # padding would be 7x
    assert _choose("auto", big, 2400, x, 16) == "grouped_mm"  # prefill-sized GEMMs
    assert _choose("auto", skewed, 57, torch.zeros(1, 30), 16) == "loop"  # no grouped_mm
    with pytest.raises(ValueError, match="16-byte"):
        _choose("grouped_mm", [1], 1, torch.zeros(1, 30), 16)


# ---- Linear layout ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_k_major_linear_matches_row_major(bias):
    fast = Linear(24, 40, bias)
    slow = Linear(24, 40, bias, k_major=False)
    assert fast.weight.shape == slow.weight.shape == (40, 24)
    assert fast.weight.t().is_contiguous() and slow.weight.is_contiguous()
    with torch.no_grad():
        w = torch.randn(40, 24)
        for name, part in zip(("q", "k", "v"), w.split([8, 16, 16])):  # loader-style fills
            row = {"q": 0, "k": 8, "v": 24}[name]
            fast.weight.data[row : row + part.shape[0]].copy_(part)
        slow.weight.copy_(w)
        if bias:
            b = torch.randn(40)
            fast.bias.copy_(b)
            slow.bias.copy_(b)
    assert torch.equal(fast.weight, slow.weight)
    x = torch.randn(5, 24)
    torch.testing.assert_close(fast(x), slow(x), atol=ATOL, rtol=0)
    torch.testing.assert_close(fast(x), x @ w.t() + (b if bias else 0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("path", ["native", "onednn"])
def test_weights_api_on_ordinary_and_released_parameters(path):
    """Unreleased, a weight is an ordinary attribute: ``read_weights`` copies it and
    ``write_weights`` writes it in place. Released, the attribute read names
    ``read_weights``; ``read_weights`` and ``state_dict`` give the checkpoint tensor
    exactly; a write of the wrong shape, dtype or name is refused, naming it."""
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(4))
    plain = Linear(24, 40)
    plain.set_cpu_path("linear", _forced("torch"))
    plain.weight.data.copy_(w)
    plain(torch.randn(2, 24))
    assert not plain.is_released("weight") and torch.equal(plain.weight, w)
    plain.read_weights()["weight"].zero_()  # a copy: the parameter is untouched
    assert torch.equal(plain.weight, w)
    storage = plain.weight.data_ptr()
    plain.write_weights({"weight": 2 * w})
    assert plain.weight.data_ptr() == storage and torch.equal(plain.weight, 2 * w)
    held = Linear(24, 40)
    held.set_cpu_path("linear", _forced(path))
    held.weight.data.copy_(w)
    held.pack_weights()
    assert held.is_released("weight") and torch.equal(held.read_weights()["weight"], w)
    assert torch.equal(held.state_dict()["weight"], w)
    with pytest.raises(AttributeError, match=r"Linear\.weight .* read_weights\(\['weight'\]\)"):
        held.weight  # noqa: B018 - the read is the test
    wrong_shape = r"'weight' must be \(40, 24\) torch.float32, got \(40, 23\)"
    with pytest.raises(ValueError, match=wrong_shape):
        held.write_weights({"weight": w[:, :23]})
    with pytest.raises(ValueError, match=r"got \(40, 24\) torch.bfloat16"):
        held.write_weights({"weight": w.bfloat16()})
    with pytest.raises(KeyError, match="no weight 'wieght'"):
        held.write_weights({"wieght": w})
    assert torch.equal(held.read_weights()["weight"], w)  # nothing was written
    assert "weight" not in held._parameters  # and nothing kept


@pytest.mark.parametrize("path", ["native", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_follows_weight_writes(path, bias):
    """The C++ linear's pack and oneDNN's: same outputs as F.linear on the weight, the
    pack the only copy (``read_weights`` rebuilds it exactly), and a ``write_weights``
    is what the next forward computes with."""
    fast = Linear(24, 40, bias)
    fast.set_cpu_path("linear", _forced(path))
    slow = Linear(24, 40, bias)
    slow.set_cpu_path("linear", _forced("torch"))  # the plain F.linear path: the reference
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for lin in (fast, slow):
            lin.weight.copy_(w)
            if bias:
                lin.bias.copy_(torch.randn(40, generator=torch.Generator().manual_seed(2)))
    for shape in ((1, 24), (7, 24), (2, 3, 24)):  # any leading dims
        x = torch.randn(*shape)
        torch.testing.assert_close(fast(x), slow(x), atol=ATOL, rtol=0)
    x = torch.randn(6, 48)[:, ::2]  # strided rows
    torch.testing.assert_close(fast(x), slow(x), atol=ATOL, rtol=0)
    assert fast.is_released("weight") and "weight" not in fast._parameters
    assert not slow.is_released("weight")
    with pytest.raises(AttributeError, match="read_weights"):
        fast.weight  # noqa: B018 - the read is the test
    first = fast._held
    assert first is not None and first.path == path
    fast(x)
    assert fast._held is first  # reused while nothing was written
    rebuilt = fast.read_weights()["weight"]
    assert torch.equal(rebuilt, w) and rebuilt.t().is_contiguous()  # rebuilt, K-major
    assert "weight" not in fast._parameters  # the read kept nothing
    fast.write_weights({"weight": -w})
    slow.write_weights({"weight": -w})
    x = torch.randn(4, 24)
    torch.testing.assert_close(fast(x), slow(x), atol=ATOL, rtol=0)
    want = torch.nn.functional.linear(x, -w, slow.bias)
    torch.testing.assert_close(fast(x), want, atol=ATOL, rtol=0)
    assert fast._held is not first and "weight" not in fast._parameters
    # Other dtypes keep F.linear (the packed paths read float32 and bf16).
    lin16 = Linear(24, 40, bias, dtype=torch.float16)
    assert lin16.cpu_ops()["linear"].candidates == (Candidate("torch"),)


# ---- paged decode attention --------------------------------------------------------------

BS = 4  # block size


def _attention_case(
    lengths: list[int], heads: int, kv_heads: int, num_blocks: int = 64, path: str = "cpp"
):
    attn = PagedAttention(heads, kv_heads, 16)
    if path == "torch_chosen":
        attn.set_cpu_path("decode", _forced("torch"))
    attn.kv_cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, 16))
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    blocks = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    return attn, blocks


@pytest.fixture(params=["cpp", "torch", "torch_chosen", "torch_lazy_rows"])
def decode_path(request, monkeypatch):
    """Which decode path the attention takes: the C++ kernel; the torch path (where the
    kernel is missing, or as the measured choice); or the torch path after
    ``CacheRows.build`` expected the kernel (its rows then built lazily)."""
    if request.param == "cpp" and not kernel_available():
        pytest.skip(kernel_status())
    if request.param in ("torch", "torch_lazy_rows"):
        monkeypatch.setattr("tidal.layers.attention.decode_attention_cpu_ok", lambda *a: False)
    if request.param == "torch":
        monkeypatch.setattr(
            "tidal.layers.attention.decode_attention_cpu_supports", lambda *a: False
        )
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_decode_attention_matches_per_sequence_oracle(heads, kv_heads, decode_path):
    lengths = [1, 5, 8, 9, 3, 12]  # block edges, a first token, unequal padding
    attn, blocks = _attention_case(lengths, heads, kv_heads, path=decode_path)
    meta = AttentionMetadata.build([(n - 1, 1, b) for n, b in zip(lengths, blocks)], BS, "cpu")
    q = torch.randn(len(lengths), heads, 16)
    k, v = torch.randn(len(lengths), kv_heads, 16), torch.randn(len(lengths), kv_heads, 16)
    got = attn(q, k, v, meta)
    # The new K/V landed in each sequence's last position (read back by (block, offset)).
    for i, (n, b) in enumerate(zip(lengths, blocks)):
        block, offset = b[(n - 1) // BS], (n - 1) % BS
        assert torch.equal(attn.kv_cache[0, block, :, offset], k[i])
        assert torch.equal(attn.kv_cache[1, block, :, offset], v[i])
    want = decode_attention_reference(q, attn.kv_cache, list(zip(lengths, blocks)))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_decode_rows_inside_a_mixed_batch_match_oracle(decode_path):
    # decode, 3-token prefill continuing a cached prefix, decode, fresh 2-token prefill
    attn, blocks = _attention_case([7, 9, 4, 2], 4, 2, path=decode_path)
    seqs = [(6, 1, blocks[0]), (6, 3, blocks[1]), (3, 1, blocks[2]), (0, 2, blocks[3])]
    meta = AttentionMetadata.build(seqs, BS, "cpu")
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    out = attn(q, k, v, meta)
    decode_rows = [0, 4]
    want = decode_attention_reference(
        q[decode_rows], attn.kv_cache, [(7, blocks[0]), (4, blocks[2])]
    )
    torch.testing.assert_close(out[decode_rows], want, atol=ATOL, rtol=0)
    # The prefill continuation's last query sees all 9 tokens: the oracle agrees there too.
    last = decode_attention_reference(q[3:4], attn.kv_cache, [(9, blocks[1])])
    torch.testing.assert_close(out[3:4], last, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("window", "with_sinks"), [(5, False), (None, True), (5, True)], ids=["window", "sinks", "both"]
)
def test_windowed_and_sink_attention_match_oracle(window, with_sinks, decode_path):
    """GPT-OSS's layers: decode rows and a prefill continuation (its queries across the
    window's edge) against the oracle, on each decode path (the C++ kernel computes both
    switches; the prefill chunk takes the torch path's explicit mask)."""
    attn, blocks = _attention_case([12, 11, 3], 4, 2, path=decode_path)
    attn.sliding_window = window
    attn.sinks = torch.randn(4) if with_sinks else None
    assert attn.cpu_ops() != {}  # the decode path is chosen for them as for any layer
    seqs = [(11, 1, blocks[0]), (6, 5, blocks[1]), (2, 1, blocks[2])]
    meta = AttentionMetadata.build(seqs, BS, "cpu")
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    out = attn(q, k, v, meta)
    ref = functools.partial(
        decode_attention_reference, cache=attn.kv_cache, sliding_window=window, sinks=attn.sinks
    )
    torch.testing.assert_close(out[[0, 6]], ref(q[[0, 6]], seqs=[(12, blocks[0]), (3, blocks[2])]))
    for row in range(1, 6):  # the chunk's query at position 5 + row sees keys <= it
        want = ref(q[row : row + 1], seqs=[(6 + row, blocks[1])])
        torch.testing.assert_close(out[row : row + 1], want, atol=ATOL, rtol=0)


def test_windowed_and_sink_prefill_from_scratch_matches_oracle():
    """A fresh prefill (no cached keys) past the window, with sinks: each query against
    the oracle reading the keys the layer wrote."""
    attn, blocks = _attention_case([11], 4, 2)
    attn.sliding_window, attn.sinks = 4, torch.randn(4)
    meta = AttentionMetadata.build([(0, 11, blocks[0])], BS, "cpu")
    q, k, v = torch.randn(11, 4, 16), torch.randn(11, 2, 16), torch.randn(11, 2, 16)
    out = attn(q, k, v, meta)
    for row in range(11):
        want = decode_attention_reference(
            q[row : row + 1], attn.kv_cache, [(row + 1, blocks[0])], 4, attn.sinks
        )
        torch.testing.assert_close(out[row : row + 1], want, atol=ATOL, rtol=0)


# ---- model-level layout ------------------------------------------------------------------


def test_model_uses_k_major_layouts_and_matches_row_major_copy(qwen3_ckpt):
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.loader import load_model

    config = EngineArgs(model=qwen3_ckpt, device="cpu").create_engine_config()
    fast = load_model(config)
    slow = load_model(dataclasses.replace(config, cpu_kernels="torch"))
    for module in slow.modules():  # the slow copy: every weight back to row-major storage
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.contiguous()
    for moe in slow.moe_layers():
        for p in (moe.w13, moe.w2, moe.gate):
            p.data = p.data.contiguous()
    w = fast.moe_layers()[0].read_weights()  # as rebuilt where a CPU path packed them
    assert is_k_major(w["w13"]) and is_k_major(w["w2"]) and w["gate"].t().is_contiguous()
    assert fast.layers[0].self_attn.qkv_proj.read_weights()["weight"].t().is_contiguous()
    caches = []
    for model in (fast, slow):
        spec = model.kv_cache_spec()
        caches.append([torch.zeros(spec.layer_shape(16, BS)) for _ in range(spec.num_layers)])
        model.bind_kv_cache(caches[-1])
    ids = torch.randint(3, fast.spec.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    seqs = [(0, 5, [1, 2]), (0, 4, [3, 4])]
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3])
    decode = [(5, 1, [1, 2]), (4, 1, [3, 4])]  # then one decode step each
    with torch.inference_mode():
        for step_seqs, step_ids, step_pos in (
            (seqs, ids, pos),
            (decode, ids[:2], torch.tensor([5, 4])),
        ):
            meta = [AttentionMetadata.build(step_seqs, BS, "cpu") for _ in range(2)]
            got, want = (
                m.compute_logits(m(step_ids, step_pos, a)) for m, a in zip((fast, slow), meta)
            )
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_one_row_on_a_small_weight_stays_with_mkl():
    small, big = torch.empty(256, 256), torch.empty(1024, SMALL_WEIGHT // 1024)
    assert not prefers_packed(1, small)  # oneDNN's fixed cost per call would dominate
    assert prefers_packed(2, small) and prefers_packed(1, big)
