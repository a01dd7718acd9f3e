"""Our model runtime vs transformers' own model classes on the same tiny checkpoints.

Logits must agree in float32 (atol 1e-4) for: a flattened multi-prompt prefill, paged
decode steps over shuffled blocks, chunked prefill, a prefix read through another
sequence's blocks, and a mixed prefill+decode batch; greedy decoding must equal
``generate(do_sample=False)``. Also: loader errors, expert subsets, alternative
checkpoint layouts, and the tiny-checkpoint factory itself.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import shutil

import pytest
import torch

from tidal.launch.engine_args import EngineArgs
from tidal.layers.attention import AttentionMetadata
from tidal.models.loader import CheckpointError, load_model
from tidal.models.registry import (
    entry_for_model_type,
    get_model_class,
    model_types,
    resolve_architecture,
    supported_architectures,
)
from tidal.models.tiny import make_tiny_checkpoint

ATOL = 1e-4
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM  # lazy: see tests/conftest.py

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _our_model(path: str, **kwargs):
    return load_model(EngineArgs(model=path, device="cpu").create_engine_config(), **kwargs)


@pytest.fixture(scope="module", params=model_types())
def models(request, tiny_ckpt):
    """Every registered architecture's tiny checkpoint (its switches on): ours and
    transformers' model of it."""
    path = tiny_ckpt(request.param)
    return _our_model(path), _hf_model(path)


class PagedRunner:
    """Drives our model as the model runner does: a paged cache, shuffled block ids."""

    def __init__(self, model, num_blocks: int = 96, seed: int = 0) -> None:
        spec = model.kv_cache_spec()
        shape = spec.layer_shape(num_blocks, BLOCK_SIZE)
        dtype = model.embed_tokens.weight.dtype
        model.bind_kv_cache([torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)])
        self.model = model
        self.free = torch.randperm(
            num_blocks, generator=torch.Generator().manual_seed(seed)
        ).tolist()
        self.blocks: dict[str, list[int]] = {}

    def step(self, items: list[tuple[str, int, list[int]]]) -> torch.Tensor:
        """items[i] = (seq id, start, new token ids) -> logits [T, V] of all new tokens."""
        seqs = []
        for sid, start, toks in items:
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * BLOCK_SIZE < start + len(toks):
                blocks.append(self.free.pop())
            seqs.append((start, len(toks), blocks))
        meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu")
        ids = torch.tensor([t for _, _, toks in items for t in toks])
        pos = torch.cat([torch.arange(s, s + len(toks)) for _, s, toks in items])
        return self.model.compute_logits(self.model(ids, pos, meta))


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, V]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < ATOL, f"max |diff| {err:.3g}"


def test_flattened_prefill_then_paged_decode(models):
    ours, hf = models
    runner = PagedRunner(ours)
    prompts = _prompts(ours.spec.vocab_size, [7, 13, 1, 5])
    logits = runner.step([(f"s{i}", 0, p) for i, p in enumerate(prompts)])
    row = 0
    for p in prompts:
        _close(logits[row : row + len(p)], _hf_logits(hf, p))
        row += len(p)
    seqs = [list(p) for p in prompts]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = logits[ends].argmax(-1).tolist()
    for _ in range(6):  # sequences of different lengths cross block boundaries here
        logits = runner.step([(f"s{i}", len(s), [t]) for i, (s, t) in enumerate(zip(seqs, nxt))])
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            _close(logits[i], _hf_logits(hf, seqs[i])[-1])
        nxt = logits.argmax(-1).tolist()


def test_chunked_prefill(models):
    ours, hf = models
    runner = PagedRunner(ours, seed=1)
    (prompt,) = _prompts(ours.spec.vocab_size, [13], seed=1)
    want = _hf_logits(hf, prompt)
    start = 0
    for size in (3, 6, 4):  # chunk edges inside blocks
        got = runner.step([("a", start, prompt[start : start + size])])
        _close(got, want[start : start + size])
        start += size


