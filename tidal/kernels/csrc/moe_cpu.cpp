// Fused MoE experts for float32, bf16 or FP8 weights on CPU: one call per layer does the
// routing sort, every busy expert's gate/up GEMM with SiLU-and-mul and the router weight
// in its epilogue, and every down GEMM summed straight into the tokens' outputs. Two
// parallel regions per layer (torch's own OpenMP pool, so no second thread pool competes
// for the cores).
//
// Why: at decode sizes an expert sees a handful of rows, so its GEMMs are
// bound by reading the weights once; what costs on top is per-call overhead. The oneDNN
// path pays ~14 us and a thread barrier per GEMM, two GEMMs per busy expert (64 a layer
// at 32 tokens on the 1024-wide model); this pays two barriers a layer.
//
// Weight layouts (built by tidal/kernels/cpu_moe.py, which also holds the Python
// reference of this exact layout):
//   w13p [E, I_pad / 32, H, 64]: column block j of expert e holds, for each k, the 32
//        gate weights of intermediate columns j*32.. then the 32 matching up weights, so
//        one block gives both halves of SiLU-and-mul; columns past I are zero.
//   w2p  [S, E, R, I_pad, 64]: the H_pad / 64 output column blocks in S runs of R; block
//        (s, e, r) holds, for each k, expert e's down weights of output columns
//        (s * R + r) * 64..; rows past I and columns past H are zero. R is chosen at pack
//        time so that a run is one thread's share of the down pass (H_pad / 64 / threads,
//        cpu_moe.py's down_run): the thread reads one stretch of memory per busy expert at
//        decode (a few busy experts, scattered) and one stretch in all at a batch (most
//        experts busy). With R = 1 a decode read one short block per busy expert and
//        column block, each starting on misses; with R = H_pad / 64 a batch read one
//        stretch per expert. The kernel is correct for any R and thread count.
// Each block is read front to back, once per group of up to kRows rows. bf16 packs hold
// the same blocks with their k rows in pairs (gemm.h): w13p [E, I_pad / 32, H_pad / 2, 64,
// 2], w2p [S, E, R, I_pad / 2, 64, 2]; the intermediate activations stay float32
// (bf16 for the dot kernel, which reads them so), the sums float32. FP8 experts (uint8
// packs of the float32 layout, read by gemm.h's block_gemm_fp8 or, with dot, its FP8 dot
// kernel on bf16 activations) come with their scales per column
// and k chunk: s13p [E, I_pad / 32, ceil(H / block_k), 64] (the w13 blocks' column order),
// s2p [S, E, R, ceil(I_pad / block_k), 64].
// Optional extras (GPT-OSS's experts): per-expert biases b13 [E, 2I] (gate, then up; added
// to the gate/up GEMM's result) and b2 [E, H] (added to the down GEMM's, before the router
// weight), float32 or bf16, unpacked; and the clamped SwiGLU, (min(up, l) clamped below at
// -l, + 1) * g * sigmoid(alpha * g) with g = min(gate, l), in place of SiLU(gate) * up.
// Without them the epilogues are the plain ones (one branch per row).

#include "amx.h"
#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace tidal_cpu;

constexpr int64_t kGateBlock = 32;  // intermediate columns per w13p block (x2: gate, up)
constexpr int64_t kDownBlock = 64;  // output columns per w2p block
constexpr double kReadRows = 4;     // a block's read costs about as much as this many rows

// The gate/up pass's tasks, (busy expert, column block): the local experts with routed
// rows (``start`` [E + 1], each slot's first row) and each task's cost -- reading its
// block (worth about kReadRows rows of FMAs) plus its rows.
struct GateTasks {
  std::vector<int64_t> busy;
  std::vector<double> cost;  // [busy.size() * gate_blocks]
};

