"""The decoder layer's Triton kernels on one GPU against the torch paths they replace,
in the same run: decode attention (GQA and MLA), chunked-prefill attention, RMSNorm,
Q/K norm + rotary, the top-k softmax router.
Prints one JSON object (``--out`` also writes it).

For each case: microseconds per call of both (CUDA events, mean over ``--iters`` after a
warm-up), their ratio, the largest difference from the reference, and for attention the
KV bytes read per call over the time against this run's device-to-device copy
bandwidth; for prefill attention the causal attention's TFLOP/s (the Triton kernel, all
chunks in one launch, against SDPA per chunk on its gathered blocks with a mask). The
decode attention kernel is also captured in a CUDA graph once per batch size and
replayed after the lengths and block tables change in place (new contents, same
buffers): ``graph_max_diff`` against an eager call on the new contents shows it needs no
per-step shape or host value.

    python benchmarks/gpu_kernels.py [--out gpu_kernels.json] [--iters 50]
    python benchmarks/gpu_kernels.py --smoke   # CPU rehearsal: toy shapes, interpreter

``--smoke`` runs the kernels under the Triton interpreter on toy shapes (set before
triton is imported); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Qwen3-30B-A3B's attention and router, bf16; contexts of a short and a long chat turn.
GQA = {"heads": 32, "kv_heads": 4, "head_dim": 128, "block_size": 16}
MLA = {"heads": 16, "kv_lora_rank": 512, "rope": 64, "block_size": 64}
BATCHES = (1, 4, 32, 256)
CONTEXTS = (512, 4096)
# Prefill steps: (chunks, new tokens each, tokens cached before each): a prompt from 0,
# a chunk continuing a long prefix (chunked prefill, a prefix-cache hit), several
# prompts in one step.
PREFILLS = ((1, 2048, 0), (1, 512, 4096), (4, 512, 0), (8, 256, 1024))
SMOKE_PREFILLS = ((1, 9, 0), (2, 6, 7))
# The prefill kernel's tile sizes tried on each case (block_m, block_n, num_warps): its
# defaults are untuned (no GPU was lent when it was written).
PREFILL_SWEEP = ((64, 64, 4), (64, 32, 4), (128, 64, 8), (128, 32, 4), (32, 64, 4))
SMOKE_PREFILL_SWEEP = ((16, 16, 4), (32, 16, 4))
HIDDEN, EXPERTS, TOP_K = 2048, 128, 8
SMOKE_GQA = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 4}
SMOKE_MLA = {"heads": 4, "kv_lora_rank": 16, "rope": 8, "block_size": 4}


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    import torch

    def time_us(fn: Callable[[], object], iters: int) -> float:
        fn()
        if device != "cuda":
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) * 1e6 / iters
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters

    return time_us


def _pair(time_us, fast: Callable[[], Any], ref: Callable[[], Any], iters: int) -> dict[str, Any]:
    got, want = fast(), ref()
    if isinstance(got, tuple):  # the router: (weights, ids)
        got, want = got[0], want[0]
    diff = (got.float() - want.float()).abs().max().item()
    # Interleaved rounds: drift and noise hit both alike.
    fast_us, ref_us = [], []
    for _ in range(3):
        fast_us.append(time_us(fast, iters))
        ref_us.append(time_us(ref, iters))
    f, r = sorted(fast_us)[1], sorted(ref_us)[1]
    return {"triton_us": round(f, 2), "torch_us": round(r, 2), "speedup": round(r / f, 2),
            "max_diff": diff}  # fmt: skip


def copy_gbps(device: str, smoke: bool) -> float:
    import torch

    n = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _timer(device)(lambda: dst.copy_(src), 3 if smoke else 20)
    return 2 * n / us / 1e3  # read + write


def attention(device: str, smoke: bool, iters: int, bandwidth: float) -> list[dict[str, Any]]:
    import torch

    geo = SMOKE_GQA if smoke else GQA
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for ctx in (9, 17) if smoke else CONTEXTS:
        for batch in (1, 3) if smoke else BATCHES:
            rows.append(_attention_case(device, dtype, geo, batch, ctx, iters, bandwidth))
    return rows


def _attention_case(
    device: str, dtype: Any, geo: dict[str, int], batch: int, ctx: int, iters: int,
    bandwidth: float,
) -> dict[str, Any]:  # fmt: skip
    """One layer's forward (this step's K/V written, then the decode) on each backend;
    the step's index rows are memoised as for every layer after a step's first."""
    import torch

    from tidal.layers.attention import (
        AttentionBackend,
        AttentionMetadata,
        PagedAttention,
        kv_cache_shape,
    )

    hq, hkv, dh, bs = geo["heads"], geo["kv_heads"], geo["head_dim"], geo["block_size"]
    per_seq = -(-ctx // bs)
    cache = torch.randn(
        kv_cache_shape(batch * per_seq + 1, bs, hkv, dh), dtype=dtype, device=device
    )
    layers = {}
    for backend in (AttentionBackend.TRITON, AttentionBackend.TORCH):
        layer = PagedAttention(hq, hkv, dh, dtype=dtype, device=device)
        layer.backend, layer.kv_cache = backend, cache
        layers[backend] = layer
    seqs = [(ctx - 1, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)]
    meta = AttentionMetadata.build(seqs, bs, device)
    q = torch.randn(batch, hq, dh, dtype=dtype, device=device)
    kv = torch.randn(batch, hkv, dh, dtype=dtype, device=device)
    triton_layer, torch_layer = layers[AttentionBackend.TRITON], layers[AttentionBackend.TORCH]
    row: dict[str, Any] = {"batch": batch, "context": ctx}
    row |= _pair(
        _timer(device),
        functools.partial(triton_layer, q, kv, kv, meta),
        functools.partial(torch_layer, q, kv, kv, meta),
        iters,
    )
    kv_bytes = 2 * batch * ctx * hkv * dh * cache.element_size()
    row["triton_gbps"] = round(kv_bytes / row["triton_us"] / 1e3, 1)
    row["of_copy_bandwidth"] = round(row["triton_gbps"] / bandwidth, 3)
    if device == "cuda":
        from tidal.kernels.paged_attention import MAX_BLOCK_G, _auto_splits

        programs = batch * hkv * -(-(hq // hkv) // MAX_BLOCK_G)
        row["splits"] = _auto_splits(torch.device(device), programs, per_seq * bs)
        row["graph_max_diff"] = _graph_replay(meta, q, cache, triton_layer)
    return row


def prefill(device: str, smoke: bool, iters: int) -> list[dict[str, Any]]:
    import torch

    geo = SMOKE_GQA if smoke else GQA
    dtype = torch.float32 if smoke else torch.bfloat16
    sweep = SMOKE_PREFILL_SWEEP if smoke else PREFILL_SWEEP
    return [
        _prefill_case(device, dtype, geo, *case, iters, sweep)
        for case in (SMOKE_PREFILLS if smoke else PREFILLS)
    ]


def _prefill_case(
    device: str, dtype: Any, geo: dict[str, int], chunks: int, new: int, cached: int,
    iters: int, sweep: tuple[tuple[int, int, int], ...],
) -> dict[str, Any]:  # fmt: skip
    """One layer's forward over a step of ``chunks`` prefill chunks (this step's K/V
    written, then the attention) on each backend: the Triton prefill kernel, all chunks
    in one launch, against the torch path (SDPA per chunk: causal on its own K/V from 0,
    else on its gathered blocks with a mask). Then the kernel alone at each tile size of
    ``sweep``: us per call and its largest difference from the default's output."""
    import torch

    from tidal.kernels.paged_prefill import PrefillBlocks, paged_prefill_attention
    from tidal.layers.attention import (
        AttentionBackend,
        AttentionMetadata,
        PagedAttention,
        kv_cache_shape,
    )

    hq, hkv, dh, bs = geo["heads"], geo["kv_heads"], geo["head_dim"], geo["block_size"]
    per_seq = -(-(cached + new) // bs)
    cache = torch.randn(
        kv_cache_shape(chunks * per_seq + 1, bs, hkv, dh), dtype=dtype, device=device
    )
    layers = {}
    for backend in (AttentionBackend.TRITON, AttentionBackend.TORCH):
        layer = PagedAttention(hq, hkv, dh, dtype=dtype, device=device)
        layer.backend, layer.kv_cache = backend, cache
        layers[backend] = layer
    seqs = [
        (cached, new, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(chunks)
    ]
    meta = AttentionMetadata.build(seqs, bs, device)
    tokens = chunks * new
    q = torch.randn(tokens, hq, dh, dtype=dtype, device=device)
    kv = torch.randn(tokens, hkv, dh, dtype=dtype, device=device)
    row: dict[str, Any] = {"chunks": chunks, "new_tokens": new, "cached": cached}
    row |= _pair(
        _timer(device),
        functools.partial(layers[AttentionBackend.TRITON], q, kv, kv, meta),
        functools.partial(layers[AttentionBackend.TORCH], q, kv, kv, meta),
        iters,
    )
    # Causal: query i of a chunk scores and sums cached + i + 1 keys (2 dots of 2 flops).
    keys = chunks * (new * cached + new * (new + 1) // 2)
    flops = 4 * hq * dh * keys
    row["triton_tflops"] = round(flops / row["triton_us"] / 1e6, 2)
    row["torch_tflops"] = round(flops / row["torch_us"] / 1e6, 2)
    table, layer = meta.prefill_table, layers[AttentionBackend.TRITON]

    def kernel(blocks: Any = None) -> Any:
        return paged_prefill_attention(
            q, cache[0], cache[1], table.rows, table.lens, table.starts, table.block_table,
            layer.scale, blocks=blocks,
        )  # fmt: skip

    default, time_us = kernel(), _timer(device)
    row["sweep"] = {}
    for m, n, warps in sweep:
        call = functools.partial(kernel, PrefillBlocks(m, n, warps))
        diff = (call().float() - default.float()).abs().max().item()
        us = sorted(time_us(call, iters) for _ in range(3))[1]
        row["sweep"][f"m{m}_n{n}_w{warps}"] = {"us": round(us, 2), "max_diff": diff}
    return row


def _graph_replay(meta: Any, q: Any, cache: Any, layer: Any) -> float:
    """Capture the kernel once, change the lengths and the block table in place (shorter
    sequences, blocks reversed), replay: the difference from an eager call on them."""
    import torch

    from tidal.kernels.paged_attention import paged_decode_attention

    table, lens = meta.decode_block_table, meta.decode_seq_lens

    def call() -> Any:
        return paged_decode_attention(q, cache[0], cache[1], table, lens, layer.scale)

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    lens.copy_((lens // 2).clamp(min=1))
    table.copy_(table.flip(1))
    graph.replay()
    torch.cuda.synchronize()
    return (out.float() - call().float()).abs().max().item()


def mla(device: str, smoke: bool, iters: int) -> list[dict[str, Any]]:
    import torch

    geo = SMOKE_MLA if smoke else MLA
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for batch in (1, 3) if smoke else (1, 32, 256):
        ctx = 9 if smoke else 2048
        rows.append(_mla_case(device, dtype, geo, batch, ctx, iters))
    return rows


def _mla_case(
    device: str, dtype: Any, geo: dict[str, int], batch: int, ctx: int, iters: int
) -> dict[str, Any]:
    import torch

    from tidal.kernels.paged_attention import paged_decode_attention
    from tidal.layers.attention import AttentionMetadata

    hq, r, bs = geo["heads"], geo["kv_lora_rank"], geo["block_size"]
    dim = r + geo["rope"]
    per_seq = -(-ctx // bs)
    latents = torch.randn((batch * per_seq + 1) * bs, dim, dtype=dtype, device=device)
    seqs = [(ctx - 1, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)]
    meta = AttentionMetadata.build(seqs, bs, device)
    q = torch.randn(batch, hq, dim, dtype=dtype, device=device)
    keys = latents.view(-1, 1, bs, dim)
    scale = dim**-0.5

    def torch_path() -> Any:  # MLAttention._decode_torch's math
        table = meta.decode_block_table
        assert table is not None
        slots = table[:, :, None] * bs + torch.arange(bs, device=device)
        lat = latents.index_select(0, slots.reshape(-1)).view(batch, -1, dim)
        scores = torch.bmm(q, lat.transpose(1, 2)) * scale
        if meta.decode_mask is not None:
            scores.masked_fill_(~meta.decode_mask[:, 0], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), lat[..., :r])

    table, lens = meta.decode_block_table, meta.decode_seq_lens
    assert table is not None and lens is not None

    def triton_path() -> Any:
        return paged_decode_attention(q, keys, keys[..., :r], table, lens, scale)

    return {"batch": batch, "context": ctx} | _pair(_timer(device), triton_path, torch_path, iters)


def rms_norm(device: str, smoke: bool, iters: int) -> list[dict[str, Any]]:
    import torch

    from tidal.kernels.rms_norm import rms_norm_triton
    from tidal.layers.norm import _rms_norm_hf

    dtype = torch.float32 if smoke else torch.bfloat16
    hidden = 64 if smoke else HIDDEN
    weight = torch.randn(hidden, dtype=dtype, device=device)
    time_us = _timer(device)
    rows = []
    for tokens in (1, 3) if smoke else (1, 32, 256, 2048):
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        rows.append(
            {"tokens": tokens}
            | _pair(
                time_us,
                functools.partial(rms_norm_triton, x, weight, 1e-6),
                functools.partial(_rms_norm_hf, x, weight, 1e-6),
                iters,
            )
        )
    return rows


def norm_rope(device: str, smoke: bool, iters: int) -> list[dict[str, Any]]:
    """Qwen3's Q/K norm and rotary over the q|k heads of qkv: one launch against the
    layer's torch path (norm, weight products, then the rotary expression)."""
    import torch

    from tidal.kernels.norm_rope import norm_rope as fused
    from tidal.layers.norm import rms_norm_heads
    from tidal.layers.rotary import RotaryEmbedding, apply_rotary_torch

    geo = SMOKE_GQA if smoke else GQA
    dtype = torch.float32 if smoke else torch.bfloat16
    hq, hkv, dh = geo["heads"], geo["kv_heads"], geo["head_dim"]
    weights = (
        torch.randn(dh, dtype=dtype, device=device),
        torch.randn(dh, dtype=dtype, device=device),
    )
    rope = RotaryEmbedding(dh, 4096, 1e6, dtype=dtype, device=device)
    rows = []
    for tokens in (1, 3) if smoke else (1, 32, 256, 2048):
        qkv = torch.randn(tokens, hq + 2 * hkv, dh, dtype=dtype, device=device)
        qk = qkv[:, : hq + hkv]
        cos, sin = rope.cos_sin(torch.arange(tokens, device=device))

        def torch_path(qk=qk, cos=cos, sin=sin) -> Any:
            normed = rms_norm_heads(qk, weights, (hq, hkv), 1e-6, native=False)
            return apply_rotary_torch(normed, cos, sin)

        triton_path = functools.partial(fused, qk, cos, sin, weights, hq, 1e-6)
        rows.append({"tokens": tokens} | _pair(_timer(device), triton_path, torch_path, iters))
    return rows


def router(device: str, smoke: bool, iters: int) -> list[dict[str, Any]]:
    import torch

    from tidal.kernels.topk_softmax import topk_softmax
    from tidal.moe.router import softmax_topk

    experts, top_k = (8, 2) if smoke else (EXPERTS, TOP_K)
    time_us = _timer(device)
    rows = []
    for tokens in (1, 3) if smoke else (1, 32, 256, 2048):
        logits = torch.randn(tokens, experts, dtype=torch.float32, device=device)
        rows.append(
            {"tokens": tokens}
            | _pair(
                time_us,
                functools.partial(topk_softmax, logits, top_k, True),
                functools.partial(softmax_topk, logits, top_k, True),
                iters,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: toy shapes, interpreter")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --smoke to rehearse on CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    iters = 2 if args.smoke else args.iters
    bandwidth = copy_gbps(device, args.smoke)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "smoke": args.smoke,
        "copy_gbps": round(bandwidth, 1),
        "attention_gqa": attention(device, args.smoke, iters, bandwidth),
        "attention_mla": mla(device, args.smoke, iters),
        "attention_prefill": prefill(device, args.smoke, iters),
        "rms_norm": rms_norm(device, args.smoke, iters),
        "qk_norm_rope": norm_rope(device, args.smoke, iters),
        "router": router(device, args.smoke, iters),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
