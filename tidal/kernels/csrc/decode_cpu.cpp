// decode_layer: one decoder layer of a pure decode step (GQA attention, a routed MoE) as
// one op: the input norm, the QKV projection, the q/k norm and rotary, the KV write, the
// paged attention, the O projection, the post-attention norm, the router and the experts,
// each the very C++ kernel the decode plan (tidal/models/cpu_decode.py) would call, with
// the same arguments, in the same order; so the result is bit for bit the plan's. With
// `experts` 0 it stops after the post-attention norm and returns that norm's output (the
// MLP's input) in place of the MLP's: a layer whose MLP is not all C++ (shared experts,
// another routing, biased experts) still runs its attention half as one call. decode_model
// runs a whole model of such layers, with the embedding lookup before and the final norm
// after, as one op.
//
// Why: at batch 1 most of those kernels take a few microseconds each on a small layer, and
// calling them one by one from Python (an op dispatch, argument parsing, the views between
// them) cost 35-45 us a layer on the 64-expert bf16 and the FP8 checkpoints (a decode step
// 2.02 -> 1.74 and 2.54 -> 2.18 ms). One call a layer leaves one dispatch.
//
// What varies between layers and models travels as three flat lists whose layout is
// declared once, here (kSlots / kInts / kFloats), and read by name on the Python side
// (decode_layer_layout), so the two cannot drift apart: `tensors` holds the weights (held
// weakly by the plan and dereferenced at each call), `ints` and `floats` the shapes and
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
  // Layer `layer` of the lists: its entries sit at layer * kNumSlots (kNumInts, kNumFloats).
  Args(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
       at::ArrayRef<double> floats, int64_t layer, const char* op)
      : tensors_(tensors), ints_(ints.slice(layer * kNumInts, kNumInts)),
        floats_(floats.slice(layer * kNumFloats, kNumFloats)), base_(layer * kNumSlots),
        op_(op) {}
  std::optional<at::Tensor> maybe(Slot s) const { return tensors_.get(base_ + s); }
  at::Tensor get(Slot s) const {
    auto t = tensors_.get(base_ + s);
    TORCH_CHECK(t.has_value(), op_, ": tensor '", kSlots[s], "' of layer ", base_ / kNumSlots,
                " is missing");
    return *t;
  }
  int64_t i(Int k) const { return ints_[k]; }
  bool flag(Int k) const { return ints_[k] != 0; }
  double f(Float k) const { return floats_[k]; }
  const char* op() const { return op_; }

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
  int64_t base_;
  const char* op_;
};

// The lists hold `layers` layers' entries, one layout after another.
void check_lists(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
                 at::ArrayRef<double> floats, int64_t layers, const char* op) {
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(tensors.size()) == layers * kNumSlots &&
                  static_cast<int64_t>(ints.size()) == layers * kNumInts &&
                  static_cast<int64_t>(floats.size()) == layers * kNumFloats,
              op, ": tensors, ints and floats must follow decode_layer_layout() (", kNumSlots,
              ", ", kNumInts, ", ", kNumFloats, " entries a layer)");
}

