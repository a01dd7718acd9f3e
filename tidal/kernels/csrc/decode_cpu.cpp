// decode_layer: one decoder layer of a pure decode step (GQA attention, a routed MoE) as
// one op: the input norm, the QKV projection, the q/k norm and rotary, the KV write, the
// paged attention, the O projection, the post-attention norm, the router and the experts,
// each the very C++ kernel the decode plan (tidal/models/cpu_decode.py) would call, with
// the same arguments, in the same order; so the result is bit for bit the plan's. With
// `experts` 0 it stops after the post-attention norm and returns that norm's output (the
// MLP's input) in place of the MLP's: a layer whose MLP is not all C++ (shared experts,
// another routing, biased experts) still runs its attention half as one call.
//
// Why: at batch 1 most of those kernels take a few microseconds each on a small layer, and
// calling them one by one from Python (an op dispatch, argument parsing, the views between
// them) cost 35-45 us a layer on the 64-expert bf16 and the FP8 checkpoints (a decode step
// 2.02 -> 1.74 and 2.54 -> 2.18 ms). One call a layer leaves one dispatch.
//
// What varies between layers and models travels as three flat lists whose layout is
// declared once, here (kSlots / kInts / kFloats), and read by name on the Python side
// (decode_layer_layout), so the two cannot drift apart: `tensors` holds the weights (read
// from their layers at each call: a plan pins none), `ints` and `floats` the shapes and
// the kernels' measured variants.

#include "ops.h"

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace tidal_cpu;

// decode_layer's `tensors`, in order. An FP8 projection has its scales, a bf16 / float32
// one none; q_norm / k_norm: both or neither; sinks, biases, expert_map: optional.
enum Slot : int64_t {
  kInNorm,     // [H] x's type
  kPostNorm,   // [H] x's type
  kQNorm,      // [Dh] x's type
  kKNorm,      // [Dh] x's type
  kSinks,      // [Hq] float32
  kQkvW,       // linear's or fp8_linear's pack, (Hq + 2 Hkv) Dh outputs
  kQkvScales,  // FP8: fp8_linear's scales
  kQkvBias,    // [(Hq + 2 Hkv) Dh]
  kOW,         // Hq Dh inputs, H outputs
  kOScales,
  kOBias,      // [H]
  kGate,       // softmax_topk's pack
  kW13,        // fused_moe's packs
  kW2,
  kS13,        // FP8: fused_moe's scales
  kS2,
  kExpertMap,  // [E_global] int32
  kNumSlots
};
constexpr std::array<const char*, kNumSlots> kSlots = {
    "in_norm", "post_norm", "q_norm", "k_norm", "sinks", "qkv_w", "qkv_scales", "qkv_bias",
    "o_w", "o_scales", "o_bias", "gate", "w13", "w2", "s13", "s2", "expert_map"};

enum Int : int64_t {
  kHq, kHkv, kDh,
  kWindow,  // > 0: sliding-window attention over the last `window` keys
  kQkvOut, kQkvBlockK, kQkvPrefetch, kQkvDot, kQkvAmx,  // block_k: FP8 only
  kOOut, kOBlockK, kOPrefetch, kODot, kOAmx,
  kExperts, kTopK, kRenormalize, kRouterPrefetch, kRouterDot,  // experts 0: no MLP here
  kMoePrefetch, kMoeDot, kMoeAmx, kMoeBlockK,  // block_k: FP8 only, else 0
  kNumInts
};
constexpr std::array<const char*, kNumInts> kInts = {
    "hq", "hkv", "dh", "window",
    "qkv_out", "qkv_block_k", "qkv_prefetch", "qkv_dot", "qkv_amx",
    "o_out", "o_block_k", "o_prefetch", "o_dot", "o_amx",
    "experts", "top_k", "renormalize", "router_prefetch", "router_dot",
    "moe_prefetch", "moe_dot", "moe_amx", "moe_block_k"};

// Args::project reads a projection's five ints from its `out` on.
static_assert(kQkvAmx == kQkvOut + 4 && kOAmx == kOOut + 4, "a projection's ints in a row");

enum Float : int64_t { kInEps, kPostEps, kQkEps, kScale, kNumFloats };
constexpr std::array<const char*, kNumFloats> kFloats = {"in_eps", "post_eps", "qk_eps", "scale"};

