// Shared by the CPU kernels that multiply a few rows by a weight block: register-blocked
// micro-kernels over column blocks of 64 and the dispatch of a runtime row count, prefetch
// hint and kernel kind to their templates.
//
// A block of float32 weights is K rows of 64 contiguous floats. A block of bf16 weights
// holds the rows in pairs, K_pad / 2 of 64 x 2 bf16 (K_pad = K rounded up to even, the
// pad row zero): entry (p, c) is (w[2p][c], w[2p+1][c]), one 32-bit word. Two kernels read
// it with float32 accumulation: the shift kernel widens each half to float32 (a bf16 is the
// top 16 bits of a float32) and multiplies float32 activations, exact products; the dot
// kernel (AVX512-BF16 vdpbf16ps) multiplies activations rounded to bf16 by both halves in
// one instruction, where the CPU has it.
#pragma once

#include "amx.h"
#include "vec.h"
#include "vec_half.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
#define TIDAL_DPBF16 1  // the compiler knows AVX512-BF16; the CPU is asked at run time
#include <immintrin.h>
#endif

namespace tidal_cpu {

// Rows sharing one pass over a weight block: 6 rows x 4 vectors = 24 accumulators, plus
// 4 weight vectors, fit the 32 AVX-512 registers (4 rows: 11.0 ms at 256 tokens, 6: 9.0).
constexpr int kRows = 6;
constexpr int64_t kPrefetch = 32;   // weight rows (of 64 floats) to prefetch ahead

// The software prefetch of the weights, a per-CPU choice: on an AMD EPYC
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

// The four cache lines at p: one row of a float32 block, one pair of rows of a bf16 one.
template <int P>
inline void prefetch_weights(const void* p) {
  const char* c = static_cast<const char*>(p);
  if constexpr (P == kPrefetchNta) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(c + 64 * line, 0, 0);
  } else if constexpr (P == kPrefetchT0) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(c + 64 * line, 0, 3);
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

// The same product on a bf16 block of `pairs` row pairs; x rows are float32 of length
// 2 * pairs (the pad column zero: its weight is zero, but 0 * NaN would not be).
template <int R, int P>
inline void block_gemm_bf16(const float* const* x, const uint16_t* w, int64_t pairs,
                            vec16 acc[][4]) {
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = splat(0.f);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * 128;
    prefetch_weights<P>(wp + kPrefetch * 128);  // the same bytes ahead as the float kernel
    for (int v = 0; v < 4; ++v) {
      vec16 even, odd;
      widen_bf16_pairs(wp + 32 * v, even, odd);
      for (int m = 0; m < R; ++m)
        acc[m][v] += splat(x[m][2 * p]) * even + splat(x[m][2 * p + 1]) * odd;
    }
  }
}

#ifdef TIDAL_DPBF16
// The dot kernel: x rows are bf16 pairs (one 32-bit word per row pair), out [R][64].
// Compiled for AVX512-BF16 whatever the build machine; call only where dot_available().
template <int R, int P>
__attribute__((target("avx512bf16,avx512f,avx512bw"))) void block_gemm_dot(
    const uint32_t* const* x, const uint16_t* w, int64_t pairs, float* out) {
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * 128;
    prefetch_weights<P>(wp + kPrefetch * 128);
    for (int v = 0; v < 4; ++v) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + 32 * v);
      for (int m = 0; m < R; ++m)
        acc[m][v] = _mm512_dpbf16_ps(
            acc[m][v], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m][p])), wv);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + m * 64 + 16 * v, acc[m][v]);
}
#endif