GateTasks gate_tasks(const std::vector<int64_t>& start, int64_t num_local, int64_t gate_blocks) {
  GateTasks t;
  for (int64_t e = 0; e < num_local; ++e)
    if (start[e + 1] > start[e]) t.busy.push_back(e);
  t.cost.resize(t.busy.size() * gate_blocks);
  for (size_t b = 0; b < t.busy.size(); ++b)
    for (int64_t j = 0; j < gate_blocks; ++j)
      t.cost[b * gate_blocks + j] = kReadRows + (start[t.busy[b] + 1] - start[t.busy[b]]);
  return t;
}

// The down pass's tasks, one per output column block: every block all the rows, I_pad
// deep; the last block as wide as the columns it has left. A thread takes a run of them.
std::vector<double> down_costs(int64_t down_blocks, int64_t hidden_size) {
  std::vector<double> cost(down_blocks, 1.0);
  cost.back() = static_cast<double>(hidden_size - (down_blocks - 1) * kDownBlock) / kDownBlock;
  return cost;
}

// Where down block (expert e, output column block j) lies in a w2p pack [S, E, R, ...].
struct DownLayout {
  int64_t experts = 1, run = 1;  // E, R
  int64_t index(int64_t e, int64_t j) const { return ((j / run) * experts + e) * run + j % run; }
};

inline vec16 silu(vec16 g) { return g / (splat(1.f) + vexp(-g)); }

inline float bias_value(const void* base, bool bf16, int64_t i) {
  return bf16 ? widen_bf16(static_cast<const uint16_t*>(base)[i])
              : static_cast<const float*>(base)[i];
}

// The experts' optional biases and activation (see the header); the default is none and
// SiLU-and-mul.
struct Extras {
  const void* b13 = nullptr;  // [E, 2I] float32 | bf16
  const void* b2 = nullptr;   // [E, H] float32 | bf16
  bool bias_bf16 = false;
  int64_t inter = 0;   // I
  int64_t hidden = 0;  // H
  bool clamped = false;
  float alpha = 0.f, limit = 0.f;

  // Expert e's gate/up biases of w13 block j: out [64] = 32 gate then 32 up, zero past I.
  void gate_bias(int64_t e, int64_t j, float* out) const {
    for (int64_t c = 0; c < kGateBlock; ++c) {
      const int64_t col = j * kGateBlock + c;
      const bool in = col < inter;
      out[c] = in ? bias_value(b13, bias_bf16, e * 2 * inter + col) : 0.f;
      out[kGateBlock + c] = in ? bias_value(b13, bias_bf16, e * 2 * inter + inter + col) : 0.f;
    }
  }

  // Expert e's down biases of output block j: out [64], zero past H.
  void down_bias(int64_t e, int64_t j, float* out) const {
    for (int64_t c = 0; c < kDownBlock; ++c) {
      const int64_t col = j * kDownBlock + c;
      out[c] = col < hidden ? bias_value(b2, bias_bf16, e * hidden + col) : 0.f;
    }
  }

  // 16 columns' activation from their gate and up sums (biases added already).
  vec16 activate(vec16 g, vec16 u) const {
    if (!clamped) return silu(g) * u;
    const vec16 l = splat(limit), nl = splat(-limit);
    g = g > l ? l : g;  // a NaN stays NaN, as torch's clamp keeps it
    u = u > l ? l : u;
    u = u < nl ? nl : u;
    return (u + splat(1.f)) * (g / (splat(1.f) + vexp(-g * splat(alpha))));
  }
};

// One row's 32 activations of a gate/up block from its 64 sums (acc: gate 0..31, up
// 32..63), plus the block's biases (or none), times the router weight s.
inline void block_activation(const vec16* acc, const float* bias, const Extras& ex, vec16 s,
                             vec16* out) {
  for (int h = 0; h < 2; ++h) {
    vec16 g = acc[h], u = acc[2 + h];
    if (bias) {
      g = g + load(bias + 16 * h);
      u = u + load(bias + kGateBlock + 16 * h);
    }
    out[h] = ex.activate(g, u) * s;
  }
}

// The activations of one row group: x rows in, act rows out (float32, or bf16 for the
// dot kernel's down pass).
struct ActRows {
  float* f[kRows];
  uint16_t* h[kRows];
};

