// RMSNorm over the last dimension on CPU, in one pass per row: the sum of squares, then
// x * rsqrt(mean + eps), then the weight (transformers' order of the two products); for
// float32, and for bfloat16 / float16 rows with float32 math and transformers' roundings.
// torch's F.rms_norm on CPU is a chain of 5-6 ops, ~8 us for one 1024-wide row and ~26 us
// for 32; a model calls it 2-3 times a layer (the per-step overhead).
// add_rms_norm folds the residual add before a norm into the same pass, and norm_rope the
// per-head Q/K norm, its two weights and the rotary embedding (mul, roll, mul, add) of
// the q|k heads: at batch-1 decode those small torch ops, not their bytes, were the cost.
// Each rounds as the torch ops it replaces, so the results are bit for bit theirs.

#include "ops.h"
#include "vec.h"
#include "vec_half.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace tidal_cpu;

// 1 / sqrt(mean(x^2) + eps) of one float32 row: the one sum of squares every norm here
// takes (16 lanes, then the lanes in order, then the tail), so the plain, the fused-add
// and the per-head norms round alike.
float inv_rms(const float* x, int64_t dim, float eps) {
  vec16 acc = {};
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16) {
    const vec16 v = load(x + c);
    acc += v * v;
  }
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  for (; c < dim; ++c) sum += x[c] * x[c];
  return 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

void norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r, x += dim, out += dim) {
    const float inv = inv_rms(x, dim, eps);
    int64_t c = 0;
    if (w) {
      for (; c + 16 <= dim; c += 16) store(out + c, load(w + c) * (load(x + c) * inv));
      for (; c < dim; ++c) out[c] = w[c] * (x[c] * inv);
    } else {
      for (; c + 16 <= dim; c += 16) store(out + c, load(x + c) * inv);
      for (; c < dim; ++c) out[c] = x[c] * inv;
    }
  }
}

// n values widened to float32 (16 lanes at a time).
template <typename T>
void widen_row(const T* x, float* xf, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) store(xf + c, load(x + c));
  for (; c < n; ++c) xf[c] = static_cast<float>(x[c]);
}

// One 16-bit value of the normalised row, transformers' two roundings: x * inv rounded to
// T, then times the weight rounded to T (the product of two 16-bit values is exact in
// float32, so one rounding, as torch's T * T).
template <typename T>
inline T norm_value(float x, float inv, const T* w, int64_t c) {
  const T normed = static_cast<T>(x * inv);
  return w ? static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(normed)) : normed;
}

// norm_value for 16 lanes: the same two roundings (store and round_to round to nearest
// even, as static_cast does), returned as float32 lanes holding T's values.
template <typename T>
inline vec16 norm_values(const float* x, float inv, const T* w, int64_t c) {
  const vec16 normed = round_to<T>(load(x) * splat(inv));
  return w ? round_to<T>(load(w + c) * normed) : normed;
}

// bfloat16 / float16 rows, transformers' order: the sum of squares and x * rsqrt in
// float32, rounded to T, then times the weight rounded to T.
template <typename T>
void norm_rows_16(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  thread_local std::vector<float> xf;
  xf.resize(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r, x += dim, out += dim) {
    widen_row(x, xf.data(), dim);
    const float inv = inv_rms(xf.data(), dim, eps);
    int64_t c = 0;
    for (; c + 16 <= dim; c += 16) store(out + c, norm_values<T>(xf.data() + c, inv, w, c));
    for (; c < dim; ++c) out[c] = norm_value(xf[c], inv, w, c);
  }
}

template <typename T>
void norm_rows_any(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  if constexpr (std::is_same_v<T, float>) {
    norm_rows(x, w, out, rows, dim, eps);
  } else {
    norm_rows_16(x, w, out, rows, dim, eps);
  }
}

}  // namespace

