// RMSNorm over the last dimension on CPU, in one pass per row: the sum of squares, then
// x * rsqrt(mean + eps), then the weight (transformers' order of the two products); for
// float32, and for bfloat16 / float16 rows with float32 math and transformers' roundings. torch's F.rms_norm on CPU is a chain of 5-6 ops, ~8 us for one 1024-wide row
// and ~26 us for 32; a model calls it 2-3 times a layer (the per-step overhead).

#include "vec.h"
#include "vec_half.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace tidal_cpu;

void norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r, x += dim, out += dim) {
    vec16 acc = {};
    int64_t c = 0;
    for (; c + 16 <= dim; c += 16) {
      const vec16 v = load(x + c);
      acc += v * v;
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += acc[l];
    for (; c < dim; ++c) sum += x[c] * x[c];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    c = 0;
    if (w) {
      for (; c + 16 <= dim; c += 16) store(out + c, load(w + c) * (load(x + c) * inv));
      for (; c < dim; ++c) out[c] = w[c] * (x[c] * inv);
    } else {
      for (; c + 16 <= dim; c += 16) store(out + c, load(x + c) * inv);
      for (; c < dim; ++c) out[c] = x[c] * inv;
    }
  }
}

// bfloat16 / float16 rows, transformers' order: the sum of squares and x * rsqrt in
// float32, rounded to T, then times the weight rounded to T (the product of two 16-bit
// values is exact in float32, so one rounding, as torch's T * T).
template <typename T>
void norm_rows_16(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  thread_local std::vector<float> xf;
  xf.resize(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r, x += dim, out += dim) {
    vec16 acc = {};
    int64_t c = 0;
    for (; c + 16 <= dim; c += 16) {
      const vec16 v = load(x + c);
      store(xf.data() + c, v);
      acc += v * v;
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += acc[l];
    for (; c < dim; ++c) {
      xf[c] = static_cast<float>(x[c]);
      sum += xf[c] * xf[c];
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (c = 0; c < dim; ++c) {
      const T normed = static_cast<T>(xf[c] * inv);
      out[c] = w ? static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(normed)) : normed;
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x,                     // [..., D] float32/bf16/fp16
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
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<T, float>) {
        norm_rows(xp + begin * dim, wp, op + begin * dim, end - begin, dim, e);
      } else {
        norm_rows_16(xp + begin * dim, wp, op + begin * dim, end - begin, dim, e);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