template <int R, int P>
void gate_up_rows(Kernel kind, const RowPtrs& x, const void* w, int64_t depth, const ActRows& act,
                  const float* weights, const float* scales, int64_t block_k,
                  const float* bias, const Extras& ex) {  // bias: [64] or null
  vec16 acc[kRows][4];
  block_gemm_any<R, P>(kind, x, w, depth, acc, scales, block_k);
  for (int m = 0; m < R; ++m) {
    vec16 a[2];
    block_activation(acc[m], bias, ex, splat(weights ? weights[m] : 1.f), a);
    const vec16 a0 = a[0], a1 = a[1];
    if (reads_bf16_pairs(kind)) {
      float tmp[32];
      store(tmp, a0);
      store(tmp + 16, a1);
      for (int c = 0; c < 32; ++c) act.h[m][c] = narrow_bf16(tmp[c]);
    } else {
      store(act.f[m], a0);
      store(act.f[m] + 16, a1);
    }
  }
}

// bias: the block's [64] down biases or null, each row's times its router weight (the
// activations carry that weight already, so the GEMM's sum has it).
template <int R, int P>
void down_rows(Kernel kind, const RowPtrs& a, const void* w, int64_t depth, float* const* out,
               int64_t cols, const float* scales, int64_t block_k, const float* bias,
               const float* weights) {
  vec16 acc[kRows][4];
  block_gemm_any<R, P>(kind, a, w, depth, acc, scales, block_k);
  for (int m = 0; m < R; ++m) {
    if (bias)
      for (int v = 0; v < 4; ++v) acc[m][v] = acc[m][v] + load(bias + 16 * v) * splat(weights[m]);
    if (cols == 64) {
      for (int v = 0; v < 4; ++v) store(out[m] + 16 * v, load(out[m] + 16 * v) + acc[m][v]);
    } else {
      float tmp[64];
      for (int v = 0; v < 4; ++v) store(tmp + 16 * v, acc[m][v]);
      for (int64_t c = 0; c < cols; ++c) out[m][c] += tmp[c];
    }
  }
}

#ifdef TIDAL_AMX
// out [m][64] = m rows of a (bf16, lda apart) times a bf16 pair block: AMX tiles for a
// group of more rows than one pass of the dot kernel holds, the dot kernel (the same
// products, the same bf16 operands) for a group it holds -- at ~4 rows per expert (32
// tokens x top-8 / 64) a tile is mostly empty and the step is bound by the weights' bytes
// either way (64-expert layer, 32 tokens: tiles 2.25 ms, dot 2.13).
void rows_times_block(int m, const uint16_t* a, int64_t lda, const uint16_t* w, int64_t pairs,
                      float* out) {
  if (m > kRows || !dot_available()) {
    amx_block(m, a, lda, w, pairs, out);
    return;
  }
  const uint32_t* rows[kRows];
  for (int i = 0; i < m; ++i) rows[i] = reinterpret_cast<const uint32_t*>(a + i * lda);
  dispatch_rows(m, [&](auto R) { block_gemm_dot<R(), kPrefetchT0>(rows, w, pairs, out); });
}

