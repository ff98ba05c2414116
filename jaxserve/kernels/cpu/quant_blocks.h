// Blocks of 32 int8 values with a scale, shared by the quantized kernels
// (qmatmul_cpu.cc, moe_cpu.cc, row_tile.h): the weight kinds and their
// float16 scales and the activations' quantization per block. One
// definition, so the kernels compute the same integers and scales for the
// same inputs (a MoE expert is the dense product applied to its rows:
// row_tile.h).
//
// The kernels take it in whole (`using namespace jaxserve_cpu::quant`).
//
// Compile-time dispatch: JAXSERVE_QUANT_VNNI (defined here) where the host
// has AVX-512 VNNI, BW and VL (the library is built with -march=native on
// the machine that runs it) and JAXSERVE_QUANT_PORTABLE is not defined;
// otherwise the portable loops, the same integers and formula in plain C++
// for the compiler to vectorise.

#ifndef JAXSERVE_KERNELS_CPU_QUANT_BLOCKS_H_
#define JAXSERVE_KERNELS_CPU_QUANT_BLOCKS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(JAXSERVE_QUANT_PORTABLE)
#define JAXSERVE_QUANT_VNNI 1
#include <immintrin.h>
#endif

// JAXSERVE_QUANT_AMX: the VNNI loops plus AMX int8 tiles for the prefill
// loop, where the host has AMX-TILE and AMX-INT8 (Sapphire Rapids and later
// Xeons). Whether the kernel may use them is also asked of Linux at run
// time (AmxUsable): tile data is off for a process until it requests it.
#if defined(JAXSERVE_QUANT_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define JAXSERVE_QUANT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace jaxserve_cpu::quant {

// Values per block (one scale each), of the weights and the activations.
inline constexpr int64_t kGroup = 32;

// The weight kinds (the `kind` attribute; jaxserve.kernels.cpu._QUANT_KINDS).
enum QuantKind : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

// A float16 value (a block's scale or min, stored as its bits) as float.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FFu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A block's scale d = amax * f32(1/127) and, into *inv, 1 / d (0 where d is
// 0), each rounded as jaxserve.models.quant.quantize_activations rounds it.
// The volatiles keep -ffast-math from folding them into 127 / amax or a
// later x / d, which round differently and move ties (x.5) of xq by one.
[[gnu::always_inline]] inline float BlockScale(float amax, float* inv) {
  volatile float d_kept = amax * (1.0f / 127.0f);
  const float d = d_kept;
  volatile float inv_kept = d > 0.0f ? 1.0f / d : 0.0f;
  *inv = inv_kept;
  return d;
}

// One block of 32 contiguous activations v quantized into q[0, 32)
// (xq = round-half-even(x * (1 / d))): returns d, and sum(xq) into *sum.
// With AVX-512 two vectors of 16 (the product rounded by the conversion);
// the same integers as the portable loop (tests/test_quant_kernels.py).
[[gnu::always_inline]] inline float QuantizeBlock(const float* v, int8_t* q, int32_t* sum) {
#if defined(JAXSERVE_QUANT_VNNI)
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
  float inv_scalar;
  const float d = BlockScale(amax, &inv_scalar);
  const __m512 inv = _mm512_set1_ps(inv_scalar);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
  float amax = 0.0f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(v[k]));
  float inv;
  const float d = BlockScale(amax, &inv);
  int32_t s = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
    s += q[k];
  }
  *sum = s;
#endif
  return d;
}

// The offset of the weights' unsigned integers as the kernels multiply
// them: q8_0's q enter vpdpbusd flipped to q + 128, q4_0's nibbles are
// q + 8, q4_1's are q (its min is added apart). A block's integer dot
// starts at -WeightOffset(kind) * sum(xq) to undo it.
inline int32_t WeightOffset(int32_t kind) { return kind == kQ8_0 ? 128 : (kind == kQ4_0 ? 8 : 0); }

#if defined(JAXSERVE_QUANT_AMX)
// Whether this process may use the AMX tile registers: Linux (5.16+) keeps
// their 8 KB of state out of every context switch until a process asks for
// it with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the grant
// covers all of its threads. Asked once; a refusal (an older kernel, a
// hypervisor that hides the state) leaves the VNNI loops to do the work.
inline bool AmxUsable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023;  // arch/x86/include/uapi/asm/prctl.h
    constexpr long kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return usable;
}
#endif

// A quantized weight's arguments in an FFI binding: its blocks q (int8 or
// packed nibbles), their float16 scales, and their float16 mins (Q4_1 only;
// the others pass the scales again). jaxserve.kernels.cpu passes a weight
// (qmatmul_cpu) and each expert stack (moe_cpu, which passes a float32 stack
// in q with empty scale and mins) as these three buffers, in this order.
template <class Binding>
auto QuantizedWeightArgs(Binding&& binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()   // q
      .template Arg<xla::ffi::AnyBuffer>()   // scale
      .template Arg<xla::ffi::AnyBuffer>();  // mins
}

}  // namespace jaxserve_cpu::quant

#endif  // JAXSERVE_KERNELS_CPU_QUANT_BLOCKS_H_
