"""Rotary position embedding with a precomputed cos/sin table indexed by position.

The table holds, for every position p < max_position, ``cos(p * inv_freq)`` and
``sin(...)`` duplicated over both halves of the head (the "rotate half" convention of
Llama/Qwen/Mixtral checkpoints), computed in float32 exactly as transformers does and
then cast to the model dtype. The default rope type and YaRN (``Yarn``: interpolated
low frequencies and an attention factor on cos/sin, as transformers' ``yarn`` computes
them; GPT-OSS) are supported. With a partial
rotary factor (GLM-4.5) the table covers the first ``rotary_dim`` dims of each head and
the rest pass through (``apply_partial_rotary``), as transformers rotates them.

transformers computes ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``. Here the sign lives in the table instead:
``rotate_half(x) * sin == roll(x, half) * cat(-sin1, sin2)`` exactly (negation is exact),
which saves the negation and the concatenation per call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tidal.kernels.cpu_norm import norm_rope_cpu, norm_rope_cpu_ok
from tidal.layers.norm import rms_norm_heads

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters (transformers' ``rope_parameters`` of type ``yarn``)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: from factor, mscale, mscale_all_dim
    mscale: float = 0.0  # DeepSeek's: with mscale_all_dim, cos/sin take their ratio
    mscale_all_dim: float = 0.0

    def scale(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def inv_freq(self, theta: float, dim: int) -> Tensor:  # [dim / 2] float32
        """Extrapolated (original) frequencies above the ``beta_fast`` rotations, divided
        by ``factor`` below ``beta_slow``, a linear ramp between, in float32 as
        transformers computes them."""

        def dim_at(rotations: float) -> float:  # the dim that turns this often
            turns = self.original_max_position / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = dim_at(self.beta_fast), dim_at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # the share of the original frequency
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (self.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_theta_from_config(hf_config: Any) -> float:
    """The rope base from a transformers config: v5 ``rope_parameters`` or v4
    ``rope_theta``/``rope_scaling``. Raises for rope types other than ``default`` and
    ``yarn``."""
    theta, _ = _rope_parameters(hf_config)
    return theta


def yarn_from_config(hf_config: Any) -> Yarn | None:
    """The config's YaRN parameters; None for the default rope."""
    params = _rope_dict(hf_config)
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:  # transformers: the ratio of the context lengths
        factor = hf_config.max_position_embeddings / original
    return Yarn(
        factor=float(factor),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
    )


def _rope_dict(hf_config: Any) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    return dict(getattr(hf_config, "rope_scaling", None) or {})


def rotary_dim_from_config(hf_config: Any, head_dim: int) -> int:
    """The rotated dims of each head: ``head_dim`` times ``partial_rotary_factor`` (v5
    ``rope_parameters`` or the config's own attribute; 1.0 when absent)."""
    _, partial = _rope_parameters(hf_config)
    dim = int(head_dim * partial)
    if not 0 < dim <= head_dim or dim % 2:
        raise NotImplementedError(
            f"partial_rotary_factor {partial} gives {dim} rotary dims of {head_dim}: "
            "must be even and positive"
        )
    return dim


def _rope_parameters(hf_config: Any) -> tuple[float, float]:  # (theta, partial factor)
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "rope_theta" not in params:
            raise NotImplementedError(
                f"per-layer-type rope_parameters are not supported: {sorted(params)}"
            )
        theta, rope_type = params["rope_theta"], params.get("rope_type", params.get("type"))
    else:
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        theta = getattr(hf_config, "rope_theta", 10000.0)
        rope_type = scaling.get("rope_type", scaling.get("type"))
    rope_type = rope_type or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = (params or {}).get("partial_rotary_factor")
    if partial is None:
        partial = getattr(hf_config, "partial_rotary_factor", None)
    return float(theta), float(1.0 if partial is None else partial)


