// AMX bf16 tiles (Intel Sapphire Rapids and later) for a group of up to 16 rows
// (amx_block) or a panel of any rows (amx_panel) times one 64-column bf16 weight block of
// gemm.h's pair layout, float32 accumulation.
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

#include <algorithm>
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

// Loads the configuration of amx_block and amx_panel for groups of m rows (1..16): tiles
// 0-3 C (m x 16 float32), 4 A (m x 32 bf16), 5 and 6 B (16 pair rows x 16 columns).
__attribute__((target("amx-tile"))) inline void amx_configure(int m) {
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
}

// One tile step of amx_block and amx_panel: A's 32 k of the group's rows (tile 4, `a_stride`
// bytes apart) times the step's four 16-column B tiles (`wp`: 16 pair rows x 64 columns,
// 256 bytes a pair row), alternating B tiles 5 and 6, summed into C tiles 0-3.
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void amx_step(
    const uint16_t* a, int64_t a_stride, const uint16_t* wp) {
  constexpr int64_t w_stride = 256;  // bytes
  _tile_loadd(4, a, a_stride);
  _tile_loadd(5, wp, w_stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, wp + 32, w_stride);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, wp + 64, w_stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(6, wp + 96, w_stride);
  _tile_dpbf16ps(3, 4, 6);
}

// C tiles 0-3 to or from `c` (float32, `c_stride` bytes a row: the four quarters of 64
// columns).
__attribute__((target("amx-tile"), always_inline)) inline void amx_store_c(float* c,
                                                                          int64_t c_stride) {
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c + 32, c_stride);
  _tile_stored(3, c + 48, c_stride);
}

__attribute__((target("amx-tile"), always_inline)) inline void amx_zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// out [m][64] float32 (row stride 64) = m rows of a (bf16, `lda` elements apart, 2 * pairs
// long) times one bf16 pair block of `pairs` pair rows (pairs % 16 == 0). 1 <= m <= 16.
// Tiles: 0-3 C (the four 16-column quarters), 4 A, 5 and 6 B (alternating).
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block(
    int m, const uint16_t* a, int64_t lda, const uint16_t* w, int64_t pairs, float* out) {
  amx_configure(m);
  amx_zero_c();
  const int64_t a_stride = lda * 2;  // bytes
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    const uint16_t* wp = w + p * 128;  // pair row p: 128 bf16
    // The hardware prefetcher alone left the tiles waiting on the weights: ask for the
    // step after next (4 KiB a step, 64 lines), past the block's end into the next task's.
    const char* ahead = reinterpret_cast<const char*>(wp + 2 * kAmxPairs * 128);
    for (int line = 0; line < 64; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    amx_step(a + 2 * p, a_stride, wp);
  }
  amx_store_c(out, 256);
  _tile_release();
}

// Pair rows of one k chunk of amx_panel: 8 tile steps, 32 KiB of a 64-column bf16 block,
// which stays in L1 (48 KiB) while every row group of the panel multiplies it.
constexpr int64_t kAmxChunkPairs = 8 * kAmxPairs;

// out [rows][64] float32 (row stride 64) = rows of a (bf16, `lda` apart) times one bf16
// pair block (pairs % 16 == 0), any number of rows (the linear's panels). Why not
// amx_block per 16 rows: a block deeper than L1 (K 2048: 256 KiB) was read from L2 again
// by every row group, 4 KiB a tile step, slower than the tiles multiply; here the depth is
// cut into chunks that stay in L1 while every group multiplies them, the groups' sums
// stored in `out` between chunks (4 KiB a group a chunk), and the next chunk is fetched
// into L2 meanwhile. 1024 rows x 1024 x 1024, 1 thread: 2.23 -> 1.97 ms (oneDNN 1.68);
// 256 rows x 2048 x 2048: 2.24 -> 1.85 ms (oneDNN 1.85).
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_panel(
    int64_t rows, const uint16_t* a, int64_t lda, const uint16_t* w, int64_t pairs,
    float* out) {
  const int64_t a_stride = lda * 2, c_stride = 256;  // bytes
  const int64_t full = rows / kAmxRows * kAmxRows;
  const int64_t groups = (rows + kAmxRows - 1) / kAmxRows;
  for (int64_t p0 = 0; p0 < pairs; p0 += kAmxChunkPairs) {
    const int64_t p_end = std::min(pairs, p0 + kAmxChunkPairs);
    // The next chunk (the next block's first past the end: blocks lie back to back) is
    // fetched into L2 a few lines a tile step while this one is multiplied, so the next
    // chunk's first group does not wait on memory.
    const int64_t steps = (p_end - p0) / kAmxPairs;
    const int64_t lines = (kAmxChunkPairs * 256 / 64 + groups * steps - 1) / (groups * steps);
    const char* next = reinterpret_cast<const char*>(w + p_end * 128);
    int64_t step = 0;
    // the full groups under one configuration, then the short last group under its own
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
      if (r0 == 0 && full > 0) amx_configure(kAmxRows);
      if (r0 == full) amx_configure(static_cast<int>(rows - full));
      float* c = out + r0 * 64;
      if (p0 == 0) {
        amx_zero_c();
      } else {
        _tile_loadd(0, c, c_stride);
        _tile_loadd(1, c + 16, c_stride);
        _tile_loadd(2, c + 32, c_stride);
        _tile_loadd(3, c + 48, c_stride);
      }
      const uint16_t* ar = a + r0 * lda;
      for (int64_t p = p0; p < p_end; p += kAmxPairs) {
        for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(next + 64 * (step * lines + l), 0, 2);
        ++step;
        amx_step(ar + 2 * p, a_stride, w + p * 128);
      }
      amx_store_c(c, c_stride);
    }
  }
  _tile_release();
}
#endif

}  // namespace tidal_cpu