def test_prefix_read_through_shared_blocks(models):
    ours, hf = models
    runner = PagedRunner(ours, seed=2)
    shared, tail_a, tail_b = _prompts(ours.spec.vocab_size, [8, 3, 6], seed=2)
    runner.step([("a", 0, shared + tail_a)])
    # b reuses a's first two blocks (the 8 shared tokens) and computes only its tail.
    runner.blocks["b"] = runner.blocks["a"][:2]
    got = runner.step([("b", len(shared), tail_b)])
    _close(got, _hf_logits(hf, shared + tail_b)[len(shared) :])


def test_mixed_prefill_and_decode_batch(models):
    ours, hf = models
    runner = PagedRunner(ours, seed=3)
    p0, p1, p2, p3 = _prompts(ours.spec.vocab_size, [5, 9, 6, 10], seed=3)
    runner.step([("d0", 0, p0[:-1]), ("d1", 0, p1[:-1]), ("c", 0, p3[:4])])
    # decode, prefill, decode, chunk continuation: decode rows are not contiguous.
    got = runner.step([("d0", 4, p0[-1:]), ("p", 0, p2), ("d1", 8, p1[-1:]), ("c", 4, p3[4:])])
    _close(got[0], _hf_logits(hf, p0)[-1])
    _close(got[1:7], _hf_logits(hf, p2))
    _close(got[7], _hf_logits(hf, p1)[-1])
    _close(got[8:], _hf_logits(hf, p3)[4:])


def test_greedy_matches_generate(models):
    ours, hf = models
    runner = PagedRunner(ours, num_blocks=64, seed=4)
    prompts = _prompts(ours.spec.vocab_size, [6, 11], seed=4)
    new = 20
    logits = runner.step([(f"s{i}", 0, p) for i, p in enumerate(prompts)])
    nxt = logits[torch.tensor([5, 16])].argmax(-1).tolist()
    outs = [[t] for t in nxt]
    for step in range(new - 1):
        items = [(f"s{i}", len(p) + step, [o[-1]]) for i, (p, o) in enumerate(zip(prompts, outs))]
        for o, t in zip(outs, runner.step(items).argmax(-1).tolist()):
            o.append(t)
    eos = set(hf.generation_config.eos_token_id)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False, max_new_tokens=new,
            )[0, len(p) :].tolist()  # fmt: skip
        assert o[: len(ref)] == ref
        assert len(ref) == new or ref[-1] in eos  # generate stops early only at EOS


def test_dense_layers_untopk_and_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(
        str(tmp_path / "variant"), "qwen3_moe", hidden_size=32, num_layers=3, num_experts=4,
        top_k=2, vocab_size=300, max_position_embeddings=64, norm_topk_prob=False,
        tie_word_embeddings=True, mlp_only_layers=[1],
    )  # fmt: skip
    ours, hf = _our_model(path), _hf_model(path)
    assert [layer.is_moe for layer in ours.layers] == [True, False, True]
    assert ours.lm_head.weight is ours.embed_tokens.weight
    (prompt,) = _prompts(300, [9], seed=5)
    _close(PagedRunner(ours).step([("a", 0, prompt)]), _hf_logits(hf, prompt))


