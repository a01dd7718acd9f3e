// Shared by the CPU kernels: 16-lane float vectors (GCC vector extensions, which the
// compiler maps to the build machine's ISA: one AVX-512 register, two AVX2 ones), a
// vectorised exp, and task scheduling on the kernels' threads (pool.h).
#pragma once

#include "pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tidal_cpu {

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

inline vec16 splat(float v) { return vec16{} + v; }

inline vec16 load(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp on 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial
// (~1 ulp on the range SiLU needs); clamped so 2^n stays a normal float.
inline vec16 vexp(vec16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  vec16 n = x * splat(1.44269504088896341f);
  ivec16 ni = __builtin_convertvector(n + (n < splat(0.f) ? splat(-0.5f) : splat(0.5f)), ivec16);
  vec16 nf = __builtin_convertvector(ni, vec16);
  vec16 r = x - nf * splat(0.693145751953125f);
  r = r - nf * splat(1.428606765330187045e-06f);
  vec16 p = splat(1.f / 5040) * r + splat(1.f / 720);
  p = p * r + splat(1.f / 120);
  p = p * r + splat(1.f / 24);
  p = p * r + splat(1.f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  ivec16 bits = (ni + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Runs task(i) for i in [0, n) on the kernels' threads, each thread taking the next task.
template <typename F>
void for_each_task(int64_t n, F&& task) {
  std::atomic<int64_t> next{0};
  parallel_threads(std::min<int64_t>(at::get_num_threads(), n), [&](int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) task(i);
  });
}

// for_each_task with one task of look-ahead: each thread claims its next task before it
// runs the current one, so a task can ask for the next one's memory while it computes.
// first(i) once for each thread's first task, then task(i, next) for each i, next the
// thread's following task (n: none).
template <typename First, typename F>
void for_each_task_ahead(int64_t n, First&& first, F&& task) {
  std::atomic<int64_t> next{0};
  parallel_threads(std::min<int64_t>(at::get_num_threads(), n), [&](int64_t) {
    int64_t cur = next.fetch_add(1);
    if (cur < n) first(cur);
    while (cur < n) {
      const int64_t after = std::min<int64_t>(next.fetch_add(1), n);
      task(cur, after);
      cur = after;
    }
  });
}

// at::parallel_for's contract on the kernels' threads: body(begin, end) over [0, n) in
// contiguous chunks, one a thread, on at most ceil(n / grain) threads (one chunk, inline,
// at n <= grain).
template <typename F>
void for_each_range(int64_t n, int64_t grain, F&& body) {
  if (n <= 0) return;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain));
  if (threads == 1) {
    body(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  parallel_threads(threads, [&](int64_t i) {
    const int64_t begin = i * chunk, end = std::min(n, begin + chunk);
    if (begin < end) body(begin, end);
  });
}

// Splits [0, n) into contiguous runs of about equal total cost[i] (cost[i] >= 0), one a
// thread, and calls run(lo, hi) once per non-empty run on the kernels' threads. The same task
// list always lands on the same cores, so weight blocks a core read last call are still in
// its L2; a dynamic queue scatters them (tiny MoE layer at 1 token, weights cached: 26 ->
// 19 us).
template <typename F>
void for_each_run_static(const std::vector<double>& cost, F&& run) {
  const int64_t n = static_cast<int64_t>(cost.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bound(threads + 1, n);
  bound[0] = 0;
  double total = 0;
  for (double c : cost) total += c;
  double sum = 0;
  int64_t t = 1;
  for (int64_t i = 0; i < n && t < threads; ++i) {
    sum += cost[i];
    while (t < threads && sum >= total * t / threads) bound[t++] = i + 1;  // run t-1 is full
  }
  parallel_threads(threads, [&](int64_t r) {
    if (bound[r] < bound[r + 1]) run(bound[r], bound[r + 1]);
  });
}

// for_each_run_static's runs, task(i) for each i of a run in order.
template <typename F>
void for_each_task_static(const std::vector<double>& cost, F&& task) {
  for_each_run_static(cost, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) task(i);
  });
}

}  // namespace tidal_cpu