// Whether this CPU runs the dot kernel (AVX512-BF16), asked once.
inline bool dot_available() {
#ifdef TIDAL_DPBF16
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// FP8 (e4m3) weights: a block is K rows of 64 bytes, with the scales of its 64 columns per
// k chunk beside it ([C, 64] float32). e4m3 -> float32 through fp16: sign to bit 15, the 7
// exponent-and-mantissa bits to bits 7..13 gives an fp16 of value x * 2^-8 for every
// finite e4m3 x (fp16's exponent bias is 8 above e4m3's), and the hardware's fp16 ->
// float32 conversion (vec_half.h) widens it exactly, subnormals included, to a *normal*
// float32; one multiply by scale * 2^8 finishes it. (Moving the bits straight into a
// float32 would make e4m3's subnormals float32 denormals, and every vector multiply with
// a denormal lane takes a microcode assist on x86: a 2048x2048 linear ran 14x slower than
// bf16.) (0x7f / 0xff, e4m3fn's NaN, decode as +-480: checkpoints hold no NaN.)
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
constexpr float kFp8Unbias = 256.f;  // 2^8

// 16 e4m3 bytes -> 16 floats of value x * 2^-8. The bytes are sign-extended, so shifted
// left by 7 a negative one has its sign at bit 15 and a stray 1 at bit 14 (fp16's top
// exponent bit, 0 for every e4m3 value), cleared by the mask: three integer ops.
inline vec16 decode_e4m3(const uint8_t* p) {
  i8x16 b;
  std::memcpy(&b, p, sizeof(b));
  const i16x16 i = __builtin_convertvector(b, i16x16);
  const i16x16 h = (i << 7) & static_cast<int16_t>(0xBFFF);
  c10::Half halves[16];
  std::memcpy(halves, &h, sizeof(h));
  return load(halves);
}

// acc = R rows of x (float32, K long) times one FP8 block [K, 64] with its scales [C, 64].
template <int R, int P>
inline void block_gemm_fp8(const float* const* x, const uint8_t* w, const float* s, int64_t depth,
                           int64_t block_k, vec16 acc[][4]) {
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = splat(0.f);
  for (int64_t k0 = 0, chunk = 0; k0 < depth; k0 += block_k, ++chunk) {
    vec16 sv[4];
    for (int v = 0; v < 4; ++v) sv[v] = load(s + chunk * 64 + 16 * v) * splat(kFp8Unbias);
    const int64_t k1 = std::min(depth, k0 + block_k);
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t* wk = w + k * 64;
      // one 64-byte row per k: the float kernel's bytes ahead are 4x the rows ahead here
      if constexpr (P == kPrefetchNta) __builtin_prefetch(wk + 4 * kPrefetch * 64, 0, 0);
      if constexpr (P == kPrefetchT0) __builtin_prefetch(wk + 4 * kPrefetch * 64, 0, 3);
      for (int v = 0; v < 4; ++v) {
        vec16 wv = decode_e4m3(wk + 16 * v) * sv[v];
        for (int m = 0; m < R; ++m) acc[m][v] += splat(x[m][k]) * wv;
      }
    }
  }
}

// The FP8 dot kernel: the same [K, 64] FP8 block read as bf16 and multiplied by bf16
// activations in vdpbf16ps (AVX512-BF16), float32 accumulation. Why: the fp16 decode
// above costs six vector ops and a multiply per 16 weights, and at one row decode is
// bound by them, not by the bytes; this one decodes 64 weights in five (two vpermt2b
// table lookups of the 7 exponent-and-mantissa bits to the bf16's low and high bytes, the
// sign ORed in, two byte interleaves to words) and multiplies two k rows at once.
//   Pairs: rows k and k+1 (64 bytes each) are interleaved bytewise (unpacklo/hi_epi8, per
// 128-bit lane), so each 32-bit word of a decoded register is (w[k][c], w[k+1][c]), as
// vdpbf16ps reads it against the activations' pair (x[k], x[k+1]). The interleaves leave
// the columns permuted: accumulator u (0..3) lane 4l + i holds column 16l + 4u + i, a 4x4
// transpose of 128-bit blocks of the natural order (transpose_blocks), applied to the
// scales on the way in and to the sums on the way out.
//   Exact: every e4m3 value is a bf16 (3 mantissa bits of 7; the subnormals m * 2^-9 are
// bf16 normals, so vdpbf16ps's flush of denormal inputs never touches one); each 128-long
// k chunk sums in its own accumulators, then one multiply-add by the block scale.
// block_k must be even (a pair never straddles two scales; checked by the ops).
struct Fp8Bf16Tables {
  alignas(64) uint8_t lo[128];  // low byte of bf16(e4m3 code c), c = the 7 bits below the sign
  alignas(64) uint8_t hi[128];  // high byte (its sign bit 0: the code's sign is ORed in)
};