class RotaryEmbedding(nn.Module):
    cos_table: Tensor  # buffers (register_buffer), typed for the checker
    signed_sin_table: Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        *,
        yarn: Yarn | None = None,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        # Same float32 expressions as transformers' rope, on CPU, then moved.
        if yarn is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        else:
            inv_freq = yarn.inv_freq(theta, head_dim)
        pos = torch.arange(max_position, dtype=torch.int64)
        freqs = pos[:, None].float() * inv_freq  # [P, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        dtype = dtype or torch.get_default_dtype()
        half = head_dim // 2
        scale = 1.0 if yarn is None else yarn.scale()
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # transformers scales both (so the scores by its square)
            cos, sin = cos * scale, sin * scale
        sin = sin.to(dtype)
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos_table", cos.to(dtype).to(device), persistent=False)
        self.register_buffer("signed_sin_table", signed_sin.to(device), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> 2 x [T, 1, Dh]
        """(cos, signed sin) rows for the positions: looked up once per forward, every
        layer reuses them."""
        return self.cos_table[positions].unsqueeze(1), self.signed_sin_table[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, Dh] with cos/signed_sin [T, 1, Dh] from ``cos_sin`` -> rotated x (new
    tensor); equals transformers' ``x * cos + rotate_half(x) * sin``. On CPU one C++ pass
    (``tidal/kernels/cpu_norm.py``'s ``norm_rope_cpu``), bit-identical to the torch
    expression in x's dtype."""
    if _cpu_pass(x, cos):
        return norm_rope_cpu(x, cos, signed_sin)
    return apply_rotary_torch(x, cos, signed_sin)


def apply_partial_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """``apply_rotary`` on the first ``cos.shape[-1]`` dims of each head of x [T, heads,
    Dh]; the other dims are copied unchanged (a new tensor either way)."""
    if _cpu_pass(x, cos):  # the C++ pass copies the dims past the rotary ones itself
        return norm_rope_cpu(x, cos, signed_sin)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary_torch(x, cos, signed_sin)
    out = torch.empty_like(x)
    out[..., :rotary_dim] = apply_rotary_torch(x[..., :rotary_dim], cos, signed_sin)
    out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def apply_norm_rotary(
    x: Tensor,  # [T, heads, Dh]: the q|k heads (a strided slice of qkv)
    cos: Tensor,  # [T, 1, R] from ``cos_sin``
    signed_sin: Tensor,  # [T, 1, R]
    weights: tuple[Tensor, Tensor],  # ([Dh], [Dh]): q_norm's, then k_norm's weight
    group_sizes: tuple[int, int],  # (Hq, Hkv), sum == heads
    eps: float,
    native: bool = True,  # the C++ kernels where they take x (the norms' measured choice)
    triton: bool = False,  # the Triton norm (the norms' ``RMSNorm.triton``)
) -> Tensor:  # [T, heads, Dh], new tensor
    """Per-head RMSNorm of the q and k heads (``rms_norm_heads``), then
    ``apply_partial_rotary``: on CPU, where the norms' choice is the C++ kernel, one C++
    pass over the heads (``norm_rope_cpu``) instead of 7-9 ops, bit for bit the two."""
    if native and not triton and _cpu_pass(x, cos):
        return norm_rope_cpu(x, cos, signed_sin, weights, group_sizes[0], eps)
    normed = rms_norm_heads(x, weights, group_sizes, eps, native, triton)
    return apply_partial_rotary(normed, cos, signed_sin)


def _cpu_pass(x: Tensor, cos: Tensor) -> bool:  # whether norm_rope_cpu takes x and its table
    return norm_rope_cpu_ok(x) and cos.dtype == x.dtype


@functools.cache
def triton_norm_rope() -> Callable[..., Tensor]:
    """``tidal.kernels.norm_rope.norm_rope`` (per-head norm and rotary in one Triton
    launch, the CUDA path; ``rms_norm_heads`` then ``apply_partial_rotary`` is its
    reference), imported on first use: triton is optional, and its import fixes its mode
    for the process."""
    from tidal.kernels.norm_rope import norm_rope

    return norm_rope


def apply_rotary_torch(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """The torch expression: the fallback, and the reference of the C++ path."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)
