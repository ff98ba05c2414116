// One layer's KV cache write (the blocks layout), as XLA FFI custom calls
// that update the cache in place: a float32 cache's and an int8 one's.
//
//   k, v      f32 [T, H, D]        this step's keys and values, H kv heads
//   slots     s32 [T]              slot = block * BS + offset; outside
//                                  [0, NB * BS) the token is dropped
//   float32:  kc f32 [NB, H, D, BS] keys, stored transposed (kv_cache.py),
//             vc f32 [NB, H, BS, D] values
//   int8:     kq s8 [NB, H, D, BS], ks f32 [NB, H, BS] keys and their scales,
//             vq s8 [NB, H, BS, D], vs f32 [NB, H, BS] values and theirs
//   results   the cache's buffers, aliased (input_output_aliases)
//
// In an int8 cache each head vector x is stored as q = clip(rint(x / s), -127, 127) with
// s = max|x| * float32(1 / 127) (1 where s is 0), kv_cache.quantize_kv's
// formula to the bit, so the pure-JAX write and this one fill a cache
// alike (tests/test_kernels_cpu.py). Only AVX-512 builds have the loop
// (JaxserveKvWriteI8Vectorized); elsewhere the XLA write serves.
//
// Why a kernel: written in XLA ops, each layer's write is its slot
// arithmetic, scatters and, for int8, the quantization: 7,400 of the 9,300
// HLO instructions of SmolLM2-135M's 1-token forward program with an int8
// cache (1,900 with this kernel), and a program's memory, above all one
// loaded from the persistent compilation cache, grows with its HLO
// (BENCHMARKS.md, the memory scenario). Here a layer's write is one
// instruction.
//
// Padding tokens all write into the null block 0 (step_arrays.py), which
// no sequence reads, so two threads writing it at once is harmless;
// every other slot belongs to one token of the step.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokensPerItem = 32;
// kv_cache.INT8_MAX, and the scale factor as float32(1.0 / 127.0), rounded
// from the double as numpy rounds jnp.float32(1.0 / INT8_MAX)
constexpr float kInt8Max = 127.0f;
const float kInvInt8Max = static_cast<float>(1.0 / 127.0);

// One head vector of D floats (D a multiple of 16): its scale, and its
// int8 values written to q[d * stride] (stride BS for the transposed keys,
// 1 for values). The library is built with -ffast-math, which lets the
// compiler turn a division by a loop-invariant value into a product by its
// reciprocal (another last bit, and at a .5 another integer); a division
// with an explicit rounding mode is a builtin no optimisation rewrites.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXSERVE_KV_WRITE_VECTORIZED 1
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline float Quantize(const float* x, int64_t D, int8_t* q, int64_t stride) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + d));
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, a);
  }
  const float scale = nan ? NAN : _mm512_reduce_max_ps(m) * kInvInt8Max;
  const __m512 safe = _mm512_set1_ps(scale > 0.0f ? scale : 1.0f);
  const __m512 lo = _mm512_set1_ps(-kInt8Max), hi = _mm512_set1_ps(kInt8Max);
  for (int64_t d = 0; d < D; d += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_round_ps(_mm512_loadu_ps(x + d), safe, kRound), kRound);
    const __mmask16 bad = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
    r = _mm512_mask_mov_ps(_mm512_min_ps(_mm512_max_ps(r, lo), hi), bad, _mm512_setzero_ps());
    const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r));
    if (stride == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d), bytes);
    } else {
      alignas(16) int8_t b[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(b), bytes);
      for (int j = 0; j < 16; ++j) q[(d + j) * stride] = b[j];
    }
  }
  return scale;
}
#endif

// Where a token's head vectors go: the float32 pages copy them.
struct F32Pages {
  float *k, *v;

  void Write(const float* kx, const float* vx, int64_t bh, int64_t off, int64_t D, int64_t BS) const {
    float* kd = k + bh * D * BS + off;
    for (int64_t d = 0; d < D; ++d) kd[d * BS] = kx[d];
    std::memcpy(v + (bh * BS + off) * D, vx, sizeof(float) * D);
  }
};

#if defined(JAXSERVE_KV_WRITE_VECTORIZED)
// ... and the int8 pages quantize them, each with its scale.
struct Int8Pages {
  int8_t *kq, *vq;
  float *ks, *vs;

  void Write(const float* kx, const float* vx, int64_t bh, int64_t off, int64_t D, int64_t BS) const {
    ks[bh * BS + off] = Quantize(kx, D, kq + bh * D * BS + off, BS);
    vs[bh * BS + off] = Quantize(vx, D, vq + (bh * BS + off) * D, 1);
  }
};
#endif