// The experts on AMX tiles (amx.h), given the routing of fused_moe's step 1: the rows
// staged once in routing order (bf16, so each expert's rows are one strided A operand),
// then the same two passes as the vector kernels with groups of up to 16 rows.
void amx_experts(const at::Tensor& x,                 // [T, H] float32 or bf16, contiguous
                 const std::vector<int64_t>& token,   // [N] the token of each routed row
                 const std::vector<float>& row_weight,  // [N]
                 const std::vector<int64_t>& start,   // [E + 1] each slot's first row
                 const at::Tensor& w13p, const at::Tensor& w2p, const DownLayout& dl,
                 int64_t up_steps, int64_t down_steps, const Extras& ex,
                 at::Tensor& out) {  // out [T, H] float32, zero
  const int64_t num_local = w13p.size(0), gate_blocks = w13p.size(1);
  const int64_t down_blocks = w2p.size(0) * dl.run, hidden_size = x.size(1);
  const int64_t up_pad = 2 * up_steps, inter_pad = 2 * down_steps;
  const int64_t rows = start[num_local];
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  // [N, up_pad] bf16: row r is token[r]'s hidden (rounded where float32), zero past H
  std::vector<uint16_t> xs(rows * up_pad, 0);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = xs.data() + r * up_pad;
    if (x_bf16) {
      std::memcpy(dst, static_cast<const uint16_t*>(x.data_ptr()) + token[r] * hidden_size,
                  hidden_size * sizeof(uint16_t));
    } else {
      const float* src = x.data_ptr<float>() + token[r] * hidden_size;
      for (int64_t k = 0; k < hidden_size; ++k) dst[k] = narrow_bf16(src[k]);
    }
  }
  std::vector<uint16_t> act(rows * inter_pad);  // [N, I_pad] bf16, as tdpbf16ps reads it
  const uint16_t* w13 = static_cast<const uint16_t*>(w13p.data_ptr());
  const uint16_t* w2 = static_cast<const uint16_t*>(w2p.data_ptr());
  const int64_t up_block = up_pad * 2 * kGateBlock, down_block = inter_pad * kDownBlock;
  float* op = out.data_ptr<float>();

  const GateTasks tasks = gate_tasks(start, num_local, gate_blocks);
  const std::vector<int64_t>& busy = tasks.busy;
  for_each_task_static(tasks.cost, [&](int64_t task) {
    const int64_t e = busy[task / gate_blocks], j = task % gate_blocks;
    const uint16_t* blk = w13 + (e * gate_blocks + j) * up_block;
    alignas(64) float acc[kAmxRows * 64];
    alignas(64) float bias[64];
    if (ex.b13) ex.gate_bias(e, j, bias);
    for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kAmxRows) {
      const int m = static_cast<int>(std::min<int64_t>(kAmxRows, start[e + 1] - r0));
      rows_times_block(m, xs.data() + r0 * up_pad, up_pad, blk, up_steps, acc);
      for (int i = 0; i < m; ++i) {  // act(gate, up) * router weight, rounded to bf16
        const float* g = acc + i * 64;
        const vec16 sums[4] = {load(g), load(g + 16), load(g + 32), load(g + 48)};
        vec16 act2[2];
        block_activation(sums, ex.b13 ? bias : nullptr, ex, splat(row_weight[r0 + i]), act2);
        alignas(64) float a[32];
        store(a, act2[0]);
        store(a + 16, act2[1]);
        uint16_t* dst = act.data() + (r0 + i) * inter_pad + j * kGateBlock;
        for (int c = 0; c < 32; ++c) dst[c] = narrow_bf16(a[c]);
      }
    }
  });
  for_each_task_static(down_costs(down_blocks, hidden_size), [&](int64_t j) {
    const int64_t cols = std::min<int64_t>(kDownBlock, hidden_size - j * kDownBlock);
    alignas(64) float acc[kAmxRows * 64];
    alignas(64) float bias[64];
    for (int64_t e = 0; e < num_local; ++e) {
      if (start[e + 1] == start[e]) continue;
      const uint16_t* blk = w2 + dl.index(e, j) * down_block;
      if (ex.b2) ex.down_bias(e, j, bias);
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kAmxRows) {
        const int m = static_cast<int>(std::min<int64_t>(kAmxRows, start[e + 1] - r0));
        rows_times_block(m, act.data() + r0 * inter_pad, inter_pad, blk, down_steps, acc);
        for (int i = 0; i < m; ++i) {
          float* dst = op + token[r0 + i] * hidden_size + j * kDownBlock;
          const float s = row_weight[r0 + i];
          if (ex.b2)
            for (int64_t c = 0; c < cols; ++c) dst[c] += acc[i * 64 + c] + s * bias[c];
          else
            for (int64_t c = 0; c < cols; ++c) dst[c] += acc[i * 64 + c];
        }
      }
    }
  });
}
#endif

}  // namespace

