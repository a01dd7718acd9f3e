// The MoE router for float32 or bf16 on CPU in one call: router logits (x @ gate^T), softmax over
// the experts, the top-k, optionally renormalised -- what tidal/moe/router.py's
// softmax_topk does after a linear, in torch's order of operations.
//
// Why: the torch path is a GEMM call plus four small ops (softmax, topk, sum,
// divide), ~35 us a layer at decode sizes on 2 cores for ~1 us of arithmetic; a model
// routes once per MoE layer.
//
// Gate layout (built by tidal/kernels/cpu_router.py): gate_p [E_pad / 64, H, 64], column
// block j holding, for each k, the gate weights of experts 64j..; zero past E. A bf16
// gate: [E_pad / 64, H_pad / 2, 64, 2], the k rows in pairs (gemm.h); the logits are the
// float32 sums either way (the torch path rounds bf16 logits before its softmax).

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using namespace tidal_cpu;

// Below this many multiply-adds a call stays on the calling thread: waking the pool
// costs more than the work (one token of a 1024-wide, 32-expert layer is 64k).
constexpr int64_t kSerialWork = 1 << 18;

// probs = softmax(logits); the k largest, ties to the lower expert id; renormalised to
// sum 1 when asked. (A NaN row picks valid ids with NaN weights, never an index out of
// range.)
void select_top_k(const float* logits, int64_t num_experts, int64_t top_k, bool renormalize,
                  float* probs, char* taken, float* weights, int64_t* ids) {
  float max = logits[0];
  for (int64_t e = 1; e < num_experts; ++e) max = std::max(max, logits[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < num_experts; ++e) sum += probs[e] = std::exp(logits[e] - max);
  for (int64_t e = 0; e < num_experts; ++e) {
    probs[e] /= sum;
    taken[e] = 0;
  }
  float chosen = 0.f;
  for (int64_t i = 0; i < top_k; ++i) {
    int64_t best = -1;
    for (int64_t e = 0; e < num_experts; ++e)
      if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
    taken[best] = 1;
    ids[i] = best;
    weights[i] = probs[best];
    chosen += probs[best];
  }
  if (renormalize)
    for (int64_t i = 0; i < top_k; ++i) weights[i] /= chosen;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> tidal_cpu::softmax_topk(
    const at::Tensor& hidden,  // [T, H] float32 or bf16
    const at::Tensor& gate_p,  // float32 [E_pad/64, H, 64] | bf16 [E_pad/64, H_pad/2, 64, 2]
    int64_t num_experts, int64_t top_k, bool renormalize,
    int64_t prefetch,  // Prefetch hint (gemm.h), a per-CPU choice
    bool dot) {        // bf16: the AVX512-BF16 kernel, else the shift one
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_cpu() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "hidden must be [T, H] float32 or bf16 on CPU");
  const Kernel kind = kernel_for(gate_p.scalar_type(), dot, "softmax_topk");
  const int64_t blocks = gate_p.size(0), width = hidden.size(1), tokens = hidden.size(0);
  int64_t steps = width, k_pad = width;  // the kernel's loop length; the staged row length
  if (kind == Kernel::kFloat) {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat, "a float32 gate takes float32 hidden");
    TORCH_CHECK(gate_p.dim() == 3 && gate_p.is_contiguous() && gate_p.size(2) == 64 &&
                    gate_p.size(1) == width,
                "gate_p must be a contiguous [E_pad/64, H, 64] float32 pack matching hidden");
  } else {
    TORCH_CHECK(gate_p.dim() == 4 && gate_p.is_contiguous() && gate_p.size(2) == 64 &&
                    gate_p.size(3) == 2 && gate_p.size(1) == (width + 1) / 2,
                "gate_p must be a contiguous [E_pad/64, H_pad/2, 64, 2] bf16 pack matching hidden");
    steps = gate_p.size(1);
    k_pad = 2 * steps;
  }
  TORCH_CHECK(num_experts > (blocks - 1) * 64 && num_experts <= blocks * 64,
              "num_experts does not match the pack");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, num_experts]");
  TORCH_CHECK(prefetch >= 0 && prefetch < kNumPrefetch, "prefetch must be in [0, ", kNumPrefetch,
              ")");
  auto x = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  // float32 weights whatever hidden's dtype, as tidal/moe/router.py's softmax_topk
  auto weights = at::empty({tokens, top_k}, hidden.options().dtype(at::kFloat));
  auto ids = at::empty({tokens, top_k}, hidden.options().dtype(at::kLong));
  if (tokens == 0) return {weights, ids};
  const StagedRows xs(x, kind, k_pad);
  const char* gp = static_cast<const char*>(gate_p.data_ptr());
  const int64_t block_bytes = k_pad * 64 * gate_p.element_size();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t padded = blocks * 64;

  // Task = a group of up to kRows tokens: their logits over every block, then their top-k.
  auto group = [&](int64_t g) {
    const int64_t t0 = g * kRows;
    const int r = static_cast<int>(std::min<int64_t>(kRows, tokens - t0));
    RowPtrs xr;
    for (int m = 0; m < r; ++m) xs.put(xr, m, t0 + m);
    std::vector<float> logits(r * padded), probs(num_experts);
    std::vector<char> taken(num_experts);
    for (int64_t j = 0; j < blocks; ++j) {
      dispatch_rows(r, [&](auto R) {
        vec16 acc[kRows][4];
        dispatch_prefetch(prefetch, [&](auto P) {
          block_gemm_any<R(), P()>(kind, xr, gp + j * block_bytes, steps, acc);
        });
        for (int m = 0; m < R(); ++m)
          for (int v = 0; v < 4; ++v) store(&logits[m * padded + j * 64 + 16 * v], acc[m][v]);
      });
    }
    for (int m = 0; m < r; ++m)
      select_top_k(&logits[m * padded], num_experts, top_k, renormalize, probs.data(),
                   taken.data(), wp + (t0 + m) * top_k, ip + (t0 + m) * top_k);
  };
  const int64_t groups = (tokens + kRows - 1) / kRows;
  if (groups == 1 || tokens * width * padded < kSerialWork) {
    for (int64_t g = 0; g < groups; ++g) group(g);
  } else {
    for_each_task(groups, group);
  }
  return {weights, ids};
}

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "softmax_topk(Tensor hidden, Tensor gate_p, int num_experts, int top_k, "
      "bool renormalize, int prefetch=0, bool dot=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("softmax_topk", &tidal_cpu::softmax_topk); }
