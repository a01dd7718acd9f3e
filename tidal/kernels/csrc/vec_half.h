// 16-bit floats for the CPU kernels, the one set of conversions they all use: bf16 and
// fp16 widened to float32 (one value, 16 lanes into a vec16, or a bf16 pair row of the
// GEMM weight pack, gemm.h), so every product and sum stays float32, and float32 narrowed
// to bf16 (round to nearest even, as torch's .to()). bf16 is the high half of a float (a
// zero extension and a shift); fp16 takes F16C's vcvtph2ps where the build machine has it
// (GCC otherwise converts lane by lane). Only outputs and activation rows are narrowed,
// never a weight in the hot loop. Readers: the GEMMs (gemm.h: linear, router, MoE, FP8),
// attention over a bf16 / fp16 KV cache and the norms.
#pragma once

#include "vec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tidal_cpu {

inline float widen_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 -> bf16, round to nearest even (as torch's .to(bfloat16)); NaN stays a NaN.
inline uint16_t narrow_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 16 words of a bf16 pair row -> their even-k and odd-k halves as float32: the low half
// shifted up, the high half masked (little-endian: w[2p] is the low 16 bits).
inline void widen_bf16_pairs(const uint16_t* p, vec16& even, vec16& odd) {
  ivec16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  ivec16 lo = raw << 16, hi = raw & static_cast<int32_t>(0xffff0000u);
  std::memcpy(&even, &lo, sizeof(even));
  std::memcpy(&odd, &hi, sizeof(odd));
}

// 16 bf16 values widened to one vec16.
inline vec16 load(const c10::BFloat16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline vec16 load(const c10::Half* p) {
  vec16 v;
#if defined(__AVX512F__)
  // The zero-masked form: the plain one's undefined pass-through trips -Wmaybe-uninitialized.
  const __m512 f = _mm512_maskz_cvtph_ps(__mmask16(0xFFFF),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
#elif defined(__F16C__)
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(q)), hi = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
#else
  for (int l = 0; l < 16; ++l) v[l] = static_cast<float>(p[l]);
#endif
  return v;
}

// 16 lanes narrowed and stored, rounding to nearest even as torch's .to() (a NaN stays a
// NaN): the vector form of narrow_bf16 and of c10::Half's conversion.
inline void store(c10::BFloat16* p, vec16 v) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x16 quiet = (u >> 16) | 0x40u;
  const u32x16 r = (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
  const u16x16 h = __builtin_convertvector(r, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

inline void store(c10::Half* p, vec16 v) {
#if defined(__AVX512F__)
  __m512 f;
  std::memcpy(&f, &v, sizeof(f));
  // The zero-masked form, as load's (the plain one trips -Wmaybe-uninitialized).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_maskz_cvtps_ph(__mmask16(0xFFFF), f,
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int l = 0; l < 16; ++l) p[l] = static_cast<c10::Half>(v[l]);
#endif
}

// 16 lanes rounded to T's precision and widened back (identity for float): what a torch op
// in T leaves of a float32 result.
template <typename T>
inline vec16 round_to(vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T h[16];
    store(h, v);
    return load(h);
  }
}

// n values of src (any of the three) as float32 into dst, and back: row conversions
// outside the hot loops (queries in, outputs out).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store(dst + i, load(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

template <typename T, typename S>
inline void convert_row(const S* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, S>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    int64_t i = 0;  // 16 lanes: load widens exactly, store rounds to nearest even
    for (; i + 16 <= n; i += 16) store(dst + i, load(src + i));
    for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
  }
}

// Whether a tensor holds one of the float types the kernels read.
inline bool is_kernel_float(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
}

// f(T{}) for T the C++ type of t (float, c10::BFloat16 or c10::Half); t is one of them.
template <typename F>
inline void with_float_type(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::kBFloat16:
      f(c10::BFloat16{});
      break;
    case c10::kHalf:
      f(c10::Half{});
      break;
    default:
      f(float{});
  }
}

}  // namespace tidal_cpu
