// Decode attention over the paged KV cache on CPU (the rotary embedding is norm_cpu.cpp's
// norm_rope).
//
// Why: the torch decode path is a K gather, a baddbmm, a softmax and an embedding_bag,
// with their index tensors and views. Here each (sequence, KV head) reads its K and V
// rows once, straight from the cache, for all the query heads that share them, in one
// parallel region a layer. At 32 sequences, 32-token prompts, 64 new tokens, per layer and
// step: 1024-wide model 334 -> 301 us, 256-wide 144 -> 91 (2 cores). A 16-bit cache's rows
// are widened once for the whole group of query heads: 32 sequences of 256 keys, bf16,
// 16 query / 4 KV heads of 64, 2 threads: 1146 -> 780 us (torch's path 952).
//
// Three things keep it near the memory's pace (benchmarks/attention_kv.py, 32 sequences,
// bf16, 16 query / 4 KV heads of 64, caches evicted before each call, 2 threads on a Zen 4:
// 256 keys 1.38 -> 0.81 ms, 1,024 keys 4.48 -> 2.26 ms; torch's path 1.6 and 5.3):
// - a thread asks for the next task's K and V lines while it computes the current task
//   (TaskLines): asking only for a task's own lines as it starts left the cores waiting
//   on each task's misses in turn;
// - the 16 keys of a chunk are 16 independent chains of multiply-adds (column chunk outer,
//   key inner), not one latency-bound chain a key;
// - a bf16 cache with 64 or 128 values a head is read as 32-bit words, its even and odd
//   elements apart (pair_scores, pair_values): no widened copy is written and read back,
//   and each V row is split once for up to 8 / (Dh / 32) query heads whose sums stay in
//   registers.
//
// decode_attention: q [D, Hq, Dh] (rows may be strided), cache [2, NB, Hkv, bs, Dh]
// contiguous, block_table [D, B] int64, seq_lens [D] int64 (keys 0..len-1 of sequence d
// sit at block block_table[d][t / bs], offset t % bs) -> [D, Hq, Dh] in q's type; query
// head h reads KV head h / (Hq / Hkv). q and the cache are each float32, bfloat16 or
// float16 (--kv-cache-dtype need not be the model's): the cache is read in its own type
// and widened in registers, never copied; softmax and sums are float32 whatever the
// types. Softmax as torch's: max, exp(s - max), divide by the sum, then the
// probability-weighted sum of V. window > 0 keeps the last window keys of each sequence;
// sinks [Hq] float32 add one logit per query head to the softmax (GPT-OSS).
//
// write_kv: each token's K/V heads into its slot of the cache, cast to its type.

#include "ops.h"
#include "vec.h"
#include "vec_half.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace tidal_cpu;

constexpr int kMaxGroup = 16;  // query heads per KV head handled in registers