def test_local_expert_subset_and_map(qwen3_ckpt):
    from safetensors import safe_open

    full = _our_model(qwen3_ckpt)
    part = _our_model(qwen3_ckpt, local_expert_ids=[5, 1, 2])
    moe = part.moe_layers()[0]
    w = moe.read_weights(["w13", "w2"])  # rebuilt where a CPU path packed them
    assert w["w13"].shape[0] == 3 and moe.expert_map.tolist() == [-1, 1, 2, -1, -1, 0, -1, -1]
    with safe_open(os.path.join(qwen3_ckpt, "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.0.mlp.experts.5.gate_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.experts.2.down_proj.weight")
    inter = w["w2"].shape[2]
    assert torch.equal(w["w13"][0, :inter], gate) and torch.equal(w["w2"][2], down)
    assert torch.equal(w["w13"][1], full.moe_layers()[0].expert_weights([1])[0][0])


def _rewrite(src: str, dst, edit) -> str:
    """Copy a checkpoint folder, passing its tensors through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})
    return str(dst)


def test_loader_names_missing_tensor(qwen3_ckpt, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    path = _rewrite(
        qwen3_ckpt, tmp_path / "ck", lambda t: {k: v for k, v in t.items() if k != name}
    )
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor\(s\): " + name.replace(".", r"\.")
    ):
        _our_model(path)


def test_loader_names_shape_mismatch(qwen3_ckpt, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _rewrite(qwen3_ckpt, tmp_path / "ck", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \(31, 64\).*expects \(32, 64\)"):
        _our_model(path)


def test_loader_names_unexpected_tensor(mixtral_ckpt, tmp_path):
    path = _rewrite(
        mixtral_ckpt, tmp_path / "ck", lambda t: {**t, "model.layers.0.extra.weight": torch.ones(2)}
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.extra\.weight"
    ):
        _our_model(path)


def test_unsupported_architecture_is_named():
    from transformers import AutoConfig, LlamaConfig

    every = (
        "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM, "
        "MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"
    )
    assert ", ".join(supported_architectures()) == every
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=f"LlamaForCausalLM.*supported: {every}$"):
        resolve_architecture(cfg)
    with pytest.raises(ValueError, match=f"LlamaForCausalLM; supported: {every}$"):
        get_model_class("LlamaForCausalLM")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        resolve_architecture(LlamaConfig())  # no architectures at all
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_checkpoint("/nonexistent", "llama")
    assert resolve_architecture(
        AutoConfig.for_model("mixtral", architectures=["LlamaForCausalLM", "MixtralForCausalLM"])
    ) == "MixtralForCausalLM"


@pytest.mark.parametrize("model_type", model_types())
def test_registry_entry_builds_its_architecture(tiny_ckpt, model_type):
    """The tiny factory builds each entry with transformers' classes the entry names: the
    checkpoint's config names the entry's architecture, which resolves to its class."""
    from transformers import AutoConfig

    entry = entry_for_model_type(model_type)
    cfg = AutoConfig.from_pretrained(tiny_ckpt(model_type))
    assert type(cfg).__name__ == entry.hf_config_class and cfg.model_type == model_type
    assert cfg.architectures == [entry.architecture] == [entry.hf_model_class]
    assert get_model_class(resolve_architecture(cfg)) is entry.model


def test_fused_expert_names_and_sharded_index(models, tmp_path):
    """transformers v5's in-memory layout (fused 3-D experts) saved as 3 shards + index."""
    from safetensors.torch import save_file

    ours, hf = models
    src = hf.name_or_path
    dst = tmp_path / "fused"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    names = sorted(state)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: state[k] for k in shard}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reloaded = _our_model(str(dst))
    # By name: a parameter a CPU path packed at load comes last in state_dict(), and which
    # path wins the load-time measurement may differ between the two loads.
    got, want = reloaded.state_dict(), ours.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_tiny_factory_is_deterministic(tmp_path):
    kw = {"hidden_size": 32, "num_layers": 1, "num_experts": 4, "vocab_size": 300}
    a = make_tiny_checkpoint(str(tmp_path / "a"), "mixtral", **kw)
    b = make_tiny_checkpoint(str(tmp_path / "b"), "mixtral", **kw)
    c = make_tiny_checkpoint(str(tmp_path / "c"), "mixtral", seed=1, **kw)
    files = sorted(os.listdir(a))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
        files
    )
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == [] and errors == []
    assert not filecmp.cmp(
        os.path.join(a, "model.safetensors"), os.path.join(c, "model.safetensors"), shallow=False
    )