inline const Fp8Bf16Tables& fp8_bf16_tables() {
  static const Fp8Bf16Tables t = [] {
    Fp8Bf16Tables out{};
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      const float v = c == 0x7f ? __builtin_nanf("")                       // e4m3fn's NaN
                      : e == 0  ? std::ldexp(static_cast<float>(m), -9)     // subnormal
                                : std::ldexp(1.f + m / 8.f, e - 7);
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      out.lo[c] = static_cast<uint8_t>(bits >> 16);
      out.hi[c] = static_cast<uint8_t>(bits >> 24);
    }
    return out;
  }();
  return t;
}

#ifdef TIDAL_DPBF16
#define TIDAL_FP8_DOT_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vbmi")))

// v[u].block[l] <-> v[l].block[u] (128-bit blocks): the FP8 dot kernel's column order to
// the natural one and back (an involution).
// (GCC 12 warns that _mm512_shuffle_f32x4's own undefined pass-through is uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
TIDAL_FP8_DOT_TARGET inline void transpose_blocks(__m512 v[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}
#pragma GCC diagnostic pop

// One k pair (rows r0, r1 of 64 bytes) decoded to bf16: w[u] (u = 0..3) holds, per 32-bit
// lane, (w[k][c], w[k+1][c]) for the columns c of accumulator u's permuted order; tl: the
// tables' lo and hi halves and the sign mask, in registers.
TIDAL_FP8_DOT_TARGET __attribute__((always_inline)) inline void fp8_decode_pair(
    __m512i r0, __m512i r1, const __m512i tl[5], __m512i w[4]) {
  const __m512i pairs[2] = {_mm512_unpacklo_epi8(r0, r1), _mm512_unpackhi_epi8(r0, r1)};
  for (int a = 0; a < 2; ++a) {
    const __m512i lo = _mm512_permutex2var_epi8(tl[0], pairs[a], tl[1]);  // bits 0..6 index
    __m512i hi = _mm512_permutex2var_epi8(tl[2], pairs[a], tl[3]);
    hi = _mm512_ternarylogic_epi32(hi, pairs[a], tl[4], 0xF8);  // hi | (code & 0x80)
    w[2 * a] = _mm512_unpacklo_epi8(lo, hi);
    w[2 * a + 1] = _mm512_unpackhi_epi8(lo, hi);
  }
}

// The tables and the sign mask in registers, as fp8_decode_pair takes them.
TIDAL_FP8_DOT_TARGET __attribute__((always_inline)) inline void fp8_tables_in(__m512i tl[5]) {
  const Fp8Bf16Tables& tab = fp8_bf16_tables();
  tl[0] = _mm512_load_si512(tab.lo);
  tl[1] = _mm512_load_si512(tab.lo + 64);
  tl[2] = _mm512_load_si512(tab.hi);
  tl[3] = _mm512_load_si512(tab.hi + 64);
  tl[4] = _mm512_set1_epi8(static_cast<char>(0x80));
}

// One k pair (rows r0, r1; p: the pair's index in x) into the sums `part`.
template <int R>
TIDAL_FP8_DOT_TARGET __attribute__((always_inline)) inline void fp8_dot_step(
    __m512i r0, __m512i r1, const uint32_t* const* x, int64_t p, const __m512i tl[5],
    __m512 part[][4]) {
  __m512i w[4];
  fp8_decode_pair(r0, r1, tl, w);
  for (int m = 0; m < R; ++m) {
    const __m512bh xm = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m][p]));
    for (int u = 0; u < 4; ++u) part[m][u] = _mm512_dpbf16_ps(part[m][u], xm, (__m512bh)w[u]);
  }
}