at::Tensor tidal_cpu::rms_norm(
    const at::Tensor& x,                     // [..., D] float32/bf16/fp16
    const std::optional<at::Tensor>& weight,  // [D] x's type
    double eps) {
  TORCH_CHECK(x.is_cpu() && is_kernel_float(x.scalar_type()) && x.dim() >= 1,
              "rms_norm takes a float32/bfloat16/float16 CPU tensor of at least one dimension");
  const int64_t dim = x.size(-1);
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->contiguous();
    TORCH_CHECK(w.is_cpu() && w.scalar_type() == x.scalar_type() && w.dim() == 1 &&
                    w.size(0) == dim,
                "rms_norm weight must be a [D] tensor of x's dtype matching its last dimension");
  }
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  if (rows == 0) return out;
  const float e = static_cast<float>(eps);
  // Below ~64K elements one thread is faster than waking the pool.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(dim, 1));
  with_float_type(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const T* wp = w.defined() ? w.data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    for_each_range(rows, grain, [&](int64_t begin, int64_t end) {
      norm_rows_any(xp + begin * dim, wp, op + begin * dim, end - begin, dim, e);
    });
  });
  return out;
}

// x + delta rounded to T (torch's T + T: the float32 sum, rounded), then that row's norm:
// bit for bit the unfused add and rms_norm above.
std::tuple<at::Tensor, at::Tensor> tidal_cpu::add_rms_norm(
    const at::Tensor& x,       // [..., D]
    const at::Tensor& delta,   // x's shape, type
    const at::Tensor& weight,  // [D] x's type
    double eps) {
  TORCH_CHECK(x.is_cpu() && is_kernel_float(x.scalar_type()) && x.dim() >= 1,
              "add_rms_norm takes a float32/bfloat16/float16 CPU tensor of at least one dimension");
  TORCH_CHECK(delta.is_cpu() && delta.scalar_type() == x.scalar_type() && delta.sizes() == x.sizes(),
              "add_rms_norm: delta must be a CPU tensor of x's shape and dtype");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  weight.size(0) == dim,
              "add_rms_norm weight must be a [D] tensor of x's dtype matching its last dimension");
  auto xc = x.contiguous(), dc = delta.contiguous(), w = weight.contiguous();
  auto sum = at::empty_like(xc), out = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  if (rows == 0) return {sum, out};
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(dim, 1));
  with_float_type(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const T* dp = dc.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for_each_range(rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* a = xp + r * dim;
        const T* b = dp + r * dim;
        T* s = sp + r * dim;
        int64_t c = 0;
        for (; c + 16 <= dim; c += 16) store(s + c, load(a + c) + load(b + c));
        for (; c < dim; ++c) s[c] = static_cast<T>(static_cast<float>(a[c]) + static_cast<float>(b[c]));
        norm_rows_any(s, wp, op + r * dim, 1, dim, e);
      }
    });
  });
  return {sum, out};
}

namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// out[:rot] = y * cos + roll(y, rot / 2) * signed_sin (y already T's values) rounded as the
// torch expression in T rounds it: each product, then the sum (no fused multiply-add);
// out[rot:] = y.
template <typename T>
void rotate_row(const float* y, const T* cos, const T* sin, T* out, int64_t dh, int64_t rot) {
  const int64_t half = rot / 2;
  auto one = [&](int64_t i, int64_t p) {
    const float a = static_cast<float>(static_cast<T>(y[i] * static_cast<float>(cos[i])));
    const float b = static_cast<float>(static_cast<T>(y[p] * static_cast<float>(sin[i])));
    out[i] = static_cast<T>(a + b);
  };
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {  // both halves, 16 lanes each
    const vec16 lo = load(y + i), hi = load(y + half + i);
    store(out + i, round_to<T>(round_to<T>(lo * load(cos + i)) +
                               round_to<T>(hi * load(sin + i))));
    store(out + half + i, round_to<T>(round_to<T>(hi * load(cos + half + i)) +
                                      round_to<T>(lo * load(sin + half + i))));
  }
  for (; i < half; ++i) {
    one(i, i + half);
    one(i + half, i);
  }
  for (i = rot; i < dh; ++i) out[i] = static_cast<T>(y[i]);
}
#pragma GCC pop_options

