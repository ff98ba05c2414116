// One layer's int8 KV cache write (the blocks layout), as an XLA FFI custom
// call that updates the cache in place.
//
//   k, v      f32 [T, H, D]        this step's keys and values, H kv heads
//   slots     s32 [T]              slot = block * BS + offset; outside
//                                  [0, NB * BS) the token is dropped
//   kq        s8  [NB, H, D, BS]   keys, stored transposed (kv_cache.py)
//   ks        f32 [NB, H, BS]      their scales
//   vq        s8  [NB, H, BS, D]   values
//   vs        f32 [NB, H, BS]      their scales
//   results   kq, ks, vq, vs       the same buffers (input_output_aliases)
//
// Each head vector x is stored as q = clip(rint(x / s), -127, 127) with
// s = max|x| * float32(1 / 127) (1 where s is 0), kv_cache.quantize_kv's
// formula to the bit, so the pure-JAX write and this one fill a cache
// alike (tests/test_kernels_cpu.py). Only AVX-512 builds have the loop
// (JaxserveKvWriteI8Vectorized); elsewhere the XLA write serves.
//
// Why a kernel: written in XLA ops, the quantization and the four scatters
// were about 5,000 of the 9,300 HLO instructions of SmolLM2-135M's 1-token
// forward program with an int8 cache, and a program's memory, above all
// one loaded from the persistent compilation cache, grows with its HLO
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

#if defined(JAXSERVE_KV_WRITE_VECTORIZED)
struct Job {
  const float *k, *v;
  const int32_t* slots;
  int8_t *kq, *vq;
  float *ks, *vs;
  int64_t T, H, D, NB, BS, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    for (int64_t t = item * kTokensPerItem; t < std::min(T, (item + 1) * kTokensPerItem); ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= NB * BS) continue;
      const int64_t blk = slot / BS, off = slot % BS;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t bh = blk * H + h;
        const float* kx = k + (t * H + h) * D;
        const float* vx = v + (t * H + h) * D;
        ks[bh * BS + off] = Quantize(kx, D, kq + bh * D * BS + off, BS);
        vs[bh * BS + off] = Quantize(vx, D, vq + (bh * BS + off) * D, 1);
      }
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error KvWriteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                       ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                       ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::S8> kq,
                       ffi::ResultBuffer<ffi::F32> ks, ffi::ResultBuffer<ffi::S8> vq,
                       ffi::ResultBuffer<ffi::F32> vs) {
  const auto xd = k.dimensions(), kd = kq->dimensions(), vd = vq->dimensions(), sd = ks->dimensions();
  const bool shapes_ok = xd.size() == 3 && kd.size() == 4 && vd.size() == 4 && sd.size() == 3 &&
                         v.element_count() == k.element_count() && slots.element_count() == xd[0] &&
                         kd[1] == xd[1] && kd[2] == xd[2] && vd[0] == kd[0] && vd[1] == kd[1] &&
                         vd[2] == kd[3] && vd[3] == kd[2] && sd[0] == kd[0] && sd[1] == kd[1] &&
                         sd[2] == kd[3] && vs->element_count() == ks->element_count();
  if (!shapes_ok || xd[2] % 16 != 0) {
    return ffi::Error::InvalidArgument(
        "kv_write_cpu: needs k, v [T, H, D] with D a multiple of 16, slots [T], keys [NB, H, D, BS], "
        "values [NB, H, BS, D] and scales [NB, H, BS]");
  }
  auto job = std::make_shared<Job>();
  job->k = k.typed_data();
  job->v = v.typed_data();
  job->slots = slots.typed_data();
  job->kq = kq->typed_data();
  job->ks = ks->typed_data();
  job->vq = vq->typed_data();
  job->vs = vs->typed_data();
  job->T = xd[0];
  job->H = xd[1];
  job->D = xd[2];
  job->NB = kd[0];
  job->BS = kd[3];
  job->items = (job->T + kTokensPerItem - 1) / kTokensPerItem;
  jaxserve_cpu::RunOnThreads(pool, job, jaxserve_cpu::Workers(pool), job->items);
  return ffi::Error::Success();
}
#else
ffi::Error KvWriteImpl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>,
                       ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                       ffi::ResultBuffer<ffi::S8>, ffi::ResultBuffer<ffi::F32>, ffi::ResultBuffer<ffi::S8>,
                       ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("kv_write_cpu: this build has no AVX-512 loop (JaxserveKvWriteI8Vectorized)");
}
#endif

}  // namespace

// Whether this build has the write (AVX-512 F and BW); elsewhere the XLA
// write serves (jaxserve.kernels.cpu.kv_write_i8_serves).
extern "C" int JaxserveKvWriteI8Vectorized() {
#if defined(JAXSERVE_KV_WRITE_VECTORIZED)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWriteI8Cpu, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S8>>()   // kq (aliased to the first result)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ks
                                  .Arg<ffi::Buffer<ffi::S8>>()   // vq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // vs
                                  .Ret<ffi::Buffer<ffi::S8>>()   // kq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ks
                                  .Ret<ffi::Buffer<ffi::S8>>()   // vq
                                  .Ret<ffi::Buffer<ffi::F32>>());  // vs