// x rows are bf16 pairs (one 32-bit word per k pair, zero past K); out [R][64] float32.
// Compiled for AVX512-BF16 + VBMI whatever the build machine; call only where
// fp8_dot_available().
template <int R, int P>
TIDAL_FP8_DOT_TARGET void block_gemm_fp8_dot(const uint32_t* const* x, const uint8_t* w,
                                             const float* s, int64_t depth, int64_t block_k,
                                             float* out) {
  __m512i tl[5];
  fp8_tables_in(tl);
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  for (int64_t k0 = 0, chunk = 0; k0 < depth; k0 += block_k, ++chunk) {
    const int64_t k1 = std::min(depth, k0 + block_k);
    __m512 part[R][4];
    for (int m = 0; m < R; ++m)
      for (int u = 0; u < 4; ++u) part[m][u] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      const uint8_t* wk = w + k * 64;
      // two 64-byte rows per step: as far ahead in bytes as block_gemm_fp8
      if constexpr (P != kPrefetchNone) {
        constexpr int hint = P == kPrefetchNta ? 0 : 3;
        __builtin_prefetch(wk + 4 * kPrefetch * 64, 0, hint);
        __builtin_prefetch(wk + 4 * kPrefetch * 64 + 64, 0, hint);
      }
      fp8_dot_step<R>(_mm512_loadu_si512(wk), _mm512_loadu_si512(wk + 64), x, k / 2, tl, part);
    }
    if (k < k1)  // odd K: the last row alone, its pair's second row zero
      fp8_dot_step<R>(_mm512_loadu_si512(w + k * 64), _mm512_setzero_si512(), x, k / 2, tl, part);
    __m512 sv[4];
    for (int u = 0; u < 4; ++u) sv[u] = _mm512_loadu_ps(s + chunk * 64 + 16 * u);
    transpose_blocks(sv);  // to the permuted column order of part
    for (int m = 0; m < R; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_fmadd_ps(part[m][u], sv[u], acc[m][u]);
  }
  for (int m = 0; m < R; ++m) {
    transpose_blocks(acc[m]);
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + m * 64 + 16 * v, acc[m][v]);
  }
}

#ifdef TIDAL_AMX
#define TIDAL_FP8_AMX 1
#define TIDAL_FP8_AMX_TARGET \
  __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vbmi,amx-tile,amx-bf16")))

// One tile step of block_gemm_fp8_amx: the weight pairs ks / 2 .. of the chunk ending at
// k1 decoded into the four B tiles b [16 pairs][4 tiles][16 words] (amx_step's block
// layout), the rows' pairs into the A tile a [R][16 pairs]. (A function of its own, not a
// lambda: a lambda's body does not take its enclosing function's target attribute, and
// without AVX-512 on the build machine's flags the intrinsics would not compile.)
template <int R>
TIDAL_FP8_AMX_TARGET __attribute__((always_inline)) inline void fp8_amx_decode_step(
    const uint8_t* w, const uint32_t* const* x, int64_t ks, int64_t k1, const __m512i tl[5],
    uint32_t (*b)[4][16], uint32_t (*a)[kAmxPairs]) {
  // Prefetch one tile step's bytes ahead (2 KiB). Measured on a Sapphire Rapids Xeon, 2
  // threads, the 64-expert layer at 1 token over 8 layers' weights (separate runs, noisy
  // by ~10%): 1 KiB ahead 148 us, 2 KiB 131, 4 KiB 159, 16 KiB 193, the dot kernel's
  // 8 KiB 168.
  constexpr int64_t kAhead = 2 * kAmxPairs * 64;
  const int64_t pairs = std::min<int64_t>(kAmxPairs, (k1 - ks + 1) / 2);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t k = ks + 2 * p;
    const uint8_t* wk = w + k * 64;
    __builtin_prefetch(wk + kAhead, 0, 3);
    __builtin_prefetch(wk + kAhead + 64, 0, 3);
    __m512i d[4];
    fp8_decode_pair(_mm512_loadu_si512(wk),
                    k + 1 < k1 ? _mm512_loadu_si512(wk + 64) : _mm512_setzero_si512(), tl, d);
    for (int u = 0; u < 4; ++u) _mm512_store_si512(b[p][u], d[u]);
  }
  for (int64_t p = pairs; p < kAmxPairs; ++p)
    for (int u = 0; u < 4; ++u) _mm512_store_si512(b[p][u], _mm512_setzero_si512());
  const __mmask16 live = static_cast<__mmask16>((1u << pairs) - 1);
  for (int m = 0; m < R; ++m) _mm512_store_si512(a[m], _mm512_maskz_loadu_epi32(live, x[m] + ks / 2));
  // The tile loads read these buffers, but the compiler's tile-load intrinsics do not say
  // they read memory: keep the stores above them.
  asm volatile("" ::: "memory");
}

