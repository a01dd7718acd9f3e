// y = x @ W^T (+ bias) for float32 or bf16 weights on CPU at decode sizes: a few rows times a small
// weight, where the GEMM libraries' per-call cost is most of the time.
//
// Why: oneDNN's prepacked linear reaches 440-500 GFLOP/s on this machine's
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
//
// bf16 weights also run on AMX tiles (amx.h, `amx`): the pair pack is already AMX's B
// layout, so the same one copy serves. Why: from a few tens of rows (batched decode,
// every prefill) the vector kernels are bound by their multiply-adds (one vdpbf16ps: 32),
// a tile instruction does 16 rows x 16 columns x 32 k; at a few rows both are bound by
// reading the weights. Which one serves which row count is measured (select.py).

#include "amx.h"
#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

namespace {

using namespace tidal_cpu;

#ifdef TIDAL_AMX
// Rows of one AMX task: a task is (column block, panel of rows), so a projection with
// fewer column blocks than threads still spreads a prefill over them; a panel's rows
// (256 x 2048 bf16: 1 MiB) stay in the core's L2 while amx_panel walks the block's depth.
constexpr int64_t kAmxPanel = 256;

// out [T, N] = x [T, K] bf16 (rows `lda` apart) @ the bf16 pair pack (+ bias), on AMX tiles:
// each (column block, panel) task is one amx_block (up to 16 rows) or amx_panel call over
// the whole depth (pairs % 16 == 0), then the bias and the output's dtype.
void linear_amx(const uint16_t* x, int64_t lda, int64_t rows, const uint16_t* w,
                int64_t pairs, int64_t blocks, int64_t out_features, const float* bias,
                at::Tensor& out) {
  const int64_t panels = (rows + kAmxPanel - 1) / kAmxPanel, block_elems = pairs * 128;
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* oh = out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  // Task t = block t / panels, panel t % panels: a thread's contiguous run of tasks keeps
  // a block's panels together.
  std::vector<double> cost(blocks * panels);
  for (int64_t t = 0; t < blocks * panels; ++t) {
    const int64_t j = t / panels, p = t % panels;
    const double cols = std::min<int64_t>(64, out_features - j * 64);
    cost[t] = cols * std::min(kAmxPanel, rows - p * kAmxPanel);
  }
  for_each_task_static(cost, [&](int64_t t) {
    const int64_t j = t / panels, c0 = j * 64, cols = std::min<int64_t>(64, out_features - c0);
    const int64_t r0 = (t % panels) * kAmxPanel, n = std::min(rows, r0 + kAmxPanel) - r0;
    const uint16_t* blk = w + j * block_elems;
    // [n][64]: one group fits the stack; a panel's sums live between its k chunks
    alignas(64) float small[kAmxRows * 64];
    std::vector<float> big(n > kAmxRows ? n * 64 : 0);
    float* acc = n > kAmxRows ? big.data() : small;
    if (n > kAmxRows)
      amx_panel(n, x + r0 * lda, lda, blk, pairs, acc);
    else
      amx_block(static_cast<int>(n), x + r0 * lda, lda, blk, pairs, acc);
    for (int64_t i = 0; i < n; ++i) {
      float* row = acc + i * 64;
      if (bias)
        for (int64_t c = 0; c < cols; ++c) row[c] += bias[c0 + c];
      const int64_t o = (r0 + i) * out_features + c0;
      if (out_bf16)
        for (int64_t c = 0; c < cols; ++c) oh[o + c] = narrow_bf16(row[c]);
      else
        std::memcpy(of + o, row, cols * sizeof(float));
    }
  });
}
#endif

}  // namespace

at::Tensor tidal_cpu::linear(
    const at::Tensor& x,    // [T, K] float32 or bf16, rows may be strided
    // float32 [N_pad/64, K, 64] | bf16 [N_pad/64, K_pad/2, 64, 2]
    const at::Tensor& w_p,
    const std::optional<at::Tensor>& bias,  // [N] float32 or bf16
    int64_t out_features,
    int64_t prefetch,  // Prefetch hint (gemm.h), a per-CPU choice
    bool dot,          // bf16: the AVX512-BF16 kernel, else the shift one
    bool amx) {        // bf16: the AMX tile kernel (amx.h; its own prefetch)
  TORCH_CHECK(x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "linear: x must be a float32 or bf16 [T, K] CPU tensor, last dim contiguous");
  TORCH_CHECK(!amx || (w_p.scalar_type() == at::kBFloat16 && !dot),
              "linear: the AMX kernel takes bf16 weights (and not the dot flag)");
  TORCH_CHECK(!amx || amx_available(), "linear: this CPU has no AMX-BF16 (or Linux refused it)");
  // The AMX variant at 2-6 rows (one pass of the dot kernel): both kernels are bound by
  // reading the weights there, and the dot kernel's stream ran ahead of the tiles'
  // (2048x2048 from memory, 1 thread: 2 rows 509 against 595 us, 4 rows 545 against
  // 629), so it serves them with the same products (bf16 operands, float32 sums), as the
  // AMX experts do. One row stays on the tiles (588 against the dot kernel's 623 us), and
  // from 8 rows they win (589 against 897).
  const bool dot_rows = amx && x.size(0) > 1 && x.size(0) <= kRows && dot_available();
  [[maybe_unused]] const bool tiles = amx && !dot_rows;
  if (dot_rows) prefetch = kPrefetchT0;
  const Kernel kind = kernel_for(w_p.scalar_type(), dot || dot_rows, "linear");
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
    TORCH_CHECK(!amx || steps % kAmxPairs == 0,
                "linear: the AMX kernel takes in_features that are a multiple of 32, got ", depth);
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
#ifdef TIDAL_AMX
  if (tiles) {
    // A reads bf16 rows as they lie (K % 32 == 0: no pad); float32 x is rounded once.
    at::Tensor xh = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
    linear_amx(reinterpret_cast<const uint16_t*>(xh.data_ptr()), xh.stride(0), rows,
               static_cast<const uint16_t*>(w_p.data_ptr()), steps, blocks, out_features, bp,
               out);
    return out;
  }
#endif
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

namespace {

// Whether this CPU runs the bf16 dot kernel (AVX512-BF16).
bool bf16_dot_available() { return dot_available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "linear(Tensor x, Tensor w_p, Tensor? bias, int out_features, int prefetch=0, "
      "bool dot=False, bool amx=False) -> Tensor");
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("linear", &tidal_cpu::linear); }
