// Sixteen float32 lanes for the dense CPU kernels (matmul_cpu.cc, matvec_cpu.cc).
//
// An AVX-512 register where the target has one; two AVX2 registers where it
// has AVX2 and FMA; otherwise a portable struct whose lane loops the compiler
// vectorises. Every branch does the same fused multiply-add per lane, so a
// kernel's sums are the same float32 arithmetic on any of them.
//
// kVectorRegisters and kRegistersPerVec let a kernel size its register tile
// to the target: a tile of AVX-512's 16 accumulators is 32 of AVX2's 16
// registers, and the spills made the AVX2 build 0.67-0.85x XLA's matmul
// (commit fe11cca).

#ifndef JAXSERVE_KERNELS_CPU_VEC16_H_
#define JAXSERVE_KERNELS_CPU_VEC16_H_

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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
constexpr int kVectorRegisters = 32;
constexpr int kRegistersPerVec = 1;
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXSERVE_CPU_VEC16_AVX2 1
struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline Vec Zero() { return Vec{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec Load(const float* p) { return Vec{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, const Vec& v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Vec Fma(const Vec& a, const Vec& b, const Vec& c) {
  return Vec{_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec Fma(float a, const Vec& b, const Vec& c) {
  const __m256 s = _mm256_set1_ps(a);
  return Vec{_mm256_fmadd_ps(s, b.lo, c.lo), _mm256_fmadd_ps(s, b.hi, c.hi)};
}
constexpr int kVectorRegisters = 16;
constexpr int kRegistersPerVec = 2;
// Full unrolling of a register tile's loops over its rows and vectors.
// Without it GCC 12 kept the tiles' arrays of this two-register Vec in
// memory, a store per FMA (seen in the assembly; the matmul at 64 tokens ran
// at half XLA's rate). AVX-512's tiles keep their accumulators in registers
// without it, so there it expands to nothing and their code is unchanged.
#define JAXSERVE_UNROLL _Pragma("GCC unroll 32")
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
constexpr int kVectorRegisters = 16;  // planning figures for an unknown target
constexpr int kRegistersPerVec = 2;
#endif

#ifndef JAXSERVE_UNROLL
#define JAXSERVE_UNROLL
#endif

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_VEC16_H_
