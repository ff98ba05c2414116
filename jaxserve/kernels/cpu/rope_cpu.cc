// Rotary position embedding of keys, as an XLA FFI custom call.
//
//   x    f32 [T, N, D]   N heads of D features per token
//   cos  f32 [T, R]      R <= D, even: the rotated features (rope.apply_rope's tables)
//   sin  f32 [T, R]
//   out  f32 [T, N, D]   HF rotate_half: feature d < R / 2 becomes
//                        x[d] cos[d] - x[d + R/2] sin[d], feature d + R/2
//                        x[d + R/2] cos[d + R/2] + x[d] sin[d + R/2];
//                        features from R on pass through
//
// Why a kernel for four multiplies and two adds: the same token's keys must
// be the same bits in every program, and XLA's CPU backend fused this
// arithmetic differently by program: in a one-token decode step it joined
// the cache write and fused a product into the add (one rounding), in a
// speculative step of the same token and its guesses it did not. The keys
// in the cache then differed in the last bit, and with int8 weights the
// next layer's activation quantization made that another integer: greedy
// text changed with speculation on (tests/test_speculative.py, the int8
// engine). An optimization barrier does not hold: the CPU pipeline removes
// barriers before fusion. Here each value is one fixed expression, the one
// paged_attention_cpu.cc rotates queries with (LoadQueries, before its
// scale), whatever the token count.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokensPerItem = 64;

struct Job {
  const float *x, *cos, *sin;
  float* out;
  int64_t T, N, D, R, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  Job(const float* x, const float* cos, const float* sin, float* out, int64_t T, int64_t N, int64_t D, int64_t R)
      : x(x), cos(cos), sin(sin), out(out), T(T), N(N), D(D), R(R),
        items((T + kTokensPerItem - 1) / kTokensPerItem) {}

  void RunItem(int64_t item) const {
    const int64_t half = R / 2;
    for (int64_t t = item * kTokensPerItem; t < std::min(T, (item + 1) * kTokensPerItem); ++t) {
      const float* c = cos + t * R;
      const float* s = sin + t * R;
      for (int64_t n = 0; n < N; ++n) {
        const float* src = x + (t * N + n) * D;
        float* dst = out + (t * N + n) * D;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = src[d], x2 = src[d + half];
          dst[d] = x1 * c[d] - x2 * s[d];
          dst[d + half] = x2 * c[d + half] + x1 * s[d + half];
        }
        if (R < D) std::memcpy(dst + R, src + R, sizeof(float) * (D - R));
      }
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error RopeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                    ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), cd = cos.dimensions();
  if (xd.size() != 3 || cd.size() != 2 || cd[0] != xd[0] || cd[1] % 2 || cd[1] > xd[2] ||
      sin.element_count() != cos.element_count() || out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("rope_cpu: needs x [T, N, D], cos and sin [T, R] with R even and <= D");
  }
  auto job = std::make_shared<Job>(x.typed_data(), cos.typed_data(), sin.typed_data(), out->typed_data(), xd[0],
                                   xd[1], xd[2], cd[1]);
  jaxserve_cpu::RunOnThreads(pool, job, jaxserve_cpu::Workers(pool), job->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeCpu, RopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Ret<ffi::Buffer<ffi::F32>>());
