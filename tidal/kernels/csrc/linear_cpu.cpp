// y = x @ W^T (+ bias) for float32 on CPU at decode sizes: a few rows times a small
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
// block j holding, for each k, the weights of output columns 64j..; zero past N.

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

at::Tensor linear(const at::Tensor& x,    // [T, K] float32, rows may be strided
                  const at::Tensor& w_p,  // [N_pad/64, K, 64] float32
                  const std::optional<at::Tensor>& bias,  // [N] float32
                  int64_t out_features,
                  int64_t prefetch) {  // Prefetch hint (gemm.h), a per-CPU choice
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "linear: x must be a float32 [T, K] CPU tensor, last dim contiguous");
  TORCH_CHECK(w_p.dim() == 3 && w_p.scalar_type() == at::kFloat && w_p.is_contiguous() &&
                  w_p.size(2) == 64 && w_p.size(1) == x.size(1),
              "linear: w_p must be a contiguous [N_pad/64, K, 64] float32 pack matching x");
  const int64_t blocks = w_p.size(0), depth = x.size(1), rows = x.size(0);
  TORCH_CHECK(out_features > (blocks - 1) * 64 && out_features <= blocks * 64,
              "linear: out_features does not match the pack");
  TORCH_CHECK(prefetch >= 0 && prefetch < kNumPrefetch, "linear: prefetch must be in [0, ",
              kNumPrefetch, ")");
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == out_features,
                "linear: bias must be float32 [N]");
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float* wp = w_p.data_ptr<float>();
  float* op = out.data_ptr<float>();

  // Task = one column block, for every group of rows: the block is read from memory once
  // and stays in L1/L2 for the next groups.
  auto column_block = [&](int64_t j, auto P) {
    const int64_t c0 = j * 64, cols = std::min<int64_t>(64, out_features - c0);
    const float* blk = wp + j * depth * 64;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int r = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      const float* xr[kRows];
      for (int m = 0; m < r; ++m) xr[m] = xp + (r0 + m) * xs;
      dispatch_rows(r, [&](auto R) {
        vec16 acc[kRows][4];
        block_gemm<R(), P()>(xr, blk, depth, acc);
        for (int m = 0; m < R(); ++m) {
          float* o = op + (r0 + m) * out_features + c0;
          float tmp[64];
          for (int v = 0; v < 4; ++v) store(tmp + 16 * v, acc[m][v]);
          for (int64_t c = 0; c < cols; ++c) o[c] = bp ? tmp[c] + bp[c0 + c] : tmp[c];
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("linear(Tensor x, Tensor w_p, Tensor? bias, int out_features, int prefetch=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("linear", &linear); }
