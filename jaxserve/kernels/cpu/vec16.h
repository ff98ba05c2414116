// Sixteen float32 lanes for the dense CPU kernels (matmul_cpu.cc, matvec_cpu.cc).
//
// An AVX-512 register where the target has one; otherwise a portable
// struct whose lane loops the compiler vectorises, with the same operations
// per lane, so a kernel's sums are those of the AVX-512 path up to the FMA
// contraction the target allows.

#ifndef JAXSERVE_KERNELS_CPU_VEC16_H_
#define JAXSERVE_KERNELS_CPU_VEC16_H_

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu {

constexpr int64_t kLanes = 16;

#if defined(__AVX512F__)
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Fma(float a, Vec b, Vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
#else
struct Vec {
  float v[kLanes];
};
inline Vec Zero() { return Vec{}; }
inline Vec Load(const float* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline void Store(float* p, const Vec& v) {
  for (int i = 0; i < kLanes; ++i) p[i] = v.v[i];
}
inline Vec Fma(const Vec& a, const Vec& b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Vec Fma(float a, const Vec& b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = __builtin_fmaf(a, b.v[i], c.v[i]);
  return c;
}
#endif

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_VEC16_H_
