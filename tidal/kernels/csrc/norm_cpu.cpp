// RMSNorm over the last dimension for float32 on CPU, in one pass per row: the sum of
// squares, then x * rsqrt(mean + eps), then the weight (transformers' order of the two
// products). torch's F.rms_norm on CPU is a chain of 5-6 ops, ~8 us for one 1024-wide row
// and ~26 us for 32; a model calls it 2-3 times a layer (issue #13's per-step overhead).

#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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

at::Tensor rms_norm(const at::Tensor& x,                     // [..., D] float32
                    const std::optional<at::Tensor>& weight,  // [D] float32
                    double eps) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm takes a float32 CPU tensor of at least one dimension");
  const int64_t dim = x.size(-1);
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->contiguous();
    TORCH_CHECK(w.is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == dim,
                "rms_norm weight must be a float32 [D] tensor matching x's last dimension");
  }
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  if (rows == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Below ~64K elements one thread is faster than waking the pool.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    norm_rows(xp + begin * dim, wp, op + begin * dim, end - begin, dim, static_cast<float>(eps));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
