// The C++ ops' entry points (each registered as torch.ops.tidal_cpu.<name> by its own
// source file), declared here so that one op can call another directly: the fused decode
// layer (decode_cpu.cpp) runs a decoder layer's kernels back to back without going
// through Python or the dispatcher between them. Shapes and dtypes: at each definition.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace tidal_cpu {

// linear_cpu.cpp: x [T, K] @ the packed weight -> [T, N]
at::Tensor linear(const at::Tensor& x, const at::Tensor& w_p, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t prefetch, bool dot, bool amx);

// fp8_cpu.cpp: x [T, K] @ dequant(FP8 pack) -> [T, N]
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w_p, const at::Tensor& s_p,
                      const std::optional<at::Tensor>& bias, int64_t out_features,
                      int64_t block_k, int64_t prefetch, bool dot, bool amx);

// router_cpu.cpp: hidden [T, H] -> (weights [T, K] float32, ids [T, K] int64)
std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& hidden, const at::Tensor& gate_p,
                                                int64_t num_experts, int64_t top_k,
                                                bool renormalize, int64_t prefetch, bool dot);

// moe_cpu.cpp: hidden [T, H] through its top-k experts -> [T, H]
at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13p, const at::Tensor& w2p,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::optional<at::Tensor>& expert_map, bool apply_router_weight,
                     int64_t prefetch, bool dot, const std::optional<at::Tensor>& s13p,
                     const std::optional<at::Tensor>& s2p, int64_t block_k, bool amx,
                     const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                     bool clamped, double alpha, double limit);

// norm_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor norm_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::optional<at::Tensor>& q_weight,
                     const std::optional<at::Tensor>& k_weight, int64_t split, double eps);

// attention_cpu.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t window, const std::optional<at::Tensor>& sinks);
void write_kv(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v);

}  // namespace tidal_cpu
