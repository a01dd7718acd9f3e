// The CPU kernels' spin pool (pool.h): worker threads that spin for a window after the
// last job they took part in, then sleep, each on a condition variable of its own.
//
// Handshake (the caller publishes a job, its parts' workers take it):
//   caller: body, remaining = n - 1, then ticket = (generation + 1, n)     [seq_cst]
//           then for each worker i < n: if i is asleep [seq_cst load], lock i's mutex,
//           unlock, notify it
//   worker i: spins until a ticket with i < n; past its window: lock its mutex,
//           asleep = true [seq_cst], wait until such a ticket (re-checked under the lock)
// The two seq_cst pairs are a Dekker handshake: either the caller sees the worker asleep
// and wakes it (the mutex orders its notify after the worker's wait began), or the worker
// sees the new ticket before it sleeps. A worker whose index is >= n neither wakes nor
// restarts its window for the job (after torch.set_num_threads lowers the count, the
// workers past it sleep). A worker taking part decrements `remaining` when its body
// returns, and the caller spins until it is 0, so the next job cannot be published before
// every part of this one has run.

#include "pool.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace tidal_cpu {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local bool in_job = false;  // a pool worker, or the caller inside its own part

constexpr uint64_t kPartsMask = 0xFFFF;  // ticket = generation << 16 | parts

// One worker's sleep: its own mutex and condition, so a job wakes only its parts.
struct Slot {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> asleep{false};
};

struct Pool {
  std::mutex run_mu;                       // one caller at a time
  std::atomic<uint64_t> ticket{0};
  std::atomic<int64_t> remaining{0};       // parts of the current job still running
  const c10::function_ref<void(int64_t)>* body = nullptr;  // valid while remaining > 0
  std::vector<std::unique_ptr<Slot>> slots;  // slots[i - 1]: worker i's; grown under run_mu
  std::atomic<int64_t> workers{0};           // slots.size(), for readers without run_mu
  std::atomic<int64_t> spin_ns{0};         // 0: off (OpenMP serves)
  std::mutex error_mu;
  std::exception_ptr error;

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(error_mu);
    if (!error) error = e;
  }

  // The next ticket (after `seen`) that worker `index` takes part in, spinning for spin_ns
  // from the call (its last job's end), then sleeping.
  uint64_t wait_job(Slot& slot, int64_t index, uint64_t seen) {
    const auto mine = [&](uint64_t t) {
      return t != seen && index < static_cast<int64_t>(t & kPartsMask);
    };
    const auto start = Clock::now();
    for (uint32_t spins = 1;; ++spins) {
      const uint64_t t = ticket.load(std::memory_order_acquire);
      if (mine(t)) return t;
      cpu_relax();
      if ((spins & 63) != 0) continue;
      // More threads than cores: a runnable thread waiting for this core gets it.
      if ((spins & 1023) == 0) std::this_thread::yield();
      const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
      if (waited.count() < spin_ns.load(std::memory_order_relaxed)) continue;
      std::unique_lock<std::mutex> lock(slot.mu);
      slot.asleep.store(true, std::memory_order_seq_cst);
      slot.cv.wait(lock, [&] { return mine(ticket.load(std::memory_order_seq_cst)); });
      slot.asleep.store(false, std::memory_order_relaxed);
    }
  }

  void work(Slot* slot, int64_t index, uint64_t seen) {
    in_job = true;
    const c10::ParallelGuard in_region(true);  // an ATen op inside a part runs inline
#ifdef __linux__
    const std::string name = "tidal-cpu-" + std::to_string(index);  // tests find them by it
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#endif
    for (;;) {
      seen = wait_job(*slot, index, seen);
      try {
        (*body)(index);
      } catch (...) {
        fail(std::current_exception());
      }
      remaining.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Under run_mu. Workers are detached and never end (a leaked pool's threads sleep).
  // A slot joins only once its thread runs: a failed start (EAGAIN at a thread limit)
  // throws out of the kernel and leaves the pool as it was.
  void grow(int64_t needed) {
    while (static_cast<int64_t>(slots.size()) < needed) {
      auto slot = std::make_unique<Slot>();
      Slot* raw = slot.get();
      const int64_t index = static_cast<int64_t>(slots.size()) + 1;
      const uint64_t seen = ticket.load(std::memory_order_relaxed);
      std::thread([this, raw, index, seen] { work(raw, index, seen); }).detach();
      slots.push_back(std::move(slot));
      workers.store(static_cast<int64_t>(slots.size()), std::memory_order_relaxed);
    }
  }

  void run(int64_t n, const c10::function_ref<void(int64_t)>& job) {
    std::lock_guard<std::mutex> guard(run_mu, std::adopt_lock);  // taken by the caller
    grow(n - 1);
    body = &job;
    error = nullptr;
    remaining.store(n - 1, std::memory_order_relaxed);
    const uint64_t next = (((ticket.load(std::memory_order_relaxed) >> 16) + 1) << 16) |
                          static_cast<uint64_t>(n);
    ticket.store(next, std::memory_order_seq_cst);
    for (int64_t i = 0; i < n - 1; ++i) {
      Slot& slot = *slots[i];
      if (slot.asleep.load(std::memory_order_seq_cst)) {
        { std::lock_guard<std::mutex> lock(slot.mu); }
        slot.cv.notify_one();
      }
    }
    in_job = true;
    try {
      const c10::ParallelGuard in_region(true);
      job(0);
    } catch (...) {
      fail(std::current_exception());
    }
    in_job = false;
    for (uint32_t spins = 1; remaining.load(std::memory_order_acquire) != 0; ++spins) {
      cpu_relax();
      if ((spins & 1023) == 0) std::this_thread::yield();  // a part preempted: let it run
    }
    if (error) {
      std::exception_ptr e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
  }
};

// Leaked: detached workers may still read it at exit. A forked child (whose copy has no
// threads, and maybe a held mutex) starts a new one with the same setting.
Pool* pool = nullptr;
std::once_flag pool_once;

Pool& the_pool() {
  std::call_once(pool_once, [] {
    pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] {
      Pool* fresh = new Pool();
      fresh->spin_ns.store(pool->spin_ns.load());
      pool = fresh;
      in_job = false;
    });
  });
  return *pool;
}

}  // namespace

void parallel_threads(int64_t n, c10::function_ref<void(int64_t)> body) {
  if (n <= 0) return;
  Pool& p = the_pool();
  if (p.spin_ns.load(std::memory_order_relaxed) == 0) {  // off: torch's OpenMP pool
    at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) body(i);
    });
    return;
  }
  if (n == 1 || in_job || static_cast<uint64_t>(n) > kPartsMask || !p.run_mu.try_lock()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  p.run(n, body);
}

void set_spin_pool(int64_t spin_us) {
  TORCH_CHECK(spin_us >= 0 && spin_us <= 1000000, "set_spin_pool: spin_us must be in [0, 1e6]");
  the_pool().spin_ns.store(spin_us * 1000);
}

namespace {

// (spin window in microseconds, 0 when off; worker threads started)
std::tuple<int64_t, int64_t> spin_pool_state() {
  Pool& p = the_pool();
  return {p.spin_ns.load() / 1000, p.workers.load()};
}

}  // namespace
}  // namespace tidal_cpu

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("set_spin_pool(int spin_us) -> ()", &tidal_cpu::set_spin_pool);
  m.def("spin_pool_state() -> (int, int)", &tidal_cpu::spin_pool_state);
}
