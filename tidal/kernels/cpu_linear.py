"""``x @ W^T (+ bias)`` for float32 or bf16 weights on CPU at decode sizes in one C++ call
(``csrc/linear_cpu.cpp``); one checked wrapper.

Why: oneDNN's prepacked linear is near this machine's peak on 1024-wide projections but
pays a fixed ~15-20 us a call, most of the time on small weights (the 256-wide model's
q/k/v and o projections: 26-37 us at 32 rows, for 2-4 M multiply-adds). This is 10-60%
faster at 1-32 rows and within 5% of oneDNN at 128-1024 (float32, an AMD EPYC), so it is
a candidate of every float32 and bf16 CPU linear (``tidal/kernels/select.py`` measures),
with ``F.linear`` as the reference and the fallback. bf16 weights whose in_features are
whole AMX tile steps also have the AMX kernel (``amx``, the same pack read as B tiles).

The pack (``copy_blocks``) is also the layout of the C++ router's gate and of the MoE
kernel's down weights: one weight matrix cut into 64-row blocks, each stored transposed.
bf16 weights stay bf16 (half the bytes a token streams; float32 accumulation in the
kernel): their pack (``copy_pair_blocks``) holds the input columns in pairs, so a 32-bit
word is ``(w[c, 2p], w[c, 2p + 1])`` -- what both bf16 kernels read (``csrc/gemm.h``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.kernels.cpu_ext import AMX_K, amx_fits, kernel_available, kernel_status
from tidal.kernels.host_memory import empty_huge

BLOCK = 64  # output columns per block of the pack (gemm.h's block_gemm width)
DTYPES = (torch.float32, torch.bfloat16)  # the weight dtypes the C++ kernels read


def pack_linear_weight(weight: Tensor) -> Tensor:
    """[N, K] float32 -> [N_pad/64, K, 64]: block j holds, for each input column k, the
    weights of outputs 64j.. (zero past N). [N, K] bf16 -> [N_pad/64, K_pad/2, 64, 2]: the
    same with the input columns in pairs (zero past K)."""
    if weight.dtype not in DTYPES or weight.dim() != 2:
        raise ValueError(
            f"the CPU linear takes a float32 or bf16 [N, K] weight, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    out_f, in_f = weight.shape
    blocks = -(-out_f // BLOCK)
    # streamed at decode: huge pages
    if weight.dtype == torch.bfloat16:
        out = empty_huge((blocks, -(-in_f // 2), BLOCK, 2), torch.bfloat16)
        copy_pair_blocks(out[None], weight[None], BLOCK)
    else:
        out = empty_huge((blocks, in_f, BLOCK))
        copy_blocks(out[None], weight[None], BLOCK)
    return out


def unpack_linear_weight(packed: Tensor, out_features: int, in_features: int) -> Tensor:
    """The checkpoint-shaped weight [N, K] back from ``pack_linear_weight``'s layout (exact:
    a copy), with the input-major storage ``tidal/layers/linear.py`` gives its weights."""
    out = torch.empty(in_features, out_features, dtype=packed.dtype).t()  # K-major storage
    if packed.dim() == 4:  # bf16 pairs [B, P, 64, 2] -> [B, 64, P, 2] -> [B*64, 2P]
        blocks, pairs, block, _ = packed.shape
        rows = packed.permute(0, 2, 1, 3).reshape(blocks * block, 2 * pairs)
    else:
        blocks, _, block = packed.shape
        rows = packed.permute(0, 2, 1).reshape(blocks * block, in_features)
    out.copy_(rows[:out_features, :in_features])
    return out


def copy_blocks(dst: Tensor, src: Tensor, block: int) -> None:
    """dst[e, j, k, c] = src[e, j * block + c, k]: src [E, N, K] cut into blocks of ``block``
    rows, each stored transposed; dst [E, ceil(N / block), K, block] (columns past N are
    left as they are). One strided copy per part, no padded intermediate."""
    num, rows, depth = src.shape
    full = rows // block
    if full:
        dst[:, :full].copy_(src[:, : full * block].reshape(num, full, block, depth).transpose(2, 3))
    if rows % block:
        dst[:, full, :, : rows % block].copy_(src[:, full * block :].transpose(1, 2))


def packed_depth(in_features: int, dtype: torch.dtype) -> int:
    """The pack's second dimension for ``in_features`` inputs: bf16 holds them in pairs."""
    return -(-in_features // 2) if dtype == torch.bfloat16 else in_features


def copy_pair_blocks(dst: Tensor, src: Tensor, block: int) -> None:
    """dst[e, j, p, c, h] = src[e, j * block + c, 2p + h]: ``copy_blocks`` with the input
    columns in pairs. src [E, N, K]; dst [E, ceil(N / block), P >= ceil(K / 2), block, 2],
    zero-filled (what lies past N or K is left as it is)."""
    num, rows, depth = src.shape
    pairs = depth // 2
    full = rows // block
    parts = [(slice(0, full), slice(0, full * block), block, full)] if full else []
    if rows % block:
        parts.append((slice(full, full + 1), slice(full * block, rows), rows % block, 1))
    for js, rs, cols, nb in parts:
        s, d = src[:, rs], dst[:, js, :, :cols]  # [E, nb*cols, K], [E, nb, P, cols, 2]
        if pairs:
            pair_rows = s[:, :, : 2 * pairs].reshape(num, nb, cols, pairs, 2)
            d[:, :, :pairs].copy_(pair_rows.permute(0, 1, 3, 2, 4))
        if depth % 2:  # the last column alone: its pair's other half stays zero
            d[:, :, pairs, :, 0].copy_(s[:, :, depth - 1].reshape(num, nb, cols))


def linear_cpu_ok(x: Tensor) -> bool:
    """Whether ``linear_cpu`` takes ``x``: float32 or bf16 on CPU, the extension loaded."""
    return x.dtype in DTYPES and x.device.type == "cpu" and kernel_available()


def linear_cpu(
    x: Tensor,  # [T, K] float32 or bf16 CPU (float32 weights: float32 x)
    packed: Tensor,  # pack_linear_weight(weight)
    out_features: int,
    bias: Tensor | None = None,  # [N]
    prefetch: int = 0,  # cpu_ext.PREFETCH_HINTS value: a per-CPU choice (select.py)
    dot: bool = False,  # bf16 weights: the AVX512-BF16 kernel (cpu_ext.bf16_dot_available)
    amx: bool = False,  # bf16 weights: the AMX tile kernel (cpu_ext.amx_available)
) -> Tensor:  # [T, N], x's dtype
    if x.dim() != 2 or packed_depth(x.shape[1], packed.dtype) != packed.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match the packed weight {tuple(packed.shape)}")
    if amx and not amx_fits(packed.dtype, x.shape[1]):
        raise ValueError(
            f"the AMX linear takes bf16 weights of in_features divisible by {AMX_K}, got "
            f"{packed.dtype} in_features {x.shape[1]}"
        )
    if not kernel_available():
        raise RuntimeError(f"the C++ linear is unavailable: {kernel_status()}")
    return torch.ops.tidal_cpu.linear(x, packed, bias, out_features, prefetch, dot, amx)