at::Tensor tidal_cpu::fused_moe(
    const at::Tensor& hidden,  // [T, H] float32 or bf16
    // float32 [E, I_pad/32, H, 64] | bf16 [E, I_pad/32, H_pad/2, 64, 2]
    const at::Tensor& w13p,
    // float32 [S, E, R, I_pad, 64] | bf16 [S, E, R, I_pad/2, 64, 2]
    const at::Tensor& w2p,
    const at::Tensor& topk_weights,  // [T, K] float32
    const at::Tensor& topk_ids,      // [T, K] int64 global ids
    const std::optional<at::Tensor>& expert_map,  // [E_global] int32
    bool apply_router_weight,
    int64_t prefetch,  // Prefetch hint (gemm.h), a per-CPU choice
    bool dot,  // bf16: the AVX512-BF16 kernel, else the shift one; FP8:
               // the FP8 dot kernel, else the fp16 decode (gemm.h)
    // FP8 (uint8) packs: [E, I_pad/32, ceil(H/block_k), 64] float32
    const std::optional<at::Tensor>& s13p,
    // FP8: [S, E, R, ceil(I_pad/block_k), 64] float32
    const std::optional<at::Tensor>& s2p,
    int64_t block_k,  // FP8: the k chunk of one scale
    bool amx,         // bf16: the AMX tile kernel (amx.h); FP8: the
                      // FP8 AMX kernel (gemm.h)
    const std::optional<at::Tensor>& b13,  // [E, 2I] float32 | bf16
    const std::optional<at::Tensor>& b2,   // [E, H], b13's dtype
    bool clamped,  // the clamped SwiGLU (alpha, limit), else SiLU-and-mul
    double alpha, double limit) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_cpu() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "hidden must be [T, H] float32 or bf16 on CPU");
  const bool fp8 = w13p.scalar_type() == at::kByte;
  TORCH_CHECK(!amx || ((fp8 || w13p.scalar_type() == at::kBFloat16) && !dot),
              "fused_moe: the AMX kernel takes bf16 or FP8 weights (and not the dot flag)");
  TORCH_CHECK(!amx || amx_available(), "fused_moe: this CPU has no AMX-BF16 (or Linux refused it)");
  const Kernel kind = fp8 ? fp8_kernel_for(dot, amx, block_k, "fused_moe")
                          : kernel_for(w13p.scalar_type(), dot, "fused_moe");
  const bool bf16_amx = amx && !fp8;  // amx_experts; FP8's AMX kernel is a block kernel
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t num_local = w13p.size(0), gate_blocks = w13p.size(1);
  const int64_t inter_pad = gate_blocks * kGateBlock;
  TORCH_CHECK(w2p.dim() >= 3 && w2p.size(2) > 0, "w2p must be an [S, E, R, ...] pack");
  const DownLayout dl{num_local, w2p.size(2)};
  const int64_t down_blocks = w2p.size(0) * dl.run;
  // Each pass's kernel loop length and staged row length (bf16: rows in pairs, gemm.h).
  int64_t up_steps = hidden_size, up_pad = hidden_size, down_steps = inter_pad;
  TORCH_CHECK(w2p.scalar_type() == w13p.scalar_type(), "w13p and w2p must have one dtype");
  const float* s13 = nullptr;
  const float* s2 = nullptr;
  int64_t up_chunks = 0, down_chunks = 0;
  if (fp8) {
    TORCH_CHECK(w13p.dim() == 4 && w13p.is_contiguous() && w13p.size(3) == 2 * kGateBlock &&
                    w13p.size(2) == hidden_size,
                "w13p must be a contiguous [E, I_pad/32, H, 64] uint8 (FP8) pack matching hidden");
    TORCH_CHECK(w2p.dim() == 5 && w2p.is_contiguous() && w2p.size(4) == kDownBlock &&
                    w2p.size(3) == inter_pad,
                "w2p must be a contiguous [S, E, R, I_pad, 64] uint8 (FP8) pack matching w13p");
    TORCH_CHECK(block_k > 0 && s13p.has_value() && s2p.has_value(),
                "FP8 experts need their scales (s13p, s2p) and block_k");
    up_chunks = (hidden_size + block_k - 1) / block_k;
    down_chunks = (inter_pad + block_k - 1) / block_k;
    TORCH_CHECK(s13p->scalar_type() == at::kFloat && s13p->is_contiguous() &&
                    s13p->sizes() == at::IntArrayRef({num_local, gate_blocks, up_chunks, 64}),
                "s13p must be a contiguous [E, I_pad/32, ceil(H/block_k), 64] float32 pack");
    TORCH_CHECK(s2p->scalar_type() == at::kFloat && s2p->is_contiguous() &&
                    s2p->sizes() == at::IntArrayRef({w2p.size(0), num_local, dl.run, down_chunks, 64}),
                "s2p must be a contiguous [S, E, R, ceil(I_pad/block_k), 64] float32 pack");
    s13 = s13p->data_ptr<float>();
    s2 = s2p->data_ptr<float>();

  } else if (kind == Kernel::kFloat) {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat, "float32 experts take float32 hidden");
    TORCH_CHECK(w13p.dim() == 4 && w13p.is_contiguous() && w13p.size(3) == 2 * kGateBlock &&
                    w13p.size(2) == hidden_size,
                "w13p must be a contiguous [E, I_pad/32, H, 64] float32 pack matching hidden");
    TORCH_CHECK(w2p.dim() == 5 && w2p.is_contiguous() && w2p.size(4) == kDownBlock &&
                    w2p.size(3) == inter_pad,
                "w2p must be a contiguous [S, E, R, I_pad, 64] float32 pack matching w13p");
  } else {
    TORCH_CHECK(w13p.dim() == 5 && w13p.is_contiguous() && w13p.size(3) == 2 * kGateBlock &&
                    w13p.size(4) == 2 && w13p.size(2) == (hidden_size + 1) / 2,
                "w13p must be a contiguous [E, I_pad/32, H_pad/2, 64, 2] bf16 pack matching "
                "hidden");
    TORCH_CHECK(w2p.dim() == 6 && w2p.is_contiguous() && w2p.size(4) == kDownBlock &&
                    w2p.size(5) == 2 && 2 * w2p.size(3) == inter_pad,
                "w2p must be a contiguous [S, E, R, I_pad/2, 64, 2] bf16 pack matching w13p");
    up_steps = w13p.size(2);
    up_pad = 2 * up_steps;
    down_steps = w2p.size(3);
    TORCH_CHECK(!amx || (up_steps % kAmxPairs == 0 && down_steps % kAmxPairs == 0),
                "fused_moe: the AMX kernel takes a hidden size that is a multiple of 32");
  }
  TORCH_CHECK(w2p.size(1) == num_local && down_blocks * kDownBlock >= hidden_size &&
                  (down_blocks - 1) * kDownBlock < hidden_size,
              "w13p/w2p do not match hidden's width or each other");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == num_tokens &&
                  topk_ids.scalar_type() == at::kLong && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == at::kFloat,
              "topk_ids/topk_weights must be [T, K] int64/float32");
  TORCH_CHECK(prefetch >= 0 && prefetch < kNumPrefetch, "prefetch must be in [0, ", kNumPrefetch,
              ")");
  Extras ex;
  ex.hidden = hidden_size;
  ex.clamped = clamped;
  ex.alpha = static_cast<float>(alpha);
  ex.limit = static_cast<float>(limit);
  at::Tensor b13c, b2c;  // contiguous, alive for the call
  for (const auto* b : {&b13, &b2}) {
    if (!b->has_value()) continue;
    TORCH_CHECK((*b)->is_cpu() &&
                    ((*b)->scalar_type() == at::kFloat || (*b)->scalar_type() == at::kBFloat16) &&
                    (*b)->dim() == 2 && (*b)->size(0) == num_local,
                "fused_moe: b13/b2 must be CPU [E, 2I]/[E, H] float32 or bf16, one row per local expert");
  }
  TORCH_CHECK(!(b13.has_value() && b2.has_value()) || b13->scalar_type() == b2->scalar_type(),
              "fused_moe: b13 and b2 must have one dtype");
  if (b13.has_value()) {
    const int64_t inter = b13->size(1) / 2;
    TORCH_CHECK(b13->size(1) % 2 == 0 && inter <= inter_pad && inter > inter_pad - kGateBlock,
                "fused_moe: b13 must be [E, 2I] with w13p's intermediate size");
    b13c = b13->contiguous();
    ex.b13 = b13c.data_ptr();
    ex.inter = inter;
    ex.bias_bf16 = b13c.scalar_type() == at::kBFloat16;
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->size(1) == hidden_size, "fused_moe: b2 must be [E, H] matching hidden");
    b2c = b2->contiguous();
    ex.b2 = b2c.data_ptr();
    ex.bias_bf16 = b2c.scalar_type() == at::kBFloat16;
  }
  const int64_t top_k = topk_ids.size(1);
  auto x = hidden.contiguous();
  auto ids = topk_ids.contiguous();
  auto tw = topk_weights.contiguous();
  at::Tensor map;
  if (expert_map.has_value()) {
    map = expert_map->contiguous();
    TORCH_CHECK(map.dim() == 1 && map.scalar_type() == at::kInt, "expert_map must be int32");
  }
  // float32 sums, in the activations' dtype on the way out
  auto out = at::zeros({num_tokens, hidden_size}, hidden.options().dtype(at::kFloat));
  auto result = [&]() { return out.to(hidden.scalar_type()); };
  if (num_tokens == 0) return result();

  // 1. Routing: each local slot's rows (token, router weight), ordered by expert and,
  //    within an expert, by token (stable, as the torch path sorts).
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = tw.data_ptr<float>();
  const int32_t* mp = map.defined() ? map.data_ptr<int32_t>() : nullptr;
  const int64_t map_len = map.defined() ? map.size(0) : 0;
  std::vector<int64_t> slot(num_tokens * top_k), start(num_local + 1, 0);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    int64_t s = id[i];
    if (mp) s = (s >= 0 && s < map_len) ? mp[s] : -1;
    slot[i] = (s >= 0 && s < num_local) ? s : -1;
    if (slot[i] >= 0) ++start[slot[i] + 1];
  }
  for (int64_t e = 0; e < num_local; ++e) start[e + 1] += start[e];
  const int64_t rows = start[num_local];
  if (rows == 0) return result();
  std::vector<int64_t> token(rows), fill(start.begin(), start.end() - 1);
  std::vector<float> row_weight(rows);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    if (slot[i] < 0) continue;
    int64_t r = fill[slot[i]]++;
    token[r] = i / top_k;
    row_weight[r] = apply_router_weight ? w[i] : 1.f;
  }