// One head row: optionally normalised as rms_norm (then scaled by w) into y, float32
// values that are exactly T's, then rotated into out.
template <typename T>
void norm_rope_row(const T* x, const T* w, const T* cos, const T* sin, T* out, int64_t dh,
                   int64_t rot, float eps, float* y) {
  if constexpr (std::is_same_v<T, float>) {
    if (w) {
      norm_rows(x, w, y, 1, dh, eps);
    } else {
      std::memcpy(y, x, dh * sizeof(float));
    }
  } else {
    widen_row(x, y, dh);
    if (w) {
      const float inv = inv_rms(y, dh, eps);
      int64_t c = 0;
      for (; c + 16 <= dh; c += 16) store(y + c, norm_values<T>(y + c, inv, w, c));
      for (; c < dh; ++c) y[c] = static_cast<float>(norm_value(y[c], inv, w, c));
    }
  }
  rotate_row(y, cos, sin, out, dh, rot);
}

}  // namespace

// norm_rope: x [T, H, Dh] (last dim contiguous, rows and heads may be strided), cos and
// signed_sin [T, R] (or [T, 1, R]) of x's type, R even, R <= Dh -> [T, H, Dh]: with
// weights, each head row normalised as rms_norm does, heads < split scaled by q_weight,
// the others by k_weight; then the first R dims rotated (x * cos + roll(x, R / 2) *
// signed_sin), the rest copied. Bit for bit rms_norm of the heads, the weights' products
// in x's type, then tidal/layers/rotary.apply_rotary_torch.
at::Tensor tidal_cpu::norm_rope(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, int64_t split, double eps) {
  TORCH_CHECK(x.is_cpu() && is_kernel_float(x.scalar_type()) && x.dim() == 3 && x.stride(2) == 1,
              "norm_rope: x must be a float32/bfloat16/float16 CPU [T, H, Dh] tensor, last dim "
              "contiguous");
  const int64_t num = x.size(0), heads = x.size(1), dh = x.size(2);
  auto c = cos.contiguous(), s = signed_sin.contiguous();
  const int64_t rot = c.dim() ? c.size(-1) : 0;
  TORCH_CHECK(rot % 2 == 0 && rot > 0 && rot <= dh,
              "norm_rope: the rotary dims (cos's last) must be even and in (0, Dh]");
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type() &&
                  c.numel() == num * rot && s.numel() == num * rot && s.size(-1) == rot,
              "norm_rope: cos/signed_sin must be [T, R] tensors of x's dtype");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(),
              "norm_rope: give both norm weights or neither");
  at::Tensor wq, wk;
  if (q_weight.has_value()) {
    wq = q_weight->contiguous();
    wk = k_weight->contiguous();
    for (const auto& w : {wq, wk})
      TORCH_CHECK(w.is_cpu() && w.scalar_type() == x.scalar_type() && w.dim() == 1 &&
                      w.size(0) == dh,
                  "norm_rope: norm weights must be [Dh] tensors of x's dtype");
    TORCH_CHECK(split >= 0 && split <= heads, "norm_rope: split must be in [0, H]");
  }
  auto out = at::empty({num, heads, dh}, x.options());
  if (num == 0 || heads == 0) return out;
  const float e = static_cast<float>(eps);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(heads * dh, 1));
  with_float_type(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* cp = c.data_ptr<T>();
    const T* sp = s.data_ptr<T>();
    const T* qw = wq.defined() ? wq.data_ptr<T>() : nullptr;
    const T* kw = wk.defined() ? wk.data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    for_each_range(num, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> y;
      y.resize(static_cast<size_t>(dh));
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          norm_rope_row(xp + t * xs0 + h * xs1, h < split ? qw : kw, cp + t * rot, sp + t * rot,
                        op + (t * heads + h) * dh, dh, rot, e, y.data());
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "norm_rope(Tensor x, Tensor cos, Tensor signed_sin, Tensor? q_weight, Tensor? k_weight, "
      "int split, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) {
  m.impl("rms_norm", &tidal_cpu::rms_norm);
  m.impl("add_rms_norm", &tidal_cpu::add_rms_norm);
  m.impl("norm_rope", &tidal_cpu::norm_rope);
}
