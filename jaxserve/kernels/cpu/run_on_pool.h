// Running a job on XLA's CPU thread pool, shared by the CPU kernels.
//
// A job holds its work items and two counters: the threads take items from
// it until none are left, and `done` counts the items finished. The calling
// thread works too, then waits for the items other threads still hold. The
// job is held by shared_ptr: a task the pool starts late finds nothing left
// and touches nothing freed.

#ifndef JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_
#define JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_

#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

// A job's Run() for work split into `items` independent items: take them one
// at a time from job.next, run job.RunItem(item), count them into job.done.
template <class Job>
void RunItems(Job& job, int64_t items) {
  int64_t finished = 0;
  for (int64_t item; (item = job.next.fetch_add(1)) < items; ++finished) job.RunItem(item);
  job.done.fetch_add(finished);
}

// Runs job->Run() on the calling thread and on `helpers` of the pool's, and
// returns once job->done has reached `items`.
template <class Job>
void RunOnPool(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t helpers, int64_t items) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Run(); });
  job->Run();
  while (job->done.load() < items) std::this_thread::yield();
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_RUN_ON_POOL_H_
