// AMX bf16 tiles (Intel Sapphire Rapids and later) for a group of up to 16 rows times one
// 64-column bf16 weight block of gemm.h's pair layout, float32 accumulation.
//
// Why: at a decode batch each expert sees a few rows (32 tokens x top-8 / 64 experts: ~4),
// and the AVX512-BF16 dot kernel spends one vdpbf16ps (32 multiply-adds) per row per
// 16 columns per k pair; one tdpbf16ps does 16 rows x 16 columns x 32 k (8192) from the
// same weight bytes, so the GEMMs fall back to what reading the weights costs.
//
// The pack is already AMX's B layout: a bf16 block holds its k rows in pairs, each pair
// row 64 columns x 2 bf16 (256 bytes), so 16 pair rows x 16 columns are one B tile loaded
// with a 256-byte stride. A (the rows) is M rows x 32 bf16 at the rows' stride; C is M x 16
// float32, four of them for the block's 64 columns. tdpbf16ps treats bf16 denormals as
// zero (products of normal bf16 are exact in float32; sums keep float32 rounding).
//
// Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM):
// amx_available() asks once. The tile configuration is per thread and other libraries
// (oneDNN) set their own on the same threads, so each call loads its own and releases
// the tiles at its end.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#define TIDAL_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tidal_cpu {

constexpr int kAmxRows = 16;   // rows of one A / C tile
constexpr int64_t kAmxPairs = 16;  // k pairs of one tile step (32 k)

// Whether this CPU and kernel run the AMX kernel: CPUID says AMX-TILE and AMX-BF16, and
// Linux grants the process the tile data state. Asked once.
inline bool amx_available() {
#ifdef TIDAL_AMX
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#ifdef TIDAL_AMX
// The 64-byte LDTILECFG operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// out [m][64] float32 (row stride 64) = m rows of a (bf16, `lda` elements apart, 2 * pairs
// long) times one bf16 pair block of `pairs` pair rows (pairs % 16 == 0). 1 <= m <= 16.
// Tiles: 0-3 C (the four 16-column quarters), 4 A, 5 and 6 B (alternating). `stream`:
// the block comes from memory (prefetch it); false where a previous call of the same block
// left it in L2, and the prefetches would only take load slots from the tile loads.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block(
    int m, const uint16_t* a, int64_t lda, const uint16_t* w, int64_t pairs, float* out,
    bool stream = true) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(m);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    cfg.rows[t] = kAmxPairs;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = lda * 2, w_stride = 256;  // bytes
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    _tile_loadd(4, a + 2 * p, a_stride);
    const uint16_t* wp = w + p * 128;  // pair row p: 128 bf16
    // The hardware prefetcher alone left the tiles waiting on the weights: ask for the
    // step after next (4 KiB a step, 64 lines), past the block's end into the next task's.
    if (stream) {
      const char* ahead = reinterpret_cast<const char*>(wp + 2 * kAmxPairs * 128);
      for (int line = 0; line < 64; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    }
    _tile_loadd(5, wp, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wp + 32, w_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wp + 64, w_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wp + 96, w_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out, 256);
  _tile_stored(1, out + 16, 256);
  _tile_stored(2, out + 32, 256);
  _tile_stored(3, out + 48, 256);
  _tile_release();
}
#endif

}  // namespace tidal_cpu
