// Shared by the CPU kernels that multiply a few rows by a weight block: a register-blocked
// micro-kernel over column blocks of 64 (one block: K rows of 64 contiguous floats) and the
// dispatch of a runtime row count and prefetch hint to their templates.
#pragma once

#include "vec.h"

#include <cstdint>
#include <type_traits>

namespace tidal_cpu {

// Rows sharing one pass over a weight block: 6 rows x 4 vectors = 24 accumulators, plus
// 4 weight vectors, fit the 32 AVX-512 registers (4 rows: 11.0 ms at 256 tokens, 6: 9.0).
constexpr int kRows = 6;
constexpr int64_t kPrefetch = 32;   // weight rows (of 64 floats) to prefetch ahead

// The software prefetch of the weights, a per-CPU choice (issue #25): on an AMD EPYC
// (Zen 4) the non-temporal and the T0 hint measure the same, while on an Intel Xeon
// prefetchnta held the C++ linear at one row to ~10 GB/s and prefetcht0 reached 26-29
// (MKL: ~25). The ops take the hint as an argument; tidal/kernels/select.py times each
// at load on the model's own shapes and keeps the fastest.
enum Prefetch : int {
  kPrefetchNta = 0,   // prefetchnta: into L1, not left in the outer caches
  kPrefetchT0 = 1,    // prefetcht0: into every level
  kPrefetchNone = 2,  // the hardware prefetcher alone
};
constexpr int kNumPrefetch = 3;

template <int P>
inline void prefetch_weights(const float* p) {
  if constexpr (P == kPrefetchNta) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(p + 16 * line, 0, 0);
  } else if constexpr (P == kPrefetchT0) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(p + 16 * line, 0, 3);
  }
}

// acc[m][0..3] = sum_k x[m][k] * w[k][0..63] for R rows; w is K x 64 contiguous.
template <int R, int P>
inline void block_gemm(const float* const* x, const float* w, int64_t k_len, vec16 acc[][4]) {
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = splat(0.f);
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wk = w + k * 64;
    // The weights stream from memory once: ask for them kPrefetch rows ahead, on top of
    // the hardware prefetcher (+5% at 32 tokens on the 1024-wide model on the EPYC; 32
    // rows ahead rather than 16: another 1-3%).
    prefetch_weights<P>(wk + kPrefetch * 64);
    vec16 w0 = load(wk), w1 = load(wk + 16), w2 = load(wk + 32), w3 = load(wk + 48);
    for (int m = 0; m < R; ++m) {
      vec16 xm = splat(x[m][k]);
      acc[m][0] += xm * w0;
      acc[m][1] += xm * w1;
      acc[m][2] += xm * w2;
      acc[m][3] += xm * w3;
    }
  }
}

template <typename F>
void dispatch_rows(int r, F&& f) {
  switch (r) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// f(std::integral_constant<int, P>) for a runtime hint p in [0, kNumPrefetch).
template <typename F>
void dispatch_prefetch(int64_t p, F&& f) {
  switch (p) {
    case kPrefetchNta: f(std::integral_constant<int, kPrefetchNta>{}); break;
    case kPrefetchT0: f(std::integral_constant<int, kPrefetchT0>{}); break;
    default: f(std::integral_constant<int, kPrefetchNone>{}); break;
  }
}

}  // namespace tidal_cpu