class Args {
 public:
  Args(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
       at::ArrayRef<double> floats)
      : tensors_(tensors), ints_(ints), floats_(floats) {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == kNumSlots &&
                    static_cast<int64_t>(ints.size()) == kNumInts &&
                    static_cast<int64_t>(floats.size()) == kNumFloats,
                "decode_layer: tensors, ints and floats must follow decode_layer_layout() (",
                kNumSlots, ", ", kNumInts, ", ", kNumFloats, " entries)");
  }
  std::optional<at::Tensor> maybe(Slot s) const { return tensors_.get(s); }
  at::Tensor get(Slot s) const {
    auto t = tensors_.get(s);
    TORCH_CHECK(t.has_value(), "decode_layer: tensor '", kSlots[s], "' is missing");
    return *t;
  }
  int64_t i(Int k) const { return ints_[k]; }
  bool flag(Int k) const { return ints_[k] != 0; }
  double f(Float k) const { return floats_[k]; }

  // A projection: fp8_linear where it has scales, else linear.
  at::Tensor project(const at::Tensor& x, Slot w, Slot scales, Slot bias, Int out) const {
    // out, block_k, prefetch, dot, amx follow each other in Int
    const auto block_k = static_cast<Int>(out + 1), prefetch = static_cast<Int>(out + 2),
               dot = static_cast<Int>(out + 3), amx = static_cast<Int>(out + 4);
    auto s = maybe(scales);
    if (s.has_value())
      return fp8_linear(x, get(w), *s, maybe(bias), i(out), i(block_k), i(prefetch), flag(dot),
                        flag(amx));
    return linear(x, get(w), maybe(bias), i(out), i(prefetch), flag(dot), flag(amx));
  }

 private:
  const c10::List<std::optional<at::Tensor>>& tensors_;
  at::IntArrayRef ints_;
  at::ArrayRef<double> floats_;
};

// x [T, H] (the residual stream before this layer, float32 or bf16), delta [T, H] x's type
// (the previous layer's MLP output, added here; None in the first layer), cos / signed sin
// [T, R] x's type, slots [T] int64, block_table [T, B] int64, seq_lens [T] int64 (this
// layer's KV cache group), cache [2, NB, Hkv, bs, Dh] (written at `slots`)
// -> (the residual stream after attention [T, H], this layer's MLP output [T, H]), as the
// decode plan's layer leaves them; with `experts` 0, (that residual, the MLP's input).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& cache,
    const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
    at::ArrayRef<double> floats) {
  const Args a(tensors, ints, floats);
  TORCH_CHECK(x.dim() == 2, "decode_layer: x must be [T, H]");
  const int64_t num = x.size(0), hq = a.i(kHq), hkv = a.i(kHkv), dh = a.i(kDh);
  at::Tensor residual = x, h;
  if (delta.has_value())
    std::tie(residual, h) = add_rms_norm(x, *delta, a.get(kInNorm), a.f(kInEps));
  else
    h = rms_norm(x, a.get(kInNorm), a.f(kInEps));

  const at::Tensor qkv = a.project(h, kQkvW, kQkvScales, kQkvBias, kQkvOut);  // [T, (Hq+2Hkv) Dh]
  TORCH_CHECK(qkv.numel() == num * (hq + 2 * hkv) * dh,
              "decode_layer: the QKV projection's width is not (hq + 2 hkv) dh");
  const at::Tensor heads = qkv.view({num, hq + 2 * hkv, dh});
  const auto qn = a.maybe(kQNorm);
  const at::Tensor qk = norm_rope(heads.narrow(1, 0, hq + hkv), cos, sin, qn, a.maybe(kKNorm),
                                  qn.has_value() ? hq : 0, qn.has_value() ? a.f(kQkEps) : 0.0);
  write_kv(cache, slots, qk.narrow(1, hq, hkv), heads.narrow(1, hq + hkv, hkv));
  const at::Tensor attn = decode_attention(qk.narrow(1, 0, hq), cache, block_table, seq_lens,
                                           a.f(kScale), a.i(kWindow), a.maybe(kSinks));  // [T, Hq, Dh]
  const at::Tensor o = a.project(attn.view({num, hq * dh}), kOW, kOScales, kOBias, kOOut);

  auto [after, h2] = add_rms_norm(residual, o, a.get(kPostNorm), a.f(kPostEps));
  if (a.i(kExperts) == 0) return {after, h2};  // the attention half only
  auto [weights, ids] = softmax_topk(h2, a.get(kGate), a.i(kExperts), a.i(kTopK),
                                     a.flag(kRenormalize), a.i(kRouterPrefetch),
                                     a.flag(kRouterDot));  // [T, K] float32, [T, K] int64
  at::Tensor out = fused_moe(h2, a.get(kW13), a.get(kW2), weights, ids, a.maybe(kExpertMap),
                             /*apply_router_weight=*/true, a.i(kMoePrefetch), a.flag(kMoeDot),
                             a.maybe(kS13), a.maybe(kS2), a.i(kMoeBlockK), a.flag(kMoeAmx),
                             std::nullopt, std::nullopt, /*clamped=*/false, 0.0, 0.0);
  return {after, out};
}

// The names of decode_layer's tensors, ints and floats, in order.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
decode_layer_layout() {
  return {{kSlots.begin(), kSlots.end()}, {kInts.begin(), kInts.end()},
          {kFloats.begin(), kFloats.end()}};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? delta, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor block_table, Tensor seq_lens, Tensor(a!) cache, Tensor?[] tensors, int[] ints, "
      "float[] floats) -> (Tensor, Tensor)");
  m.def("decode_layer_layout() -> (str[], str[], str[])", &decode_layer_layout);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