template <typename CT>
inline float dot(const float* a, const CT* b, int64_t n) {
  vec16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load(a + i) * load(b + i);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// r[i] = the sum of p[i]'s 16 lanes, for 16 vectors at once: four levels of pairwise
// shuffles and adds, 15 combines for 16 sums.
inline vec16 lane_sums(vec16 p[16]) {
  typedef int32_t ivec16 __attribute__((vector_size(64)));
  vec16 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)
    c[k] = __builtin_shuffle(p[2 * k], p[2 * k + 1],
                             ivec16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(p[2 * k], p[2 * k + 1],
                             ivec16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int k = 0; k < 4; ++k)
    d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1],
                             ivec16{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(c[2 * k], c[2 * k + 1],
                             ivec16{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int k = 0; k < 2; ++k)
    e[k] = __builtin_shuffle(d[2 * k], d[2 * k + 1],
                             ivec16{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(d[2 * k], d[2 * k + 1],
                             ivec16{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(e[0], e[1],
                           ivec16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(e[0], e[1],
                           ivec16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

// a[0..3] += p * v[0..63], v float32 or 16-bit (widened as it is read).
template <typename T>
inline void add_scaled_row64(vec16 a[4], vec16 p, const T* v) {
  for (int u = 0; u < 4; ++u) a[u] += p * load(v + 16 * u);
}

// A bf16 cache read as 32-bit words: a row's values 32 at a time as their even and odd
// elements (widen_bf16_pairs: a shift and a mask, no widened copy), so the products and
// sums stay float32 while nothing is written back. Queries and outputs use the same
// split: chunk c of a row holds 16 even then 16 odd elements (`split_pairs`).
inline void split_pairs(const float* x, float* out, int64_t dh) {
  for (int64_t c = 0; c < dh; c += 32)
    for (int l = 0; l < 16; ++l) {
      out[c + l] = x[c + 2 * l];
      out[c + 16 + l] = x[c + 2 * l + 1];
    }
}

// scores[i] = q . k_i for the m <= 16 keys `keys` (bf16 rows of dh = 32 C values), q
// split as split_pairs does: each key's products across the lanes, then one transposing
// add tree for all 16.
template <int C>
inline vec16 pair_scores(const float* q, const uint16_t* const* keys, int64_t m) {
  vec16 qe[C], qo[C];
  for (int c = 0; c < C; ++c) {
    qe[c] = load(q + 32 * c);
    qo[c] = load(q + 32 * c + 16);
  }
  vec16 part[16];
  for (int i = 0; i < 16; ++i) {
    if (i >= m) {
      part[i] = vec16{};
      continue;
    }
    vec16 e, o;
    widen_bf16_pairs(keys[i], e, o);
    vec16 a = qe[0] * e + qo[0] * o;
    for (int c = 1; c < C; ++c) {
      widen_bf16_pairs(keys[i] + 32 * c, e, o);
      a += qe[c] * e + qo[c] * o;
    }
    part[i] = a;
  }
  return lane_sums(part);
}

// out[g] = sum_t p[g][t] * v_t over n keys for G heads at once (p[g] = probs + g * stride),
// v_t bf16 rows of dh = 32 C values: each V row split once for all G heads, the sums in
// registers (G * C * 2 <= 16 of them), the keys in order; out in split_pairs' layout.
template <int C, int G>
inline void pair_values(const float* probs, int64_t stride, const uint16_t* const* vrows,
                        int64_t n, float* out) {
  vec16 acc[G][C][2] = {};
  for (int64_t t = 0; t < n; ++t) {
    vec16 e[C], o[C];
    for (int c = 0; c < C; ++c) widen_bf16_pairs(vrows[t] + 32 * c, e[c], o[c]);
    for (int g = 0; g < G; ++g) {
      const vec16 p = splat(probs[g * stride + t]);
      for (int c = 0; c < C; ++c) {
        acc[g][c][0] += p * e[c];
        acc[g][c][1] += p * o[c];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      store(out + g * 32 * C + 32 * c, acc[g][c][0]);
      store(out + g * 32 * C + 32 * c + 16, acc[g][c][1]);
    }
}

// split_pairs undone: a row of dh values in its natural order.
inline void join_pairs(const float* x, float* out, int64_t dh) {
  for (int64_t c = 0; c < dh; c += 32)
    for (int l = 0; l < 16; ++l) {
      out[c + 2 * l] = x[c + l];
      out[c + 2 * l + 1] = x[c + 16 + l];
    }
}

// One task's K and V cache lines, in key order, prefetched a few at a time: `issue(k)`
// asks for the next k lines of K and the matching k of V. A task's rows sit in a few
// scattered blocks, cold at decode (the MoE weights streamed through since the last
// step), and the kernel waits on their misses unless they are in flight before it reads
// them: a thread asks for the next task's lines a chunk at a time while it computes the
// current one, so the two overlap (at 32 sequences of 256 keys, bf16, cold: asking only
// at the start of each task for its own lines left the kernel at a third of the read
// bandwidth).
template <typename CT>
class TaskLines {
 public:
  static constexpr int64_t kLine = 64 / sizeof(CT);  // cache values per 64-byte line

  TaskLines() = default;
  TaskLines(const CT* kc, const CT* vc, const int64_t* blocks, int64_t hkv, int64_t kvh,
            int64_t bs, int64_t dh, int64_t first, int64_t len)
      : kc_(kc), vc_(vc), blocks_(blocks), hkv_(hkv), kvh_(kvh), bs_(bs), dh_(dh), len_(len),
        b_(first / bs), lo_(first % bs) {
    for (int64_t b = b_, lo = lo_; b * bs < len; ++b, lo = 0)
      lines_ += ((std::min<int64_t>(bs, len - b * bs) - lo) * dh + kLine - 1) / kLine;
    open();
  }

  int64_t lines() const { return lines_; }  // of K (and as many of V)

  void issue(int64_t count) {
    for (; count > 0 && b_ * bs_ < len_; --count) {
      __builtin_prefetch(kc_ + row_ + f_, 0, 2);
      __builtin_prefetch(vc_ + row_ + f_, 0, 2);
      if ((f_ += kLine) >= values_) {
        ++b_;
        lo_ = 0;
        open();
      }
    }
  }

 private:
  void open() {  // the current block's run: its first row and how many values
    f_ = 0;
    if (b_ * bs_ >= len_) return;
    row_ = ((blocks_[b_] * hkv_ + kvh_) * bs_ + lo_) * dh_;
    values_ = (std::min<int64_t>(bs_, len_ - b_ * bs_) - lo_) * dh_;
  }

  const CT* kc_ = nullptr;
  const CT* vc_ = nullptr;
  const int64_t* blocks_ = nullptr;
  int64_t hkv_ = 0, kvh_ = 0, bs_ = 1, dh_ = 0, len_ = 0;
  int64_t b_ = 0, lo_ = 0, row_ = 0, values_ = 0, f_ = 0, lines_ = 0;
};

// QT: the query and output type, CT: the cache's (float, c10::BFloat16, c10::Half each).
// Queries are widened once per task and the cache 16 values at a time as it is read:
// scores, softmax and the weighted sum of V are float32 throughout.
template <typename QT, typename CT>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& cache, const int64_t* tp,
                           const int64_t* lp, int64_t width, const at::Tensor& out, float sc,
                           int64_t window, const float* sinks) {
  const int64_t num = q.size(0), hq = q.size(1), dh = q.size(2);
  const int64_t nb = cache.size(1), hkv = cache.size(2), bs = cache.size(3);
  const QT* qp = q.data_ptr<QT>();
  const CT* kc = cache.data_ptr<CT>();
  const CT* vc = kc + nb * hkv * bs * dh;
  QT* op = out.data_ptr<QT>();
  const int64_t group = hq / hkv, qs0 = q.stride(0), qs1 = q.stride(1);
  // A window keeps the last ``window`` keys: positions first .. len - 1.
  auto first_key = [&](int64_t len) {
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
  };
  auto lines_of = [&](int64_t task) {
    const int64_t d = task / hkv, len = lp[d];
    return TaskLines<CT>(kc, vc, tp + d * width, hkv, task % hkv, bs, dh, first_key(len), len);
  };

  // One (sequence, KV head) task; `ahead`: the next task's lines, asked for as it goes.
  auto run = [&](int64_t task, TaskLines<CT>& ahead) {
    const int64_t d = task / hkv, kvh = task % hkv, len = lp[d];
    const int64_t first = first_key(len), n = len - first;
    const int64_t* blocks = tp + d * width;
    thread_local std::vector<float> scores, qbuf, obuf, kvbuf, acc, qpair;
    thread_local std::vector<const CT*> krow, vrow;
    scores.resize(static_cast<size_t>(group * n));
    krow.resize(static_cast<size_t>(n));
    vrow.resize(static_cast<size_t>(n));
    // Each key's K and V row, walked block by block: the per-key block / offset division
    // (by a runtime block size, once per key and query head) cost more than the dot
    // products at 32 sequences.
    for (int64_t i = 0, b = first / bs, off = first % bs; i < n; ++i) {
      const int64_t row = ((blocks[b] * hkv + kvh) * bs + off) * dh;
      krow[i] = kc + row;
      vrow[i] = vc + row;
      if (++off == bs) {
        off = 0;
        ++b;
      }
    }
    qbuf.resize(static_cast<size_t>(group * dh));
    obuf.resize(static_cast<size_t>(dh));
    const float* qg[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) {
      const QT* row = qp + d * qs0 + (kvh * group + g) * qs1;
      if constexpr (std::is_same_v<QT, float>) {
        qg[g] = row;  // read in place
      } else {
        to_float(row, qbuf.data() + g * dh, dh);
        qg[g] = qbuf.data() + g * dh;
      }
    }
    // The next task's lines, spread over this one's chunks of 16 keys (phase 1).
    const int64_t chunks = std::max<int64_t>(1, (n + 15) / 16);
    const int64_t per_chunk = (ahead.lines() + chunks - 1) / chunks;
    // 1. scores[g][t] = q_g . k_t * scale: 16 keys at a time, each key's products summed
    //    across lanes by one transposing add tree (instead of a horizontal sum per key).
    //    A 16-bit cache's 16 K rows are widened once into kvbuf for all the group's query
    //    heads (widening them once a head cost more than the products: at 32 sequences,
    //    context 256, bf16, GQA 4, it took 1.15 ms a layer).
    //    A bf16 cache of 64 or 128 values a head is read in pairs instead (pair_scores):
    //    no widened copy.
    constexpr bool kBf16 = std::is_same_v<CT, c10::BFloat16>;
    const bool pairs = kBf16 && (dh == 64 || dh == 128);
    if (pairs) {
      qpair.resize(static_cast<size_t>(group * dh));
      for (int64_t g = 0; g < group; ++g) split_pairs(qg[g], qpair.data() + g * dh, dh);
      const uint16_t* keys[16];
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - t0);
        ahead.issue(per_chunk);
        for (int64_t i = 0; i < m; ++i) keys[i] = reinterpret_cast<const uint16_t*>(krow[t0 + i]);
        for (int64_t g = 0; g < group; ++g) {
          const float* q = qpair.data() + g * dh;
          const vec16 sums = (dh == 64 ? pair_scores<2>(q, keys, m) : pair_scores<4>(q, keys, m)) *
                             splat(sc);
          float* dst = scores.data() + g * n + t0;
          if (m == 16) {
            store(dst, sums);
          } else {
            for (int64_t i = 0; i < m; ++i) dst[i] = sums[i];
          }
        }
      }
    } else {
      const bool whole = dh % 16 == 0;  // rows of whole vectors: the transposing add tree
      kvbuf.resize(static_cast<size_t>(16 * dh));
      const CT* keys[16];
      for (int64_t t0 = 0; t0 < n; t0 += 16) {  // t0: index among the n keys
        const int64_t m = std::min<int64_t>(16, n - t0);
        ahead.issue(per_chunk);
        for (int64_t i = 0; i < m; ++i) keys[i] = krow[t0 + i];
        if (m < 16 || !whole) {
          for (int64_t g = 0; g < group; ++g)
            for (int64_t i = 0; i < m; ++i) scores[g * n + t0 + i] = dot(qg[g], keys[i], dh) * sc;
          continue;
        }
        const float* kf[16];
        for (int i = 0; i < 16; ++i) {
          if constexpr (std::is_same_v<CT, float>) {
            kf[i] = keys[i];
          } else {
            to_float(keys[i], kvbuf.data() + i * dh, dh);
            kf[i] = kvbuf.data() + i * dh;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          // Column chunk outer, key inner: the 16 keys' sums are 16 independent chains (a
          // key's own chain of Dh / 16 multiply-adds, one after another, waited on each
          // add's latency: at Dh 64 it bound the whole kernel).
          vec16 part[16];
          const vec16 q0 = load(qg[g]);
          for (int i = 0; i < 16; ++i) part[i] = q0 * load(kf[i]);
          for (int64_t j = 16; j < dh; j += 16) {
            const vec16 qj = load(qg[g] + j);
            for (int i = 0; i < 16; ++i) part[i] += qj * load(kf[i] + j);
          }
          store(scores.data() + g * n + t0, lane_sums(part) * splat(sc));
        }
      }
    }
    // 2. softmax per query head: max, exp(s - max), divide by the sum. A sink is one more
    //    logit with no value: it joins the max and adds exp(sink - max) to the sum.
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * n;
      const float sink = sinks ? sinks[kvh * group + g] : 0.f;
      float m = sinks ? sink : -std::numeric_limits<float>::infinity();
      int64_t u = 0;
      if (n >= 16) {  // 16 lanes of maxima, then across them (a NaN is skipped, as below)
        vec16 mv = splat(m);
        for (; u + 16 <= n; u += 16) {
          const vec16 x = load(s + u);
          mv = x > mv ? x : mv;
        }
        for (int l = 0; l < 16; ++l) m = std::max(m, mv[l]);
      }
      for (; u < n; ++u) m = std::max(m, s[u]);
      float sum = sinks ? std::exp(sink - m) : 0.f;
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        const vec16 e = vexp(load(s + t) - splat(m));
        store(s + t, e);
        for (int l = 0; l < 16; ++l) sum += e[l];
      }
      for (; t < n; ++t) {
        s[t] = std::exp(s[t] - m);
        sum += s[t];
      }
      const float inv = 1.f / sum;
      for (t = 0; t < n; ++t) s[t] *= inv;
    }
    // 3. out_g = sum_t p[g][t] * v_t. A 16-bit cache, head size a multiple of 64: 16 V
    //    rows at a time widened once into kvbuf for all the group's heads, each head's
    //    sums in acc between chunks, 64 columns at a time in registers (the keys in order:
    //    the sums as the loop below makes them).
    if (pairs) {
      // Heads G at a time (G * dh / 16 sums in registers), each V row split once for them.
      acc.resize(static_cast<size_t>(group * dh));
      const uint16_t* const* vr = reinterpret_cast<const uint16_t* const*>(vrow.data());
      for (int64_t g = 0; g < group;) {
        const float* pg = scores.data() + g * n;
        float* o = acc.data() + g * dh;
        const int64_t left = group - g;
        if (dh == 64 && left >= 4) {
          pair_values<2, 4>(pg, n, vr, n, o);
          g += 4;
        } else if (dh == 64 && left >= 2) {
          pair_values<2, 2>(pg, n, vr, n, o);
          g += 2;
        } else if (dh == 64) {
          pair_values<2, 1>(pg, n, vr, n, o);
          g += 1;
        } else if (left >= 2) {
          pair_values<4, 2>(pg, n, vr, n, o);
          g += 2;
        } else {
          pair_values<4, 1>(pg, n, vr, n, o);
          g += 1;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        join_pairs(acc.data() + g * dh, obuf.data(), dh);
        convert_row(obuf.data(), op + (d * hq + kvh * group + g) * dh, dh);
      }
      return;
    }
    if (dh % 64 == 0 && !std::is_same_v<CT, float>) {
      acc.assign(static_cast<size_t>(group * dh), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - t0);
        for (int64_t i = 0; i < m; ++i) to_float(vrow[t0 + i], kvbuf.data() + i * dh, dh);
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = scores.data() + g * n + t0;
          for (int64_t c = 0; c < dh; c += 64) {
            float* o = acc.data() + g * dh + c;
            vec16 a[4] = {load(o), load(o + 16), load(o + 32), load(o + 48)};
            for (int64_t i = 0; i < m; ++i)
              add_scaled_row64(a, splat(pg[i]), kvbuf.data() + i * dh + c);
            for (int u = 0; u < 4; ++u) store(o + 16 * u, a[u]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        convert_row(acc.data() + g * dh, op + (d * hq + kvh * group + g) * dh, dh);
      return;
    }
    // Otherwise one query head at a time in registers (a float output row is written in
    // place, a 16-bit one through obuf).
    for (int64_t g = 0; g < group; ++g) {
      QT* dst = op + (d * hq + kvh * group + g) * dh;
      float* o;
      if constexpr (std::is_same_v<QT, float>) {
        o = dst;
      } else {
        o = obuf.data();
      }
      const float* pg = scores.data() + g * n;  // pg[i]: key first + i
      if (dh == 64) {
        vec16 a[4] = {};
        for (int64_t i = 0; i < n; ++i) add_scaled_row64(a, splat(pg[i]), vrow[i]);
        for (int u = 0; u < 4; ++u) store(o + 16 * u, a[u]);
      } else {
        std::fill(o, o + dh, 0.f);
        for (int64_t k = 0; k < n; ++k) {
          const CT* v = vrow[k];
          const float p = pg[k];
          int64_t i = 0;
          for (; i + 16 <= dh; i += 16) store(o + i, load(o + i) + splat(p) * load(v + i));
          for (; i < dh; ++i) o[i] += p * static_cast<float>(v[i]);
        }
      }
      if constexpr (!std::is_same_v<QT, float>) convert_row(o, dst, dh);
    }
  };

  // A thread asks for its next task's lines while it computes the current one; its first
  // task's lines it asks for at once.
  const int64_t tasks = num * hkv;
  for_each_task_ahead(
      tasks,
      [&](int64_t first) {
        TaskLines<CT> now = lines_of(first);
        now.issue(now.lines());
      },
      [&](int64_t cur, int64_t next) {
        TaskLines<CT> ahead = next < tasks ? lines_of(next) : TaskLines<CT>();
        run(cur, ahead);
        ahead.issue(ahead.lines());  // what the chunks left (a short task)
      });
}

}  // namespace

at::Tensor tidal_cpu::decode_attention(
    const at::Tensor& q,            // [D, Hq, Dh] float32/bf16/fp16
    const at::Tensor& cache,        // [2, NB, Hkv, bs, Dh] same types
    const at::Tensor& block_table,  // [D, B] int64
    const at::Tensor& seq_lens,     // [D] int64
    double scale,
    int64_t window,                 // > 0: the last window keys
    const std::optional<at::Tensor>& sinks) {  // [Hq] float32
  TORCH_CHECK(q.is_cpu() && is_kernel_float(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1,
              "decode_attention: q must be a float32/bfloat16/float16 [D, Hq, Dh] tensor, "
              "last dim contiguous");
  TORCH_CHECK(cache.is_cpu() && is_kernel_float(cache.scalar_type()) && cache.dim() == 5 &&
                  cache.size(0) == 2 && cache.is_contiguous() && cache.size(4) == q.size(2),
              "decode_attention: cache must be a contiguous float32/bfloat16/float16 "
              "[2, NB, Hkv, bs, Dh]");
  const int64_t num = q.size(0), hq = q.size(1), dh = q.size(2);
  const int64_t nb = cache.size(1), hkv = cache.size(2), bs = cache.size(3);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= kMaxGroup,
              "decode_attention: Hq must be a multiple of Hkv, at most 16 per KV head");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.size(0) == num && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == num,
              "decode_attention: block_table [D, B] and seq_lens [D] must be int64");
  auto table = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t width = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t d = 0; d < num; ++d) {
    TORCH_CHECK(lp[d] >= 1 && lp[d] <= width * bs,
                "decode_attention: a sequence length is outside its block table");
    for (int64_t b = 0; b < (lp[d] + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[d * width + b] >= 0 && tp[d * width + b] < nb,
                  "decode_attention: a block id is outside the cache");
  }
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0 (0: none)");
  at::Tensor sk;
  if (sinks.has_value()) {
    sk = sinks->contiguous();
    TORCH_CHECK(sk.is_cpu() && sk.scalar_type() == at::kFloat && sk.dim() == 1 &&
                    sk.size(0) == hq,
                "decode_attention: sinks must be a float32 [Hq] tensor");
  }
  auto out = at::empty({num, hq, dh}, q.options());
  if (num == 0) return out;
  const float sc = static_cast<float>(scale);
  const float* sp = sk.defined() ? sk.data_ptr<float>() : nullptr;
  with_float_type(q.scalar_type(), [&](auto qt) {
    with_float_type(cache.scalar_type(), [&](auto ct) {
      decode_attention_impl<decltype(qt), decltype(ct)>(q, cache, tp, lp, width, out, sc, window,
                                                        sp);
    });
  });
  return out;
}

namespace {

// write_kv: this step's K and V rows into the cache, at the tokens' slots, cast
// to the cache's type (round to nearest even, as torch's .to()).
// The destinations are scattered and cold (a 4 KB run per block): ask for all their lines
// first, with write intent, so the misses overlap; index_copy_ takes them one at a time
// (~36 us for 128 rows of the 1024-wide model against ~5 hot).
template <typename CT, typename ST>
void write_rows(CT* dst, const int64_t* rows, const at::Tensor& src, int64_t dh) {
  const int64_t num = src.size(0), heads = src.size(1), s0 = src.stride(0), s1 = src.stride(1);
  const ST* sp = src.data_ptr<ST>();
  constexpr int64_t kLine = 64 / sizeof(CT);
  for (int64_t i = 0; i < num * heads; ++i)
    for (int64_t f = 0; f < dh; f += kLine) __builtin_prefetch(dst + rows[i] * dh + f, 1, 3);
  for (int64_t t = 0; t < num; ++t)
    for (int64_t h = 0; h < heads; ++h)
      convert_row(sp + t * s0 + h * s1, dst + rows[t * heads + h] * dh, dh);
}

}  // namespace

void tidal_cpu::write_kv(
    const at::Tensor& cache,  // [2, NB, Hkv, bs, Dh] float32/bf16/fp16, written
    const at::Tensor& slots,  // [T] int64 cache slot (block * bs + offset) per token
    const at::Tensor& k,      // [T, Hkv, Dh] float32/bf16/fp16, last dim contiguous
    const at::Tensor& v) {    // [T, Hkv, Dh], k's type
  TORCH_CHECK(cache.is_cpu() && is_kernel_float(cache.scalar_type()) && cache.dim() == 5 &&
                  cache.is_contiguous(),
              "write_kv: cache must be a contiguous float32/bfloat16/float16 [2, NB, Hkv, bs, Dh]");
  const int64_t nb = cache.size(1), hkv = cache.size(2), bs = cache.size(3), dh = cache.size(4);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(is_kernel_float(t->scalar_type()) && t->scalar_type() == k.scalar_type() &&
                    t->dim() == 3 && t->size(1) == hkv && t->size(2) == dh &&
                    t->stride(2) == 1 && t->sizes() == k.sizes(),
                "write_kv: k and v must be float32/bfloat16/float16 [T, Hkv, Dh] of one "
                "type, the cache's Hkv and Dh, last dim contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: slots must be int64 [T]");
  // Rows of cache.view(-1, Dh): K of (slot s, head h) at ((s / bs) * Hkv + h) * bs + s % bs,
  // V the same row past all K rows. Built here, not by a chain of tensor ops per step.
  const int64_t num = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<int64_t> rows_k(static_cast<size_t>(num * hkv)), rows_v(rows_k.size());
  for (int64_t t = 0; t < num; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nb * bs, "write_kv: a slot is outside the cache");
    const int64_t block = sp[t] / bs, offset = sp[t] % bs;
    for (int64_t h = 0; h < hkv; ++h) {
      rows_k[t * hkv + h] = (block * hkv + h) * bs + offset;
      rows_v[t * hkv + h] = rows_k[t * hkv + h] + nb * hkv * bs;
    }
  }
  with_float_type(cache.scalar_type(), [&](auto ct) {
    with_float_type(k.scalar_type(), [&](auto st) {
      using CT = decltype(ct);
      using ST = decltype(st);
      CT* dst = cache.data_ptr<CT>();
      write_rows<CT, ST>(dst, rows_k.data(), k, dh);
      write_rows<CT, ST>(dst, rows_v.data(), v, dh);
    });
  });
}

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, "
      "float scale, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("write_kv(Tensor(a!) cache, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(tidal_cpu, CPU, m) {
  m.impl("decode_attention", &tidal_cpu::decode_attention);
  m.impl("write_kv", &tidal_cpu::write_kv);
}