// The FP8 AMX kernel: the dot kernel's table decode, but the products on AMX tiles. Why:
// on a Xeon (Sapphire Rapids) one vdpbf16ps costs about two cycles of the vector ports
// the decode needs too, so the dot kernel spent ~24 cycles per 128 weights at one row
// (decode alone ~14) and ~52 at four; tdpbf16ps runs on the tile unit beside the
// decode, so the block costs about its decode at any row count up to kRows.
//   Each tile step (32 k) decodes 16 pairs into four B tiles in L1, laid out as amx_step
// reads a bf16 block (pair row p: 64 columns x 2 bf16; tile u's 16 columns are
// fp8_decode_pair's w[u], accumulator u's permuted columns, as the dot kernel's), copies
// the rows' 16 pairs into the A tile, and runs amx_step (amx.h's tiles and
// configuration). A k chunk's sums go through memory once, times the chunk's scales; the
// column order is put back at the end (transpose_blocks). A short step (the end of a
// chunk or of K) zeroes its B rows past the last pair (0 x NaN would not be 0).
//   tdpbf16ps sums a step's 32 products in its own order: the sums differ from the dot
// kernel's in float32 rounding only (the same bf16 operands, exact products).
// x: bf16 pairs as block_gemm_fp8_dot's; out [R][64] float32. Call only where
// fp8_dot_available() and amx_available(), block_k even.
template <int R>
TIDAL_FP8_AMX_TARGET void block_gemm_fp8_amx(const uint32_t* const* x, const uint8_t* w,
                                             const float* s, int64_t depth, int64_t block_k,
                                             float* out) {
  static_assert(R >= 1 && R <= kAmxRows, "one A tile holds up to 16 rows");
  if (depth == 0) {  // no k: zero sums (and no scales to read)
    std::memset(out, 0, sizeof(float) * R * 64);
    return;
  }
  constexpr int kBufs = 3;  // a step's tiles are read one decode after it was written
  __m512i tl[5];
  fp8_tables_in(tl);
  alignas(64) uint32_t bb[kBufs][kAmxPairs][4][16];  // the steps' four B tiles: 4 KiB each
  alignas(64) uint32_t ab[kBufs][R][kAmxPairs];      // and their A tiles
  alignas(64) float c[R][64];
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  amx_configure(R);
  amx_zero_c();
  // Software-pipelined: step i + 1 is decoded before step i's tiles are loaded, so the
  // tile loads find their bytes in L1, not still in the store buffer (a tile load that
  // waited on them stalled the decode behind it: no faster than the dot kernel).
  int64_t ks = 0, k1 = std::min(depth, block_k), chunk = 0;
  int b = 0;
  fp8_amx_decode_step<R>(w, x, ks, k1, tl, bb[b], ab[b]);
  for (;;) {
    int64_t next = ks + 2 * kAmxPairs, next_k1 = k1;
    const bool chunk_ends = next >= k1;
    if (chunk_ends) {  // the next chunk starts where this one ends
      next = k1;
      next_k1 = std::min(depth, k1 + block_k);
    }
    const bool more = next < depth;
    if (more) {
      const int nb = (b + 1) % kBufs;
      fp8_amx_decode_step<R>(w, x, next, next_k1, tl, bb[nb], ab[nb]);
    }
    amx_step(reinterpret_cast<const uint16_t*>(ab[b]), kAmxPairs * sizeof(uint32_t),
             reinterpret_cast<const uint16_t*>(bb[b]));
    if (chunk_ends) {
      // C tile u holds accumulator u's columns, so the stored row m is part[m][0..3]
      amx_store_c(&c[0][0], 64 * sizeof(float));
      __m512 sv[4];
      for (int u = 0; u < 4; ++u) sv[u] = _mm512_loadu_ps(s + chunk * 64 + 16 * u);
      transpose_blocks(sv);
      for (int m = 0; m < R; ++m)
        for (int u = 0; u < 4; ++u)
          acc[m][u] = _mm512_fmadd_ps(_mm512_load_ps(c[m] + 16 * u), sv[u], acc[m][u]);
      amx_zero_c();
      ++chunk;
    }
    if (!more) break;
    ks = next;
    k1 = next_k1;
    b = (b + 1) % kBufs;
  }
  _tile_release();
  for (int m = 0; m < R; ++m) {
    transpose_blocks(acc[m]);
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + m * 64 + 16 * v, acc[m][v]);
  }
}
#endif
#endif

