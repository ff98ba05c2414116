// Running a job on XLA's CPU thread pool, shared by the CPU kernels.
//
// A job holds its work items and two counters: the threads take items from
// it until none are left, and `done` counts the items finished. The calling
// thread works too, then waits for the items other threads still hold. The
// job is held by shared_ptr: a task the pool starts late finds nothing left
// and touches nothing freed.
//
// How many threads: Workers(pool), the caller included, as XLA itself counts
// them (an XLA operation on a pool of N threads runs on N: the executing
// thread and N - 1 of the pool's; with N = 1 XLA runs it on the executing
// thread alone), capped by the CPUs in this process's affinity mask. XLA
// sizes the pool to the usable CPUs (jaxserve/engine/cpu_threads.py), so a
// kernel never has more runnable threads than cores.
//
// How the caller waits: it spins for a few microseconds (the last item is
// usually nearly done), then blocks on a condition variable that the helper
// finishing the last item signals. It used to spin with sched_yield until the
// helpers were done. On two CPUs, when the helper holding the last item has
// been preempted on the other core (by the engine's Python thread, the
// worker's event loop, another process), a spinning caller keeps its own core
// busy, so the kernel cannot move the helper there: it waits out the other
// thread's time slice (milliseconds). A blocked caller leaves its core idle,
// and the idle core pulls the helper over at once. sched_yield only hands the
// core to threads queued on the same one. On a loaded two-CPU machine the old
// wait made 3.4 sched_yield calls per 1408x512x16 matvec; this one makes none
// (benchmarks/swing_probe.py measures the engine as a whole).

#ifndef JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_
#define JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu {

// How long the caller spins before it blocks.
inline constexpr std::chrono::microseconds kSpinBeforeBlocking{20};

// The CPUs this process may run on (sched_getaffinity), read once: at least 1.
inline int64_t AllowedCpus() {
  static const int64_t cpus = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return int64_t{1};
    return std::max<int64_t>(1, CPU_COUNT(&set));
  }();
  return cpus;
}

// The threads a job on `pool` should run on, the caller included: the pool's
// size, at most the allowed CPUs, at least 1.
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), AllowedCpus()));
}

// A job's Run() for work split into `items` independent items: take them one
// at a time from job.next, run job.RunItem(item), count them into job.done.
template <class Job>
void RunItems(Job& job, int64_t items) {
  int64_t finished = 0;
  for (int64_t item; (item = job.next.fetch_add(1)) < items; ++finished) job.RunItem(item);
  job.done.fetch_add(finished);
}

// Where a waiting caller sleeps; shared with the helpers' tasks, which may
// outlive the call.
struct Completion {
  std::mutex mu;
  std::condition_variable cv;
};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Runs job->Run() on the calling thread and on `helpers` of the pool's, and
// returns once job->done has reached `items`. Every job->Run() must add the
// items it finished to job->done before it returns.
template <class Job>
void RunOnPool(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t helpers, int64_t items) {
  if (helpers <= 0) {
    job->Run();
    return;
  }
  auto completion = std::make_shared<Completion>();
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([job, completion, items] {
      job->Run();
      if (job->done.load() >= items) {
        // under the lock, so a caller between its check and its wait hears it
        std::lock_guard<std::mutex> lock(completion->mu);
        completion->cv.notify_all();
      }
    });
  }
  job->Run();
  if (job->done.load() >= items) return;
  const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeBlocking;
  for (int spins = 0; job->done.load() < items; ++spins) {
    CpuRelax();
    if ((spins & 63) == 63 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  if (job->done.load() >= items) return;
  std::unique_lock<std::mutex> lock(completion->mu);
  completion->cv.wait(lock, [&] { return job->done.load() >= items; });
}

// RunOnPool for `items` items on `threads` threads, the caller one of them,
// with no more helpers than there are items beyond the caller's.
template <class Job>
void RunOnThreads(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t threads, int64_t items) {
  RunOnPool(pool, job, std::min<int64_t>(threads, items) - 1, items);
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_