def test_tokenizer_round_trip_and_chat_template(qwen3_ckpt):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(qwen3_ckpt)
    cfg = AutoConfig.from_pretrained(qwen3_ckpt)
    assert len(tok) == cfg.vocab_size == 512
    text = "Hello, tide! 42 waves\nand a 🌊."
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id
    gen = GenerationConfig.from_pretrained(qwen3_ckpt)
    assert set(gen.eos_token_id) == {tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        chat
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(chat)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # specials stay one id


def test_random_model_greedy_is_not_degenerate(models):
    """The factory's init std keeps greedy continuations varied (useful for e2e checks)."""
    ours, _ = models
    runner = PagedRunner(ours, seed=6)
    (prompt,) = _prompts(ours.spec.vocab_size, [4], seed=6)
    toks = [runner.step([("a", 0, prompt)])[-1].argmax().item()]
    for i in range(19):
        toks.append(runner.step([("a", len(prompt) + i, toks[-1:])])[0].argmax().item())
    assert len(set(toks)) >= 6, toks


def test_default_model_path_is_built_once(tmp_path, monkeypatch):
    from tidal.models import tiny

    path = tiny.default_model_path(cache_dir=str(tmp_path))
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert tiny.default_model_path(cache_dir=str(tmp_path)) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp leftovers
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    assert (cfg["architectures"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (
        ["Qwen3MoeForCausalLM"],
        256,
        4,
    )
    assert (
        cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"],
        cfg["num_experts_per_tok"],
    ) == (16, 4)
    built = []
    monkeypatch.setattr(tiny, "make_tiny_checkpoint", lambda p, **kw: built.append(p))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.default_model_path().startswith(str(tmp_path / "xdg" / "tidal" / "default-"))
    assert len(built) == 1


def test_bfloat16_model_runs_close_to_float32(qwen3_ckpt):
    """bf16 takes the non-fused norm paths and bf16 GEMMs: same logits up to bf16 rounding."""
    engine = EngineArgs(model=qwen3_ckpt, dtype="bfloat16", device="cpu").create_engine_config()
    ours16, ours32 = load_model(engine), _our_model(qwen3_ckpt)
    assert ours16.embed_tokens.weight.dtype == torch.bfloat16
    runners = [PagedRunner(ours16, seed=7), PagedRunner(ours32, seed=7)]
    (prompt,) = _prompts(512, [9], seed=7)
    got, want = (r.step([("a", 0, prompt)]) for r in runners)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 0.15
    got, want = (r.step([("a", 9, [5])]) for r in runners)
    assert (got - want).abs().max().item() < 0.15


def test_qwen2_moe_dense_layers_and_shared_expert(tmp_path):
    """decoder_sparse_step and mlp_only_layers give dense layers (no shared expert there);
    a MoE layer's shared expert and its gate load whole on a rank with a subset of the
    routed experts (EP: replicated, never placed) and on a joining elastic rank, which
    reads no routed expert."""
    path = make_tiny_checkpoint(
        str(tmp_path / "q2"), "qwen2_moe", hidden_size=32, num_layers=4, num_experts=4,
        top_k=2, vocab_size=300, max_position_embeddings=64, decoder_sparse_step=2,
        mlp_only_layers=[3], shared_expert_intermediate_size=24, norm_topk_prob=False,
    )  # fmt: skip
    ours, hf = _our_model(path), _hf_model(path)
    assert [layer.is_moe for layer in ours.layers] == [False, True, False, False]
    assert [layer.shared_experts is not None for layer in ours.layers] == [False, True] + [False] * 2
    (prompt,) = _prompts(300, [9], seed=8)
    _close(PagedRunner(ours).step([("a", 0, prompt)]), _hf_logits(hf, prompt))
    part = _our_model(path, local_expert_ids=[3])
    joining = _our_model(path, load_experts=False)  # elastic EP: routed experts from peers
    assert part.moe_layers()[0].read_weights(["w13"])["w13"].shape[0] == 1
    assert torch.count_nonzero(joining.moe_layers()[0].read_weights(["w13"])["w13"]) == 0
    for name, value in ours.layers[1].shared_experts.state_dict().items():
        assert torch.equal(part.layers[1].shared_experts.state_dict()[name], value), name
        assert torch.equal(joining.layers[1].shared_experts.state_dict()[name], value), name


def test_glm4_moe_switches_and_mtp_layers(tiny_ckpt, tmp_path):
    """The tiny GLM-4.5 runs every switch (a dense first layer, half-rotary heads, sigmoid
    routing over 2 groups with a non-zero bias and scaling, shared experts, q/k norm, QKV
    bias): its parity is the ``models`` tests'. A checkpoint's MTP layers (after the last
    decoder layer) are skipped; an unknown tensor of a served layer is still named."""
    path = tiny_ckpt("glm4_moe")
    ours = _our_model(path)
    spec = ours.spec
    assert spec.moe_layer_mask == (False, True) and spec.rotary_dim == spec.head_dim // 2
    r = spec.routing
    assert (r.num_groups, r.topk_group, r.correction_bias, r.scaling_factor) == (2, 1, True, 2.5)
    assert not r.plain_softmax and spec.shared_expert_intermediate_size == 32
    assert spec.qkv_bias and not spec.o_bias and spec.qk_norm.name == "PER_HEAD"
    assert ours.moe_layers()[0].score_bias.abs().min() > 0
    extra = {"model.layers.2.mlp.gate.weight": torch.ones(8, 64)}  # an MTP layer's
    mtp = _rewrite(path, tmp_path / "mtp", lambda t: {**t, **extra})
    got, want = _our_model(mtp).state_dict(), ours.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], value) for name, value in want.items())
    bad = _rewrite(path, tmp_path / "bad", lambda t: {**t, "model.layers.1.x.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): model\.layers\.1\.x"):
        _our_model(bad)


def test_olmoe_norms_over_the_whole_width_and_clips(tiny_ckpt):
    """OLMoE's q/k norms hold one weight over all heads; its clip_qkv is live in the tiny
    checkpoint (without the clamp the logits leave transformers')."""
    path = tiny_ckpt("olmoe")
    ours, hf = _our_model(path), _hf_model(path)
    attn = ours.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    assert attn.qkv_clip == 2.0
    (prompt,) = _prompts(512, [12], seed=9)
    want = _hf_logits(hf, prompt)
    _close(PagedRunner(ours).step([("a", 0, prompt)]), want)
    for layer in ours.layers:
        layer.self_attn.qkv_clip = None
    unclipped = PagedRunner(ours, seed=1).step([("a", 0, prompt)])
    assert (unclipped - want).abs().max().item() > 100 * ATOL


def test_gpt_oss_refuses_mxfp4(tiny_ckpt):
    """The upstream MXFP4 checkpoint is refused by name (only the dequantised layout is
    served)."""
    from transformers import AutoConfig

    path = tiny_ckpt("gpt_oss")
    cfg = AutoConfig.from_pretrained(path)
    cfg.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(NotImplementedError, match="mxfp4"):
        get_model_class("GptOssForCausalLM").spec_from_config(cfg)


def test_gpt_oss_layers_alternate_windows_and_read_interleaved_experts(tiny_ckpt):
    """``layer_types`` gives the windows; ``gate_up_proj``'s even columns are the gate."""
    from safetensors.torch import load_file

    path = tiny_ckpt("gpt_oss")
    ours = _our_model(path)
    assert [layer.self_attn.attn.sliding_window for layer in ours.layers] == [8, None]
    # Two KV cache groups (sliding, full), each layer the first of its group: one tensor
    # per page holds both layers' blocks.
    spec = ours.kv_cache_spec()
    assert spec.group_windows == (8, None) and spec.layer_groups() == [0, 1]
    assert spec.layer_pages() == [0, 0] and spec.num_pages == 1
    assert spec.bytes_per_block(torch.float32, 4) * 2 == spec.bytes_per_token(torch.float32) * 4
    stored = load_file(os.path.join(path, "model.safetensors"))
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"][3]  # [H, 2I]
    moe = ours.layers[1].mlp
    weights = moe.read_weights(["w13", "w2"])  # held packed where the C++ path serves
    inter = weights["w2"].shape[2]
    assert torch.equal(weights["w13"][3, :inter], gate_up[:, 0::2].t())
    assert torch.equal(weights["w13"][3, inter:], gate_up[:, 1::2].t())
    bias = stored["model.layers.1.mlp.experts.gate_up_proj_bias"][3]
    assert torch.equal(moe.w13_bias[3], torch.cat((bias[0::2], bias[1::2])))


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096},  # GPT-OSS's
        {"factor": 4.0, "original_max_position_embeddings": 256},  # truncated, defaults
        {"factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.3},
    ],  # fmt: skip
    ids=["gpt-oss", "truncated", "attention-factor"],
)
def test_yarn_table_matches_transformers(params):
    """YaRN's frequencies and cos/sin scale as transformers computes them (GPT-OSS's
    rotary: halves, not interleaved, so the table is the rotate-half one)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from tidal.layers.rotary import RotaryEmbedding, rope_theta_from_config, yarn_from_config

    cfg = GptOssConfig(
        head_dim=64, max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params},
    )  # fmt: skip
    yarn = yarn_from_config(cfg)
    assert yarn is not None
    ours = RotaryEmbedding(64, 8192, rope_theta_from_config(cfg), yarn=yarn)
    pos = torch.tensor([0, 1, 7, 300, 4095, 8191])
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    got_cos, got_sin = ours.cos_sin(pos)
    torch.testing.assert_close(got_cos[:, 0], torch.cat((cos[0], cos[0]), -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_sin[:, 0], torch.cat((-sin[0], sin[0]), -1), atol=1e-6, rtol=0)


def test_deepseek_v3_switches_latent_cache_and_mtp_layers(tiny_ckpt, tmp_path):
    """The tiny DeepSeek-V3 runs every switch (q LoRA, a dense first layer, sigmoid routing
    over 2 groups with a non-zero bias, renormalised and scaled, a shared expert): its
    parity is the ``models`` tests'. Its cache is the latent, one vector per token shared
    by the heads; the MTP layers of a checkpoint are skipped."""
    path = tiny_ckpt("deepseek_v3")
    ours = _our_model(path)
    spec = ours.spec
    assert spec.moe_layer_mask == (False, True) and spec.shared_expert_intermediate_size == 32
    r = spec.routing
    assert (r.scoring.name, r.num_groups, r.topk_group, r.correction_bias) == ("SIGMOID", 2, 1, True)
    assert r.renormalize and r.scaling_factor == 2.5
    attn = ours.layers[0].self_attn
    assert attn.q_a_proj is not None and spec.mla.q_lora_rank == 24
    cache = ours.kv_cache_spec()
    assert (cache.layout.name, cache.num_layers, cache.head_dim) == ("LATENT", 2, 32 + 8)
    assert cache.layer_shape(5, 4) == (5, 4, 40)
    extra = {"model.layers.2.mlp.gate.weight": torch.ones(8, 64)}  # an MTP layer's
    mtp = _rewrite(path, tmp_path / "mtp", lambda t: {**t, **extra})
    got, want = _our_model(mtp).state_dict(), ours.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], value) for name, value in want.items())


def test_deepseek_v2_without_q_lora_routes_by_softmax_groups(tiny_ckpt):
    """V2-Lite's shape: queries straight from q_proj; softmax group-limited greedy routing,
    scaled and not renormalised (as transformers' V2 router); every layer MoE."""
    ours = _our_model(tiny_ckpt("deepseek_v2"))
    spec = ours.spec
    assert spec.moe_layer_mask == (True, True) and spec.mla.q_lora_rank == 0
    assert ours.layers[0].self_attn.q_a_proj is None
    r = spec.routing
    assert (r.scoring.name, r.num_groups, r.topk_group, r.correction_bias) == ("SOFTMAX", 2, 1, False)
    assert not r.renormalize and r.scaling_factor == 1.5 and not r.plain_softmax


def test_deepseek_layer_freq_and_greedy_routing():
    """``moe_layer_freq`` (DeepSeek's own rule: MoE from ``first_k_dense_replace`` on, every
    freq-th layer; transformers' classes ignore it, so no checkpoint parity) and V2's plain
    ``greedy`` top-k."""
    from transformers import DeepseekV2Config

    from tidal.models.deepseek_v2 import DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2, n_routed_experts=8,
        num_experts_per_tok=2, topk_method="greedy", routed_scaling_factor=1.0, q_lora_rank=None,
    )  # fmt: skip
    spec = DeepseekV2ForCausalLM.spec_from_config(cfg)
    assert spec.moe_layer_mask == (False, False, True, False, True, False)
    assert spec.routing.plain_softmax and spec.routing.num_groups == 1


