// Greedy tokens from vocabulary logits, as an XLA FFI custom call.
//
// Why a hand-written kernel: a greedy decode step reduces [V, R] float32
// logits (vocabulary-major, the orientation of the fastest vocabulary matmul;
// 32000 x 64 is 8 MB) to each column's first index of the maximum. XLA's CPU
// backend does not vectorise its (value, index) reduction, so
// jaxserve.engine.sampler.argmax writes it as a max, then a min over an iota
// where the logits equal it: three passes and ~2 ms a step (commit
// 30325be). This is one pass: each thread scans a run of whole rows (R
// contiguous floats), keeping per column a running maximum and its index.
//
//   logits f32 [V, R]   V, R >= 1
//   out    s32 [R]      first index of each column's maximum; 0 for a column
//                       holding a NaN (sampler.argmax's contract)
//
// The threads split the vocabulary into runs of rows and earlier runs win
// ties, so the result is that of one sequential pass.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Running (maximum, first index, NaN seen) per column over rows [v0, v1):
// strictly greater replaces, so the first maximum stays.
struct Best {
  std::vector<float> value;
  std::vector<int32_t> index;
  std::vector<uint8_t> nan;
};

void ScanRows(const float* x, int64_t R, int64_t v0, int64_t v1, Best* best) {
  best->value.assign(R, -std::numeric_limits<float>::infinity());
  best->index.assign(R, static_cast<int32_t>(v0));
  best->nan.assign(R, 0);
  float* __restrict value = best->value.data();
  int32_t* __restrict index = best->index.data();
  uint8_t* __restrict nan = best->nan.data();
  for (int64_t v = v0; v < v1; ++v) {
    const float* __restrict row = x + v * R;
    for (int64_t c = 0; c < R; ++c) {  // vectorised by the compiler: compares and blends
      const float y = row[c];
      const bool greater = y > value[c];
      value[c] = greater ? y : value[c];
      index[c] = greater ? static_cast<int32_t>(v) : index[c];
      nan[c] |= static_cast<uint8_t>(y != y);
    }
  }
}

// The vocabulary in parts (contiguous rows), each scanned whole by one
// thread (run_on_pool.h); the parts are merged in order afterwards.
struct Job {
  const float* x;
  int64_t V, R, parts;
  std::vector<Best> partial;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t part) { ScanRows(x, R, V * part / parts, V * (part + 1) / parts, &partial[part]); }
  void Run() { jaxserve_cpu::RunItems(*this, parts); }
};

ffi::Error VocabArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || ld[1] < 1 || ld[0] < 1 || out->element_count() != ld[1]) {
    return ffi::Error::InvalidArgument("vocab_argmax_cpu: needs logits [V, R], V, R >= 1, out [R]");
  }
  auto job = std::make_shared<Job>();
  job->x = logits.typed_data();
  job->V = ld[0];
  job->R = ld[1];
  const int64_t threads = jaxserve_cpu::Workers(pool);
  // a few parts per thread for balance, each at least 1024 rows
  job->parts = std::max<int64_t>(1, std::min<int64_t>(4 * threads, job->V / 1024));
  job->partial.resize(job->parts);
  jaxserve_cpu::RunOnThreads(pool, job, threads, job->parts);
  int32_t* result = out->typed_data();
  for (int64_t c = 0; c < job->R; ++c) {
    float value = job->partial[0].value[c];
    int32_t index = job->partial[0].index[c];
    bool nan = job->partial[0].nan[c];
    for (int64_t part = 1; part < job->parts; ++part) {  // in vocabulary order: earlier parts win ties
      const Best& b = job->partial[part];
      if (b.value[c] > value) {
        value = b.value[c];
        index = b.index[c];
      }
      nan = nan || b.nan[c];
    }
    result[c] = nan ? 0 : index;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveVocabArgmaxCpu, VocabArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