// Whether this CPU runs the FP8 dot kernel (AVX512-BF16 and AVX512-VBMI), asked once.
inline bool fp8_dot_available() {
#ifdef TIDAL_DPBF16
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return ok;
#else
  return false;
#endif
}

// The kernel reading a weight block: which one is decided per call, by the pack's dtype
// and the variant select.py measured.
enum class Kernel : int {
  kFloat = 0,      // float32 weights, float32 activations
  kBf16Shift = 1,  // bf16 pairs, float32 activations
  kBf16Dot = 2,    // bf16 pairs, bf16 activations (vdpbf16ps)
  kFp8 = 3,        // FP8 bytes with per-column, per-k-chunk scales; float32 activations
  kFp8Dot = 4,     // the same FP8 blocks as bf16, bf16 activations (vdpbf16ps)
  kFp8Amx = 5,     // the FP8 dot kernel's decode, the products on AMX tiles
};

// Whether `kind` reads its activations as bf16 pairs (else float32).
constexpr bool reads_bf16_pairs(Kernel kind) {
  return kind == Kernel::kBf16Dot || kind == Kernel::kFp8Dot || kind == Kernel::kFp8Amx;
}

// Rows of activations as the kernel reads them: f for kFloat / kBf16Shift / kFp8, h (bf16
// pairs) for the kinds reads_bf16_pairs names.
struct RowPtrs {
  const float* f[kRows];
  const uint32_t* h[kRows];
};

// acc = R rows of x times one weight block, `depth` = K (float, FP8) or K_pad / 2 (bf16
// pairs); FP8 blocks come with their scales [ceil(K / block_k), 64].
template <int R, int P>
inline void block_gemm_any(Kernel kind, const RowPtrs& x, const void* w, int64_t depth,
                           vec16 acc[][4], const float* scales = nullptr, int64_t block_k = 0) {
  if (kind == Kernel::kFp8) {
    block_gemm_fp8<R, P>(x.f, static_cast<const uint8_t*>(w), scales, depth, block_k, acc);
  } else if (kind == Kernel::kFloat) {
    block_gemm<R, P>(x.f, static_cast<const float*>(w), depth, acc);
  } else if (kind == Kernel::kBf16Shift) {
    block_gemm_bf16<R, P>(x.f, static_cast<const uint16_t*>(w), depth, acc);
  } else {
    float out[R * 64] = {};  // stays zero where the dot kernels are not compiled (never chosen)
#ifdef TIDAL_DPBF16
    if (kind == Kernel::kFp8Dot)
      block_gemm_fp8_dot<R, P>(x.h, static_cast<const uint8_t*>(w), scales, depth, block_k, out);
#ifdef TIDAL_FP8_AMX
    else if (kind == Kernel::kFp8Amx)  // its own prefetch: the tiles' pace, not a hint's
      block_gemm_fp8_amx<R>(x.h, static_cast<const uint8_t*>(w), scales, depth, block_k, out);
#endif
    else
      block_gemm_dot<R, P>(x.h, static_cast<const uint16_t*>(w), depth, out);
#endif
    for (int m = 0; m < R; ++m)
      for (int v = 0; v < 4; ++v) acc[m][v] = load(out + m * 64 + 16 * v);
  }
}