@pytest.fixture(scope="module")
def deepseek_yarn(tiny_ckpt_root):
    """DeepSeek-V3 with YaRN rope (factor 4 over 16 original positions) whose mscale and
    mscale_all_dim differ: cos/sin scaled by their ratio, the softmax by mscale_all_dim's."""
    entry = entry_for_model_type("deepseek_v3")
    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 8, "beta_slow": 1,
    }  # fmt: skip
    return make_tiny_checkpoint(
        os.path.join(tiny_ckpt_root, "deepseek_v3_yarn"), "deepseek_v3", hidden_size=64,
        num_layers=2, num_experts=8, top_k=2, vocab_size=512, max_position_embeddings=64,
        rope_parameters=rope, **entry.test_config,
    )  # fmt: skip


def test_deepseek_yarn_beyond_the_original_context(deepseek_yarn):
    """A 40-token prompt (past original_max_position_embeddings 16) prefilled whole, in
    chunks, and decoded: logits equal transformers'. Without the YaRN attention factor or
    the softmax mscale they would not (the check that both are live)."""
    from tidal.layers.rotary import yarn_mscale

    ours, hf = _our_model(deepseek_yarn), _hf_model(deepseek_yarn)
    mla = ours.spec.mla
    assert mla.softmax_scale == pytest.approx(24**-0.5 * yarn_mscale(4.0, 0.8) ** 2)
    assert ours.rotary.cos_table[0, 0].item() == pytest.approx(
        yarn_mscale(4.0, 1.0) / yarn_mscale(4.0, 0.8)
    )
    (prompt,) = _prompts(512, [40], seed=11)
    want = _hf_logits(hf, prompt)
    _close(PagedRunner(ours).step([("a", 0, prompt)]), want)
    runner = PagedRunner(ours, seed=5)
    start = 0
    for size in (13, 10, 17):  # chunk edges inside blocks, the last past position 16
        _close(runner.step([("a", start, prompt[start : start + size])]), want[start : start + size])
        start += size
    nxt = want[-1].argmax().item()
    _close(runner.step([("a", 40, [nxt])])[0], _hf_logits(hf, prompt + [nxt])[-1])
    # The scale is live: the plain one gives other logits.
    ours.layers[0].self_attn.spec = dataclasses.replace(mla, softmax_scale=24**-0.5)
    assert (PagedRunner(ours).step([("a", 0, prompt)]) - want).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize(
    ("model_type", "per_token", "groups"),
    [
        # latent: (kv_lora_rank 32 + qk_rope_head_dim 8) x float32 x 2 layers
        pytest.param("deepseek_v3", (32 + 8) * 4 * 2, 1, id="mla-latent"),
        # K and V: 2 x 2 KV heads x head_dim 16 x float32 x 2 layers
        pytest.param("qwen3_moe", 2 * 2 * 16 * 4 * 2, 1, id="gqa-kv"),
        # the same, a sliding and a full layer: two groups sharing one tensor
        pytest.param("gpt_oss", 2 * 2 * 16 * 4 * 2, 2, id="kv-groups"),
    ],
)
def test_kv_bytes_follow_the_models_cache_spec(tiny_ckpt, model_type, per_token, groups):
    """The runner sizes blocks and allocates layers from the model's cache spec: MLA's
    latent is (kv_lora_rank + qk_rope_head_dim) values per token and layer. With KV cache
    groups a block is a page of the shared tensors, so the same budget gives as many
    more blocks as a request's tables take (one per group)."""
    from tidal.executor.model_runner import ModelRunner

    config = EngineArgs(model=tiny_ckpt(model_type), device="cpu").create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.model = load_model(config)
    spec = runner.model.kv_cache_spec()
    assert spec.bytes_per_token(torch.float32) == per_token
    assert runner.kv_bytes_per_block() == per_token * runner.block_size // groups
    info = runner.kv_cache_info()  # what /stats shows
    assert info["bytes_per_token"] == per_token
    assert len(info.get("kv_groups", [None])) == groups
    runner.initialize_kv_cache(6)
    assert len(runner.kv_caches) == 2 // groups
    total = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert total == 6 * runner.block_size * per_token // groups
