// y = x @ W^T (+ bias) for float32 or bf16 weights on CPU at decode sizes: a few rows times a small
// weight, where the GEMM libraries' per-call cost is most of the time.
//
// Why (issue #13): oneDNN's prepacked linear reaches 440-500 GFLOP/s on this machine's
// 1024-wide projections at 32 rows, but on the 256-wide model's q/k/v and o projections it
// takes 26-37 us for 2-4 M multiply-adds (~160-225 GFLOP/s): fixed cost. This is the MoE
// kernel's register-blocked micro-kernel (gemm.h) over the weight's 64-column blocks, one
// parallel region a call: 10-60% faster than oneDNN at 1-32 rows, within 5% at 128-1024,
// so tidal/layers/linear.py uses it for every float32 CPU forward.
//
// Weight layout (built by tidal/kernels/cpu_linear.py): w_p [N_pad / 64, K, 64], column
// block j holding, for each k, the weights of output columns 64j..; zero past N. bf16
// weights: [N_pad / 64, K_pad / 2, 64, 2], the k rows in pairs (gemm.h), float32
// accumulation, the output in the activations' dtype (float32 or bf16).

#include "gemm.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

namespace {

using namespace tidal_cpu;

at::Tensor linear(const at::Tensor& x,    // [T, K] float32 or bf16, rows may be strided
                  // float32 [N_pad/64, K, 64] | bf16 [N_pad/64, K_pad/2, 64, 2]
                  const at::Tensor& w_p,
                  const std::optional<at::Tensor>& bias,  // [N] float32 or bf16
                  int64_t out_features,
                  int64_t prefetch,  // Prefetch hint (gemm.h), a per-CPU choice
                  bool dot) {        // bf16: the AVX512-BF16 kernel, else the shift one
  TORCH_CHECK(x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "linear: x must be a float32 or bf16 [T, K] CPU tensor, last dim contiguous");
  const Kernel kind = kernel_for(w_p.scalar_type(), dot, "linear");
  const int64_t depth = x.size(1), rows = x.size(0), blocks = w_p.size(0);
  int64_t steps = depth, k_pad = depth;  // the kernel's loop length; the staged row length
  if (kind == Kernel::kFloat) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: float32 weights take float32 x");
    TORCH_CHECK(w_p.dim() == 3 && w_p.is_contiguous() && w_p.size(2) == 64 && w_p.size(1) == depth,
                "linear: w_p must be a contiguous [N_pad/64, K, 64] float32 pack matching x");
  } else {
    TORCH_CHECK(w_p.dim() == 4 && w_p.is_contiguous() && w_p.size(2) == 64 && w_p.size(3) == 2 &&
                    w_p.size(1) == (depth + 1) / 2,
                "linear: w_p must be a contiguous [N_pad/64, K_pad/2, 64, 2] bf16 pack matching x");
    steps = w_p.size(1);
    k_pad = 2 * steps;
  }
  TORCH_CHECK(out_features > (blocks - 1) * 64 && out_features <= blocks * 64,
              "linear: out_features does not match the pack");
  TORCH_CHECK(prefetch >= 0 && prefetch < kNumPrefetch, "linear: prefetch must be in [0, ",
              kNumPrefetch, ")");
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out_features, "linear: bias must be [N]");
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({rows, out_features}, x.options());  // the activations' dtype
  if (rows == 0) return out;
  const StagedRows xs(x, kind, k_pad);
  const char* wp = static_cast<const char*>(w_p.data_ptr());
  const int64_t block_bytes = k_pad * 64 * w_p.element_size();
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* oh = out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;

  // Task = one column block, for every group of rows: the block is read from memory once
  // and stays in L1/L2 for the next groups.
  auto column_block = [&](int64_t j, auto P) {
    const int64_t c0 = j * 64, cols = std::min<int64_t>(64, out_features - c0);
    const void* blk = wp + j * block_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      RowPtrs xr;
      for (int m = 0; m < r; ++m) xs.put(xr, m, r0 + m);
      dispatch_rows(r, [&](auto R) {
        vec16 acc[kRows][4];
        block_gemm_any<R(), P()>(kind, xr, blk, steps, acc);
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

// Whether this CPU runs the bf16 dot kernel (AVX512-BF16).
bool bf16_dot_available() { return dot_available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "linear(Tensor x, Tensor w_p, Tensor? bias, int out_features, int prefetch=0, "
      "bool dot=False) -> Tensor");
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("linear", &linear); }
