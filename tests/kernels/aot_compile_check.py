"""Compile every Triton kernel of tidal.kernels ahead of time for sm_90, without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a construct the
compiler rejects (types, shapes, early returns, constexpr misuse) would pass the CPU
tests and fail only on a GPU. triton ships LLVM and ptxas, so compiling to a cubin for
a GPUTarget works on any host. Run with TRITON_INTERPRET unset:

    python tests/kernels/aot_compile_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tidal.kernels import (  # noqa: E402
    activation,
    fp8_triton,
    fused_moe,
    moe_align,
    moe_sum,
    norm_rope,
    paged_attention,
    paged_prefill,
    rms_norm,
    topk_softmax,
)

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(
    kernel, pointers: dict[str, str], constexprs: dict, scalars: dict | None = None, **options
) -> None:
    """Scalar args are i32 unless ``scalars`` types them (``fp32``); pointer args get the
    element type given in ``pointers``."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = (scalars or {}).get(name, "i32")
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=TARGET, options=options
    )
    assert compiled.asm["cubin"], kernel.__name__
    print(f"ok {kernel.__name__} {constexprs}", flush=True)


def main() -> int:
    assert not fused_moe.is_interpreted(), "unset TRITON_INTERPRET for this check"
    ids = dict(topk_ids_ptr="i64", expert_map_ptr="i32", counts_ptr="i32", offsets_ptr="i32",
               sorted_ids_ptr="i32", expert_ids_ptr="i32", num_post_padded_ptr="i32")  # fmt: skip
    blocks = dict(HAS_MAP=True, BLOCK_E=128, SUB=64)
    compile_kernel(moe_align._align_count_kernel, ids, blocks)
    compile_kernel(moe_align._align_scatter_kernel, ids, blocks)
    compile_kernel(moe_align._align_scan_kernel, ids, dict(BLOCK_E=128, BLOCK_C=2, BLOCK_B=64))
    compile_kernel(
        moe_align._align_small_kernel,
        ids,
        dict(HAS_MAP=True, BLOCK_E=256, BLOCK_S=64, BLOCK_F=256, BLOCK_B=16),
        num_warps=8,
    )
    gemm = dict(a_ptr="bf16", b_ptr="bf16", c_ptr="bf16", topk_weights_ptr="fp32", **ids)
    compile_kernel(
        fused_moe._fused_moe_gemm_kernel,
        gemm,
        dict(MUL_ROUTED_WEIGHT=True, DOT_FP32=False, DOT_PRECISION=None, BLOCK_M=16,
             BLOCK_N=64, BLOCK_K=64, GROUP_M=8),
        num_warps=4,
        num_stages=3,
    )  # fmt: skip
    # Block FP8 (w8a8): float8 operands, 128-deep k tiles (an 8-bit dot needs K >= 32).
    compile_kernel(
        fp8_triton._per_token_group_quant_kernel,
        dict(x_ptr="bf16", q_ptr="fp8e4nv", s_ptr="fp32"),
        dict(AMAX_FLOOR=1e-10, QMAX=448.0, GROUP=128, ROWS=16, ROUND_IN_FP32=False),
    )
    fp8 = dict(a_ptr="fp8e4nv", as_ptr="fp32", b_ptr="fp8e4nv", bs_ptr="fp32", c_ptr="bf16")
    compile_kernel(
        fp8_triton._w8a8_gemm_kernel,
        dict(fp8, bias_ptr="bf16"),
        dict(GROUP_K=128, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        num_warps=4,
        num_stages=3,
    )
    compile_kernel(
        fp8_triton._fused_moe_fp8_gemm_kernel,
        dict(fp8, topk_weights_ptr="fp32", **ids),
        dict(GROUP_K=128, MUL_ROUTED_WEIGHT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
             GROUP_M=1),
        num_warps=4,
        num_stages=3,
    )  # fmt: skip
    compile_kernel(activation._silu_and_mul_kernel, dict(x_ptr="bf16", out_ptr="bf16"),
                   dict(BLOCK=512))  # fmt: skip
    compile_kernel(moe_sum._moe_sum_kernel, dict(x_ptr="bf16", out_ptr="bf16"), dict(BLOCK_H=512))
    compile_kernel(
        topk_softmax._topk_softmax_kernel,
        dict(logits_ptr="bf16", weights_ptr="fp32", ids_ptr="i64"),
        dict(RENORMALIZE=True, BLOCK_T=4, BLOCK_E=64, BLOCK_K=8),
    )
    attn = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", out_ptr="bf16", stats_ptr="fp32",
                table_ptr="i32", lens_ptr="i32", sinks_ptr="bf16")  # fmt: skip
    # One row's keys in one program, and in shares (the other branch); other widths (MLA's
    # 576) and float32 are the same code at other sizes (each variant costs ~1-5 s here).
    for splits in (1, 4):
        compile_kernel(
            paged_attention._paged_decode_kernel,
            attn | ({"out_ptr": "fp32"} if splits > 1 else {}),
            dict(GROUP=8, G_TILES=1, DK=128, DV=128, BLOCK_G=16, BLOCK_DK=128, BLOCK_DV=128,
                 BLOCK_N=32, HAS_SINKS=True, DOT_FP32=False, DOT_PRECISION=None,
                 NUM_SPLITS=splits),
            dict(scale="fp32"),
        )  # fmt: skip
    compile_kernel(
        paged_attention._combine_splits_kernel,
        dict(parts_ptr="fp32", stats_ptr="fp32", lens_ptr="i32", sinks_ptr="bf16",
             out_ptr="bf16"),
        dict(DV=128, BLOCK_DV=128, NUM_SPLITS=4, HAS_SINKS=True),
    )  # fmt: skip
    # Prefill: GPT-OSS's group of 8 with a window and sinks; the bf16 cache under bf16 q.
    compile_kernel(
        paged_prefill._paged_prefill_kernel,
        dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", out_ptr="bf16", rows_ptr="i32",
             lens_ptr="i32", starts_ptr="i32", table_ptr="i32", sinks_ptr="bf16"),
        dict(GROUP=8, BLOCK_Q=8, BLOCK_M=64, BLOCK_C=4, DK=64, DV=64, BLOCK_DK=64,
             BLOCK_DV=64, BLOCK_N=64, HAS_SINKS=True, DOT_FP32=False, DOT_PRECISION=None),
        dict(scale="fp32"),
    )  # fmt: skip
    compile_kernel(
        paged_attention._write_kv_kernel,
        dict(k_ptr="bf16", v_ptr="bf16", k_cache_ptr="fp16", v_cache_ptr="fp16", slots_ptr="i64"),
        dict(DH=128, BLOCK_D=128),
    )
    compile_kernel(
        rms_norm._rms_norm_kernel,
        dict(x_ptr="bf16", w_ptr="bf16", out_ptr="bf16"),
        dict(HAS_WEIGHT=True, BLOCK_D=2048),
        dict(eps="fp32"),
        num_warps=4,
    )
    compile_kernel(
        norm_rope._norm_rope_kernel,
        dict(x_ptr="bf16", w1_ptr="bf16", w2_ptr="bf16", cos_ptr="bf16", sin_ptr="bf16",
             out_ptr="bf16"),
        dict(DH=128, ROT=64, NORM=True, BLOCK_D=128),
        dict(eps="fp32"),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