// The activations x [T, K] (float32 or bf16; rows may be strided, the last dim not) as
// `kind` reads them: float32 x itself for kFloat; else copies of k_pad columns, zero past
// K -- float32 for kBf16Shift and kFp8, bf16 (rounded) for the pair readers (k_pad even:
// their pairs). T x K: small beside a weight.
class StagedRows {
 public:
  StagedRows(const at::Tensor& x, Kernel kind, int64_t k_pad) : kind_(kind) {
    const int64_t rows = x.size(0), depth = x.size(1), xs = x.stride(0);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (kind == Kernel::kFloat) {  // float32 x as it is
      f_ = x.data_ptr<float>();
      stride_ = xs;
      return;
    }
    stride_ = k_pad;
    const float* xf = bf16 ? nullptr : x.data_ptr<float>();
    const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
    if (kind == Kernel::kBf16Shift || kind == Kernel::kFp8) {
      fbuf_.assign(rows * k_pad, 0.f);
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t k = 0; k < depth; ++k)
          fbuf_[t * k_pad + k] = bf16 ? widen_bf16(xh[t * xs + k]) : xf[t * xs + k];
      f_ = fbuf_.data();
    } else {
      hbuf_.assign(rows * k_pad, 0);
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t k = 0; k < depth; ++k)
          hbuf_[t * k_pad + k] = bf16 ? xh[t * xs + k] : narrow_bf16(xf[t * xs + k]);
    }
  }

  // Row t of the activations as slot m of p.
  void put(RowPtrs& p, int m, int64_t t) const {
    if (reads_bf16_pairs(kind_))
      p.h[m] = reinterpret_cast<const uint32_t*>(hbuf_.data() + t * stride_);
    else
      p.f[m] = f_ + t * stride_;
  }

 private:
  Kernel kind_;
  const float* f_ = nullptr;
  int64_t stride_ = 0;
  std::vector<float> fbuf_;
  std::vector<uint16_t> hbuf_;
};

// The kernel for a pack of `weight` dtype and a variant's `dot` flag, checked.
inline Kernel kernel_for(at::ScalarType weight, bool dot, const char* op) {
  if (weight == at::kFloat) {
    TORCH_CHECK(!dot, op, ": the dot kernel takes bf16 weights");
    return Kernel::kFloat;
  }
  TORCH_CHECK(weight == at::kBFloat16, op, ": weights must be float32 or bfloat16");
  if (!dot) return Kernel::kBf16Shift;
  TORCH_CHECK(dot_available(), op, ": this CPU has no AVX512-BF16 (the dot kernel)");
  return Kernel::kBf16Dot;
}

// Whether this CPU runs the FP8 AMX kernel: the FP8 dot kernel's decode and AMX-BF16.
inline bool fp8_amx_available() {
#ifdef TIDAL_FP8_AMX
  return fp8_dot_available() && amx_available();
#else
  return false;
#endif
}

// The FP8 kernel for a variant's `dot` and `amx` flags, checked.
inline Kernel fp8_kernel_for(bool dot, bool amx, int64_t block_k, const char* op) {
  TORCH_CHECK(!(dot && amx), op, ": the FP8 dot and AMX kernels are two choices, not one");
  if (!dot && !amx) return Kernel::kFp8;
  TORCH_CHECK(block_k % 2 == 0, op, ": the FP8 ", amx ? "AMX" : "dot",
              " kernel needs an even block_k, got ", block_k);
  if (amx) {
    TORCH_CHECK(fp8_amx_available(), op,
                ": this CPU has no AVX512-BF16, AVX512-VBMI and AMX-BF16 (the FP8 AMX kernel), "
                "or Linux refused the tiles");
    return Kernel::kFp8Amx;
  }
  TORCH_CHECK(fp8_dot_available(), op,
              ": this CPU has no AVX512-BF16 and AVX512-VBMI (the FP8 dot kernel)");
  return Kernel::kFp8Dot;
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