// x [T, H] (the residual stream before this layer, float32 or bf16), delta [T, H] x's type
// (the previous layer's MLP output, added here; None in the first layer), cos / signed sin
// [T, R] x's type, slots [T] int64, block_table [T, B] int64, seq_lens [T] int64 (this
// layer's KV cache group), cache [2, NB, Hkv, bs, Dh] (written at `slots`)
// -> (the residual stream after attention [T, H], this layer's MLP output [T, H]), as the
// decode plan's layer leaves them; with `experts` 0, (that residual, the MLP's input).
std::tuple<at::Tensor, at::Tensor> run_layer(
    const Args& a, const at::Tensor& x, const std::optional<at::Tensor>& delta,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& cache) {
  const int64_t num = x.size(0), hq = a.i(kHq), hkv = a.i(kHkv), dh = a.i(kDh);
  at::Tensor residual = x, h;
  if (delta.has_value())
    std::tie(residual, h) = add_rms_norm(x, *delta, a.get(kInNorm), a.f(kInEps));
  else
    h = rms_norm(x, a.get(kInNorm), a.f(kInEps));

  const at::Tensor qkv = a.project(h, kQkvW, kQkvScales, kQkvBias, kQkvOut);  // [T, (Hq+2Hkv) Dh]
  TORCH_CHECK(qkv.numel() == num * (hq + 2 * hkv) * dh,
              a.op(), ": the QKV projection's width is not (hq + 2 hkv) dh");
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

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& cache,
    const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
    at::ArrayRef<double> floats) {
  check_lists(tensors, ints, floats, 1, "decode_layer");
  TORCH_CHECK(x.dim() == 2, "decode_layer: x must be [T, H]");
  return run_layer(Args(tensors, ints, floats, 0, "decode_layer"), x, delta, cos, sin, slots,
                   block_table, seq_lens, cache);
}

// A pure decode step's model, whole, as one op: the embedding lookup, every decoder layer
// (each whole: a routed MoE, `experts` > 0) as its decode_layer call, each feeding the next,
// and the final norm; so bit for bit the module path's lookups, those calls and its final
// add_rms_norm. Why one op: between two ops the kernels' threads fall idle and Python runs
// on cold caches; a model in one call measured 9-17 % faster a token than a call a layer
// (64-expert bf16 checkpoint, batch 1).
// ids, positions [T] int64; embed [V, H] x's type; cos_table / sin_table [P, R] (rotary's
// cos and signed sin rows by position); final_norm [H]; the lists hold the layers' entries
// one layout after another; caches [L], all in one KV cache group (the same slots, block
// table and lengths) -> the final hidden states [T, H].
at::Tensor decode_model(const at::Tensor& ids, const at::Tensor& positions,
                        const at::Tensor& embed, const at::Tensor& cos_table,
                        const at::Tensor& sin_table, const at::Tensor& final_norm,
                        double final_eps, const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, at::TensorList caches,
                        const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
                        at::ArrayRef<double> floats) {
  const auto layers = static_cast<int64_t>(caches.size());
  check_lists(tensors, ints, floats, layers, "decode_model");
  TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0) &&
                  ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decode_model: ids and positions must be [T] int64 tensors");
  TORCH_CHECK(embed.dim() == 2 && cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes(),
              "decode_model: embed must be [V, H], cos_table and sin_table [P, R]");
  at::Tensor residual = embed.index_select(0, ids);  // [T, H]: F.embedding's rows
  const at::Tensor cos = cos_table.index_select(0, positions);  // [T, R]
  const at::Tensor sin = sin_table.index_select(0, positions);
  std::optional<at::Tensor> delta;
  for (int64_t l = 0; l < layers; ++l) {
    const Args a(tensors, ints, floats, l, "decode_model");
    TORCH_CHECK(a.i(kExperts) > 0, "decode_model: layer ", l, " is not a whole layer");
    auto [after, out] =
        run_layer(a, residual, delta, cos, sin, slots, block_table, seq_lens, caches[l]);
    residual = std::move(after);
    delta = std::move(out);
  }
  TORCH_CHECK(delta.has_value(), "decode_model: no layers");
  return std::get<1>(add_rms_norm(residual, *delta, final_norm, final_eps));
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
  m.def(
      "decode_model(Tensor ids, Tensor positions, Tensor embed, Tensor cos_table, "
      "Tensor sin_table, Tensor final_norm, float final_eps, Tensor slots, Tensor block_table, "
      "Tensor seq_lens, Tensor(a!)[] caches, Tensor?[] tensors, int[] ints, float[] floats) "
      "-> Tensor");
  m.def("decode_layer_layout() -> (str[], str[], str[])", &decode_layer_layout);
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_model", &decode_model);
}