template <class Pages>
struct Job {
  const float *k, *v;
  const int32_t* slots;
  Pages pages;
  int64_t T, H, D, NB, BS, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // xd: k's dimensions [T, H, D]; kd: the keys' [NB, H, D, BS]
  Job(const float* k, const float* v, const int32_t* slots, Pages pages, ffi::Span<const int64_t> xd,
      ffi::Span<const int64_t> kd)
      : k(k), v(v), slots(slots), pages(pages), T(xd[0]), H(xd[1]), D(xd[2]), NB(kd[0]), BS(kd[3]),
        items((T + kTokensPerItem - 1) / kTokensPerItem) {}

  void RunItem(int64_t item) const {
    for (int64_t t = item * kTokensPerItem; t < std::min(T, (item + 1) * kTokensPerItem); ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= NB * BS) continue;
      const int64_t blk = slot / BS, off = slot % BS;
      for (int64_t h = 0; h < H; ++h) {
        pages.Write(k + (t * H + h) * D, v + (t * H + h) * D, blk * H + h, off, D, BS);
      }
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

// k, v [T, H, D] and slots [T] against keys [NB, H, D, BS] and values [NB,
// H, BS, D] (dimensions as given); an empty string when they fit.
const char* ShapeError(ffi::Span<const int64_t> xd, int64_t v_count, int64_t slot_count,
                       ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd) {
  const bool ok = xd.size() == 3 && kd.size() == 4 && vd.size() == 4 && v_count == xd[0] * xd[1] * xd[2] &&
                  slot_count == xd[0] && kd[1] == xd[1] && kd[2] == xd[2] && vd[0] == kd[0] && vd[1] == kd[1] &&
                  vd[2] == kd[3] && vd[3] == kd[2];
  return ok ? "" : "kv_write_cpu: needs k, v [T, H, D], slots [T], keys [NB, H, D, BS] and values [NB, H, BS, D]";
}

template <class Pages>
void Launch(ffi::ThreadPool& pool, const float* k, const float* v, const int32_t* slots, Pages pages,
            ffi::Span<const int64_t> xd, ffi::Span<const int64_t> kd) {
  auto job = std::make_shared<Job<Pages>>(k, v, slots, pages, xd, kd);
  jaxserve_cpu::RunOnThreads(pool, job, jaxserve_cpu::Workers(pool), job->items);
}

ffi::Error KvWriteF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                          ffi::ResultBuffer<ffi::F32> kc, ffi::ResultBuffer<ffi::F32> vc) {
  const auto xd = k.dimensions(), kd = kc->dimensions();
  if (const char* error = ShapeError(xd, v.element_count(), slots.element_count(), kd, vc->dimensions()); *error) {
    return ffi::Error::InvalidArgument(error);
  }
  Launch(pool, k.typed_data(), v.typed_data(), slots.typed_data(), F32Pages{kc->typed_data(), vc->typed_data()}, xd,
         kd);
  return ffi::Error::Success();
}

ffi::Error KvWriteI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::S8> kq,
                         ffi::ResultBuffer<ffi::F32> ks, ffi::ResultBuffer<ffi::S8> vq,
                         ffi::ResultBuffer<ffi::F32> vs) {
#if defined(JAXSERVE_KV_WRITE_VECTORIZED)
  const auto xd = k.dimensions(), kd = kq->dimensions();
  if (const char* error = ShapeError(xd, v.element_count(), slots.element_count(), kd, vq->dimensions()); *error) {
    return ffi::Error::InvalidArgument(error);
  }
  const auto sd = ks->dimensions();
  if (xd[2] % 16 != 0 || sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[3] ||
      vs->element_count() != ks->element_count()) {
    return ffi::Error::InvalidArgument("kv_write_cpu: int8 pages need D a multiple of 16 and scales [NB, H, BS]");
  }
  Launch(pool, k.typed_data(), v.typed_data(), slots.typed_data(),
         Int8Pages{kq->typed_data(), vq->typed_data(), ks->typed_data(), vs->typed_data()}, xd, kd);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("kv_write_cpu: this build has no AVX-512 loop (JaxserveKvWriteI8Vectorized)");
#endif
}

}  // namespace

// Whether this build has the int8 write (AVX-512 F and BW); elsewhere the
// XLA write serves (jaxserve.kernels.cpu.kv_write_serves).
extern "C" int JaxserveKvWriteI8Vectorized() {
#if defined(JAXSERVE_KV_WRITE_VECTORIZED)
  return 1;
#else
  return 0;
#endif
}

// Both writes begin with the pool, k, v and slots; then the cache's
// buffers, each as an argument and as the result it is aliased to.
static auto WriteBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<
      ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWriteF32Cpu, KvWriteF32Impl,
                              WriteBinding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kc
                                  .Arg<ffi::Buffer<ffi::F32>>()  // vc
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWriteI8Cpu, KvWriteI8Impl,
                              WriteBinding()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // kq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ks
                                  .Arg<ffi::Buffer<ffi::S8>>()   // vq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // vs
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