#ifdef TIDAL_AMX
  if (bf16_amx) {
    amx_experts(x, token, row_weight, start, w13p, w2p, dl, up_steps, down_steps, ex, out);
    return result();
  }
#endif
  // [N, I_pad]: float32, bf16 (rounded, as the dot kernel reads it) for the dot kernel
  const bool act_bf16 = reads_bf16_pairs(kind);
  std::vector<float> act_f(act_bf16 ? 0 : rows * inter_pad);
  std::vector<uint16_t> act_h(act_bf16 ? rows * inter_pad : 0);
  // the pair readers take x as bf16 pairs: staged to an even length, the pad zero (an
  // FP8 hidden size may be odd; bf16 packs' up_pad is even already)
  const StagedRows xs(x, kind, act_bf16 ? up_pad + up_pad % 2 : up_pad);
  const char* w13 = static_cast<const char*>(w13p.data_ptr());
  const char* w2 = static_cast<const char*>(w2p.data_ptr());
  const int64_t esz = w13p.element_size();
  const int64_t up_block_bytes = up_pad * 2 * kGateBlock * esz;
  const int64_t down_block_bytes = inter_pad * kDownBlock * esz;
  float* op = out.data_ptr<float>();

  // 2. gate/up + SiLU-and-mul + router weight: task = (busy expert, column block); its
  //    row groups take turns on the block, so only the first reads it from memory.
  const GateTasks tasks = gate_tasks(start, num_local, gate_blocks);
  const std::vector<int64_t>& busy = tasks.busy;
  dispatch_prefetch(prefetch, [&](auto P) {
    for_each_task_static(tasks.cost, [&](int64_t task) {
      const int64_t e = busy[task / gate_blocks], j = task % gate_blocks;
      const void* blk = w13 + (e * gate_blocks + j) * up_block_bytes;
      alignas(64) float bias[64];
      if (ex.b13) ex.gate_bias(e, j, bias);
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, start[e + 1] - r0));
        RowPtrs xr;
        ActRows as;
        for (int m = 0; m < r; ++m) {
          xs.put(xr, m, token[r0 + m]);
          const int64_t off = (r0 + m) * inter_pad + j * kGateBlock;
          if (act_bf16)
            as.h[m] = act_h.data() + off;
          else
            as.f[m] = act_f.data() + off;
        }
        const float* sc = s13 ? s13 + (e * gate_blocks + j) * up_chunks * 64 : nullptr;
        dispatch_rows(r, [&](auto R) {
          gate_up_rows<R(), P()>(kind, xr, blk, up_steps, as, &row_weight[r0], sc, block_k,
                                 ex.b13 ? bias : nullptr, ex);
        });
      }
    });

    // 3. down, summed into the tokens: a thread takes a run of output column blocks
    //    [j0, j1) for every row (a token's rows all land in the same run, so no two
    //    threads add to one element) and reads it pack run by pack run, busy expert by
    //    busy expert (each expert's blocks of a pack run lie together), each block once
    //    for all of the expert's row groups in turn. A token's experts add in expert
    //    order whatever the threads and the batch.
    for_each_run_static(down_costs(down_blocks, hidden_size), [&](int64_t j0, int64_t j1) {
      alignas(64) float bias[64];
      for (int64_t ja = j0; ja < j1;) {
        const int64_t jb = std::min(j1, (ja / dl.run + 1) * dl.run);  // [ja, jb): one pack run
        for (const int64_t e : busy) {
          for (int64_t j = ja; j < jb; ++j) {
            const int64_t cols = std::min<int64_t>(kDownBlock, hidden_size - j * kDownBlock);
            const int64_t b = dl.index(e, j);
            const void* blk = w2 + b * down_block_bytes;
            const float* sc = s2 ? s2 + b * down_chunks * 64 : nullptr;
            if (ex.b2) ex.down_bias(e, j, bias);
            for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kRows) {  // its row groups
              const int r = static_cast<int>(std::min<int64_t>(kRows, start[e + 1] - r0));
              RowPtrs as;
              float* os[kRows];
              for (int m = 0; m < r; ++m) {
                if (act_bf16)
                  as.h[m] = reinterpret_cast<const uint32_t*>(act_h.data() + (r0 + m) * inter_pad);
                else
                  as.f[m] = act_f.data() + (r0 + m) * inter_pad;
                os[m] = op + token[r0 + m] * hidden_size + j * kDownBlock;
              }
              dispatch_rows(r, [&](auto R) {
                down_rows<R(), P()>(kind, as, blk, down_steps, os, cols, sc, block_k,
                                    ex.b2 ? bias : nullptr, &row_weight[r0]);
              });
            }
          }
        }
        ja = jb;
      }
    });
  });
  return result();
}

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "fused_moe(Tensor hidden, Tensor w13p, Tensor w2p, Tensor topk_weights, "
      "Tensor topk_ids, Tensor? expert_map, bool apply_router_weight, int prefetch=0, "
      "bool dot=False, Tensor? s13p=None, Tensor? s2p=None, int block_k=0, bool amx=False, "
      "Tensor? b13=None, Tensor? b2=None, bool clamped=False, float alpha=0., float limit=0.) "
      "-> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("fused_moe", &tidal_cpu::fused_moe); }
