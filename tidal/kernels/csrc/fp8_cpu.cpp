// y = x @ dequant(W)^T (+ bias) for FP8 (float8_e4m3fn) weights with per-row, per-k-chunk
// scales on CPU: the weight stays FP8 in memory (a quarter of float32's bytes) and is
// decoded in registers, w8a16 (activations float32 or bf16, float32 accumulation).
//
// Why: the torch reference dequantizes the whole weight on every call (a float copy as
// big as the float32 weight, written then read), so an FP8 checkpoint streams more bytes
// than a float32 one.
//
// Layout (built by tidal/kernels/cpu_fp8.py): w_p [N_pad / 64, K, 64] uint8 (the FP8
// bytes, column block j holding, for each k, the weights of output columns 64j..; zero past
// N); s_p [N_pad / 64, C, 64] float32, C = ceil(K / block_k): the scale of output column
// 64j + c over k in [block_k * i, block_k * (i + 1)) (DeepSeek-V3's 128x128 block scales
// expanded to rows; zero past N).
//
// Three micro-kernels read the pack (gemm.h): block_gemm_fp8 (float32 activations, the
// fp16 decode); with dot=true where the CPU has AVX512-BF16 and VBMI, block_gemm_fp8_dot
// (activations rounded to bf16, the weights decoded to bf16 by table lookup, vdpbf16ps);
// with amx=true where it also has AMX-BF16, block_gemm_fp8_amx (that decode, the products
// on AMX tiles).
// They are shared with the fused MoE
// (moe_cpu.cpp), which takes FP8 experts in the same layout.

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <vector>

using namespace tidal_cpu;

at::Tensor tidal_cpu::fp8_linear(
    const at::Tensor& x,    // [T, K] float32 or bf16, last dim contiguous
    const at::Tensor& w_p,  // [N_pad/64, K, 64] uint8 (FP8 bytes)
    const at::Tensor& s_p,  // [N_pad/64, ceil(K/block_k), 64] float32
    const std::optional<at::Tensor>& bias,  // [N]
    int64_t out_features, int64_t block_k,
    int64_t prefetch,  // Prefetch hint (gemm.h), a per-CPU choice
    bool dot,          // the FP8 dot kernel
    bool amx) {        // the FP8 AMX kernel; neither: the fp16 decode
  TORCH_CHECK(x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "fp8_linear: x must be a float32 or bf16 [T, K] CPU tensor, last dim contiguous");
  const int64_t depth = x.size(1), rows = x.size(0), blocks = w_p.size(0);
  TORCH_CHECK(w_p.dim() == 3 && w_p.scalar_type() == at::kByte && w_p.is_contiguous() &&
                  w_p.size(1) == depth && w_p.size(2) == 64,
              "fp8_linear: w_p must be a contiguous [N_pad/64, K, 64] uint8 pack matching x");
  TORCH_CHECK(block_k > 0, "fp8_linear: block_k must be positive");
  const int64_t chunks = (depth + block_k - 1) / block_k;
  TORCH_CHECK(s_p.dim() == 3 && s_p.scalar_type() == at::kFloat && s_p.is_contiguous() &&
                  s_p.size(0) == blocks && s_p.size(1) == chunks && s_p.size(2) == 64,
              "fp8_linear: s_p must be a contiguous [N_pad/64, ceil(K/block_k), 64] float32 pack");
  TORCH_CHECK(out_features > (blocks - 1) * 64 && out_features <= blocks * 64,
              "fp8_linear: out_features does not match the pack");
  TORCH_CHECK(prefetch >= 0 && prefetch < kNumPrefetch, "fp8_linear: prefetch must be in [0, ",
              kNumPrefetch, ")");
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out_features, "fp8_linear: bias must be [N]");
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({rows, out_features}, x.options());  // the activations' dtype
  if (rows == 0) return out;
  const Kernel kind = fp8_kernel_for(dot, amx, block_k, "fp8_linear");
  // float32 rows (kFp8) or bf16 pairs (kFp8Dot, kFp8Amx), whatever x's dtype
  const StagedRows xs(x, kind, reads_bf16_pairs(kind) ? depth + depth % 2 : depth);
  const uint8_t* wp = w_p.data_ptr<uint8_t>();
  const float* sp = s_p.data_ptr<float>();
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* oh = out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;

  // Task = one column block, for every group of rows (as linear_cpu.cpp).
  auto column_block = [&](int64_t j, auto P) {
    const int64_t c0 = j * 64, cols = std::min<int64_t>(64, out_features - c0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      RowPtrs xr;
      for (int m = 0; m < r; ++m) xs.put(xr, m, r0 + m);
      dispatch_rows(r, [&](auto R) {
        vec16 acc[kRows][4];
        block_gemm_any<R(), P()>(kind, xr, wp + j * depth * 64, depth, acc, sp + j * chunks * 64,
                                 block_k);  // gemm.h
        for (int m = 0; m < R(); ++m) {
          const int64_t o = (r0 + m) * out_features + c0;
          float tmp[64];
          for (int v = 0; v < 4; ++v) store(tmp + 16 * v, acc[m][v]);
          if (bp)
            for (int64_t c = 0; c < cols; ++c) tmp[c] += bp[c0 + c];
          if (out_bf16)
            for (int64_t c = 0; c < cols; ++c) oh[o + c] = narrow_bf16(tmp[c]);
          else
            for (int64_t c = 0; c < cols; ++c) of[o + c] = tmp[c];
        }
      });
    }
  };
  std::vector<double> cost(blocks, 1.0);
  cost.back() = static_cast<double>(out_features - (blocks - 1) * 64) / 64;
  dispatch_prefetch(prefetch, [&](auto P) {
    for_each_task_static(cost, [&](int64_t j) { column_block(j, P); });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "fp8_linear(Tensor x, Tensor w_p, Tensor s_p, Tensor? bias, int out_features, "
      "int block_k, int prefetch=1, bool dot=False, bool amx=False) -> Tensor");
  m.def("fp8_dot_available() -> bool", &fp8_dot_available);
  m.def("fp8_amx_available() -> bool", &fp8_amx_available);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("fp8_linear", &tidal_cpu::fp8_linear); }
