// RMSNorm over the features of a feature-major activation, as an XLA FFI
// custom call.
//
//   x    f32 [E, T]   E features of T tokens (the decoder's residual stream)
//   w    f32 [E]      the weight, Gemma's offset already added
//   out  f32 [E, T]   x[e, t] * r[t] * w[e], r[t] = 1 / sqrt(sum_e x[e, t]^2 / E + eps)
//
// Why a kernel: a token's norm must be the same bits whatever the step's
// token count (speculative steps verify guesses beside it; with int8
// weights the next product quantizes the norm's output, so a last-bit
// difference can become another greedy token, tests/test_speculative.py).
// XLA's sum follows the whole shape, and the pure-JAX norm gets its fixed
// order from blocks.ordered_sum's halving tree: about 90 HLO instructions a
// norm, 5,200 of the 1-token SmolLM2 forward program's 11,500, and a
// program loaded from the persistent compilation cache holds memory in
// proportion to them (BENCHMARKS.md, the memory scenario). Here every token
// goes through the same 16-lane code, a partial block of tokens with its
// other lanes zeroed (masked loads on AVX-512, a zero-padded copy
// elsewhere), and sums its squares in feature order with fused
// multiply-adds.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "run_on_pool.h"  // with immintrin.h on x86
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlocksPerItem = 4;

struct Job {
  const float *x, *w;
  float* out;
  float eps;
  int64_t E, T, blocks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  Job(const float* x, const float* w, float* out, float eps, int64_t E, int64_t T)
      : x(x), w(w), out(out), eps(eps), E(E), T(T), blocks((T + kLanes - 1) / kLanes),
        items((blocks + kBlocksPerItem - 1) / kBlocksPerItem) {}

  // The 16 tokens from t0 (n of them real): the same lane code for every
  // token, so its bits do not depend on where it sits in the step (a
  // partial block reads into zeroed lanes).
  void Block(int64_t t0, int64_t n) const {
    float acc[kLanes] = {}, r[kLanes];
#if defined(__AVX512F__)
    // A feature's n tokens are one masked load (zeros in the other lanes)
    // and one masked store: copied lane by lane, as the portable loop below
    // does, GCC 12 made each feature's copy a memcpy call and a 64-byte
    // reload of four stored bytes, 11 us for one token of SmolLM2-135M's
    // 576 features against 1.8 us this way (a jitted chain of 61 norms, as a
    // 1-token step has).
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t e = 0; e < E; ++e) {
      const __m512 v = _mm512_maskz_loadu_ps(live, x + e * T + t0);
      sum = _mm512_fmadd_ps(v, v, sum);
    }
    _mm512_storeu_ps(acc, sum);
#else
    float v[kLanes] = {};
    for (int64_t e = 0; e < E; ++e) {
      const float* row = x + e * T + t0;
      for (int64_t j = 0; j < n; ++j) v[j] = row[j];
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = std::fma(v[j], v[j], acc[j]);
    }
#endif
    const float count = static_cast<float>(E);
    for (int64_t j = 0; j < kLanes; ++j) r[j] = 1.0f / std::sqrt(acc[j] / count + eps);
#if defined(__AVX512F__)
    const __m512 rv = _mm512_loadu_ps(r);
    for (int64_t e = 0; e < E; ++e) {
      const __m512 v = _mm512_maskz_loadu_ps(live, x + e * T + t0);
      _mm512_mask_storeu_ps(out + e * T + t0, live, _mm512_mul_ps(_mm512_mul_ps(v, rv), _mm512_set1_ps(w[e])));
    }
#else
    float o[kLanes];
    for (int64_t e = 0; e < E; ++e) {
      const float* row = x + e * T + t0;
      for (int64_t j = 0; j < n; ++j) v[j] = row[j];
      const float we = w[e];
      for (int64_t j = 0; j < kLanes; ++j) o[j] = v[j] * r[j];
      for (int64_t j = 0; j < kLanes; ++j) o[j] = o[j] * we;
      float* dst = out + e * T + t0;
      for (int64_t j = 0; j < n; ++j) dst[j] = o[j];
    }
#endif
  }

  void RunItem(int64_t item) const {
    for (int64_t b = item * kBlocksPerItem; b < std::min(blocks, (item + 1) * kBlocksPerItem); ++b) {
      const int64_t t0 = b * kLanes;
      Block(t0, std::min(kLanes, T - t0));
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || w.element_count() != xd[0] || out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("rms_norm_cpu: needs x [E, T] and w [E]");
  }
  auto job = std::make_shared<Job>(x.typed_data(), w.typed_data(), out->typed_data(), eps, xd[0], xd[1]);
  jaxserve_cpu::RunOnThreads(pool, job, jaxserve_cpu::Workers(pool), job->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRmsNormCpu, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());
