"""Tensor-parallel model on real processes (gloo, 127.0.0.1): two workers, each with its
shard (column/row-parallel attention and MLPs, vocab-parallel embedding and lm_head, local
heads and their KV cache, experts split by intermediate or -- with EP -- by token share),
must give the driver the logits and greedy tokens of the unsharded model, step by step
(prefills, a chunked prefill, decodes), and the non-driver no output at all.

The checkpoints cover the odd cases: a vocabulary that does not divide over the workers
(padded block), tied embeddings, attention bias (the row-parallel bias added once), a
dense MLP layer among MoE ones, FP8 block-quantized weights split with their scales, Mixtral's names, shared experts (GLM-4.5, Qwen2-MoE with
EP) and OLMoE's q/k norm over the whole (split) width.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from torch.distributed import TCPStore

from tests.distributed.test_ep_model import (
    ATOL,
    BLOCKS_PER_REQ,
    NUM_BLOCKS,
    REST,
    _sched,
)

TP = 2


def _capture_logits(runner) -> list:
    """Every logits result of the runner's model (None on a worker that is not the driver)."""
    seen: list = []
    inner = runner.model.compute_logits

    def compute_logits(hidden):
        out = inner(hidden)
        seen.append(None if out is None else out.clone())
        return out

    runner.model.compute_logits = compute_logits
    return seen


def _config(path: str, **kw):
    from tidal.launch.engine_args import EngineArgs

    args = {
        "model": path,
        "dtype": "float32",
        "device": "cpu",
        "moe_backend": "torch",
        "block_size": 4,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": 128,
        "tensor_parallel_size": TP,
        **kw,
    }
    return EngineArgs(**args).create_engine_config()


def _requests(vocab: int):
    from tidal.engine_core.request import Request
    from tidal.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(11)
    reqs = []
    for i, n in enumerate((5, 9, 1)):
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
        req = Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=32))
        req.block_ids = list(range(1 + i * BLOCKS_PER_REQ, 1 + (i + 1) * BLOCKS_PER_REQ))
        reqs.append(req)
    return reqs


# Per step: [(request index, tokens)] -- prefill, chunked prefill, mixed, decodes.
SCRIPT = [
    [(0, REST), (1, 4)],
    [(0, REST), (1, REST), (2, REST)],
    [(0, REST), (1, REST), (2, REST)],
    [(2, REST)],  # one token for two workers: the EP share of worker 1 is empty
    [(0, REST), (1, REST), (2, REST)],
]


def _tp_rank(rank: int, world: int, port: int, path: str, ep: bool) -> dict:
    from tidal.executor.model_runner import ModelRunner
    from tidal.executor.worker import Worker

    torch.set_num_threads(1)
    cfg = _config(path, enable_expert_parallel=ep)
    worker = Worker(cfg, tp_rank=rank, dist_timeout_s=120)
    worker.init_tensor_parallel(port)
    worker.init_distributed()
    worker.load_model()
    worker.initialize_kv_cache(NUM_BLOCKS)
    runner = worker.model_runner
    single = cfg.with_parallel(tensor_parallel_size=1, enable_expert_parallel=False)
    ref = ModelRunner(single, torch.device("cpu"))
    ref.load_model()
    ref.initialize_kv_cache(NUM_BLOCKS)
    got_logits, want_logits = _capture_logits(runner), _capture_logits(ref)
    reqs = _requests(cfg.model.hf_config.vocab_size)
    outputs = []
    for step in SCRIPT:
        sched = _sched(step, reqs)
        got = worker.model_runner.execute_model(sched)
        want = ref.execute_model(sched)
        if rank == 0:
            assert got.sampled_token_ids == want.sampled_token_ids, (got, want)
        else:
            assert got.sampled_token_ids == {}  # only the driver samples
        outputs.append(want.sampled_token_ids)
        for sr in sched.scheduled:
            sr.request.num_computed_tokens += sr.num_new_tokens
            for tok in want.sampled_token_ids.get(sr.request.request_id, []):
                sr.request.append_output_token(tok)
    if rank == 0:
        assert len(got_logits) == len(want_logits) > 0
        for g, w in zip(got_logits, want_logits):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-5)
    else:
        assert all(g is None for g in got_logits)
    model = runner.model
    attn = model.layers[0].self_attn
    result = {
        "heads": attn.num_heads,
        "kv_heads": getattr(attn, "num_kv_heads", None),  # None: MLA
        "cache_shape": tuple(runner.kv_caches[0].shape),
        "vocab_rows": model.embed_tokens.weight.shape[0],
        "experts": [m.read_weights(["w13"])["w13"].shape[:2] for m in model.moe_layers()],
        "shared": [  # (this worker's intermediate, the whole one)
            (layer.shared_experts.mlp.inter, model.spec.shared_expert_intermediate_size)
            for layer in model.layers
            if layer.shared_experts is not None
        ],
        "outputs": outputs,
    }
    worker.shutdown()
    return result


