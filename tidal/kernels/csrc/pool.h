// The threads the CPU kernels split their work over: torch's OpenMP pool, or the kernels'
// own spin pool (pool_cpu.cpp), chosen per process (set_spin_pool).
//
// Why a pool of our own: an engine process beside its frontend runs OpenMP with a short
// spin (tidal/utils/cpu_threads.py: a long one starves the frontend between steps), so its
// worker threads fall asleep in the few microseconds of Python between two kernels of a
// forward, and every kernel pays a futex wake-up (on a VM, an IPI to a halted vCPU). A
// batch-1 decode step of the 8-layer FP8 checkpoint opens ~40 regions: the wake-ups cost it
// ~1.3 ms of 5.8. The spin pool's workers spin for a window after their last job (long
// enough to bridge the gaps inside a forward, short enough to leave the cores to the
// frontend between steps), then sleep; the OpenMP runtime's spin cannot change at run time.
#pragma once

#include <c10/util/FunctionRef.h>

#include <cstdint>

namespace tidal_cpu {

// Calls body(i) for every i in [0, n), each on its own thread (the caller runs i = 0), and
// returns when all have returned; an exception from any is rethrown here. Nested calls (from
// inside a body) and calls while another thread holds the pool run inline, in order.
void parallel_threads(int64_t n, c10::function_ref<void(int64_t)> body);

// The spin pool on (spin_us > 0: its workers' spin window after a job, microseconds) or off
// (0: torch's OpenMP pool, the default).
void set_spin_pool(int64_t spin_us);

}  // namespace tidal_cpu
