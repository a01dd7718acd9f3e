"""A tiny model with every Triton switch a CUDA model sets on (attention and the cache
write, MLA decode, Q/K norm + rotary, RMSNorm, the router; the fused experts have their
own tests and keep the CPU layout of their weights here), run under
the interpreter on CPU against the same weights on the CPU paths: a mixed prefill +
decode step and a decode step across a block edge give the same logits."""

from __future__ import annotations

import pytest
import torch

from tidal.layers.attention import AttentionBackend, AttentionMetadata, PagedAttention
from tidal.layers.mla import MLAttention
from tidal.layers.norm import RMSNorm
from tidal.models.common import Attention
from tidal.moe.layer import FusedMoE

BLOCK_SIZE = 4


def _load(path: str):
    from tidal.launch.engine_args import EngineArgs
    from tidal.models.loader import load_model

    # The torch CPU paths: no load-time trials, and the expert weights stay unpacked.
    args = EngineArgs(model=path, device="cpu", cpu_kernels="torch")
    return load_model(args.create_engine_config())


def _gpu_paths(model) -> int:
    """Set every switch a CUDA model sets from its device; the number of modules switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.backend = AttentionBackend.TRITON
        elif isinstance(module, MLAttention):
            module.triton_decode = True
        elif isinstance(module, Attention):
            module.triton_norm_rope = True
        elif isinstance(module, RMSNorm):
            module.triton = True
        elif isinstance(module, FusedMoE):
            module.triton_router = module.routing.softmax_of_logits
        else:
            continue
        switched += 1
    return switched


def _steps(model, num_blocks: int = 24) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts, then of a mixed step (one decode, one prompt),
    then of a decode step; shuffled blocks, one seed."""
    spec = model.kv_cache_spec()
    dtype = model.embed_tokens.weight.dtype
    shape = spec.layer_shape(num_blocks, BLOCK_SIZE)
    model.bind_kv_cache([torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)])
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    blocks: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    g = torch.Generator().manual_seed(1)
    vocab = model.embed_tokens.weight.shape[0]

    def step(items: list[tuple[int, list[int]]]) -> torch.Tensor:
        seqs = []
        for sid, toks in items:
            own = blocks.setdefault(sid, [])
            start = lens.get(sid, 0)
            while len(own) * BLOCK_SIZE < start + len(toks):
                own.append(free.pop())
            seqs.append((start, len(toks), own))
            lens[sid] = start + len(toks)
        meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu")
        ids = torch.tensor([t for _, toks in items for t in toks])
        pos = torch.cat([torch.arange(s, s + n) for s, n, _ in seqs])
        return model.compute_logits(model(ids, pos, meta))

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    out = [step([(0, prompt(6)), (1, prompt(3))])]
    out.append(step([(0, [5]), (2, prompt(5))]))
    out.append(step([(0, [7]), (1, [8]), (2, [9])]))  # row 0 opens its third block
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_model_on_triton_paths_equals_cpu_paths(model_type, tiny_ckpt):
    path = tiny_ckpt(model_type)
    want = _steps(_load(path))
    gpu = _load(path)
    assert _gpu_paths(gpu) > 0
    got = _steps(gpu)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