def _store() -> TCPStore:
    """The engine's side of the TP group's store: it hosts it (workers are clients)."""
    return TCPStore(
        "127.0.0.1", 0, TP + 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip


@pytest.fixture(scope="module")
def odd_qwen3(tiny_ckpt_root) -> str:
    """Qwen3-MoE with a vocabulary of 509 (not even), tied embeddings, attention bias and
    a dense MLP first layer."""
    from tidal.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(
        os.path.join(tiny_ckpt_root, "qwen3_tp_odd"), "qwen3_moe", hidden_size=64,
        num_layers=2, num_experts=8, top_k=2, vocab_size=509, max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=True, mlp_only_layers=[0],
    )  # fmt: skip


@pytest.fixture(scope="module")
def fp8_qwen3(tiny_ckpt, tiny_ckpt_root) -> str:
    """Qwen3-MoE in FP8 with 32x16 scale blocks: q|k|v and the experts' gate/up rows split
    inside a 32-row block (the held scales are per row), o_proj and down_proj input
    columns on 16-wide block edges."""
    from tidal.models.tiny import make_tiny_fp8_checkpoint

    path = os.path.join(tiny_ckpt_root, "qwen3_fp8_tp")
    if not os.path.isdir(path):
        make_tiny_fp8_checkpoint(path, source=tiny_ckpt("qwen3_moe"), block=(32, 16))
    return path


@pytest.mark.parametrize(
    ("ckpt", "ep"),
    [
        pytest.param("odd_qwen3", False, id="qwen3-odd-vocab-tied-bias-dense"),
        pytest.param("fp8_qwen3", False, id="qwen3-fp8-block-scales"),
        pytest.param("mixtral", False, id="mixtral"),
        pytest.param("qwen3_moe", True, id="qwen3-ep-over-tp"),
        # Shared experts split like a dense MLP (GLM: beside partial rotary, per-head q/k
        # norm, QKV bias without O bias, sigmoid group-limited routing, a dense layer)
        pytest.param("glm4_moe", False, id="glm4-shared-experts"),
        pytest.param("qwen2_moe", True, id="qwen2-shared-expert-ep-over-tp"),
        # q/k norms over the whole width: the squares summed over the workers
        pytest.param("olmoe", False, id="olmoe-full-width-qk-norm"),
        # MLA: heads split, the latent cached whole by each worker; q LoRA, sigmoid groups
        pytest.param("deepseek_v3", False, id="deepseek-v3-mla"),
        pytest.param("deepseek_v2", True, id="deepseek-v2-mla-ep-over-tp"),
    ],
)
def test_tp_forward_matches_the_unsharded_model(run_ranks, request, tiny_ckpt, ckpt, ep):
    fixture = ckpt in ("odd_qwen3", "fp8_qwen3")
    path = request.getfixturevalue(ckpt) if fixture else tiny_ckpt(ckpt)
    store = _store()
    results = run_ranks(_tp_rank, TP, store.port, path, ep, timeout_s=240)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    vocab = hf.vocab_size
    for res in results:
        assert res["heads"] == 4 // TP
        if ckpt.startswith("deepseek"):  # one latent per token, not split: every head reads it
            assert res["kv_heads"] is None and res["cache_shape"][2] == 32 + 8
        else:
            assert res["kv_heads"] == 2 // TP
            assert res["cache_shape"][2] == 2 // TP  # each worker caches its own KV heads
        assert res["vocab_rows"] == -(-vocab // TP)
        for slots, inter2 in res["experts"]:
            if ep:  # whole experts, half of them each
                assert (slots, inter2) == (8 // TP, 2 * 32)
            else:  # every expert, half of its intermediate dimension
                assert (slots, inter2) == (8, 2 * 32 // TP)
        assert all(inter * TP == whole for inter, whole in res["shared"])  # split, not moved
    assert bool(results[0]["shared"]) == (
        ckpt in ("glm4_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2")
    )
    assert results[0]["outputs"] == results[1]["outputs"]
    assert any(results[0]["outputs"][-1].values())
