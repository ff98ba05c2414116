// Dense float32 matmul for 1 to 32 tokens, as an XLA FFI custom call.
//
// Why a second matmul kernel: a decode step of a handful of sequences runs
// every weight matrix against 8 or 16 tokens (the smallest token buckets),
// and the vocabulary projection against 1-16 sampled rows. That is close to
// the matrix-vector regime, where a step should stream its weights at the
// machine's read bandwidth: XLA's CPU backend reads them at 7-11 GB/s at
// T = 8-16 (commit 8325c81), and matmul_cpu.cc's register tile
// needs T >= 32 to pay (below that it streams 12-24 weight rows at once, one
// float from each per step). It computes T = 32 too; the model leaves that
// to matmul_cpu.cc, faster there. Here each weight row is read as contiguous
// vectors against the tokens' inputs, transposed once per call into
// token-major rows that stay in cache:
//
//   w   f32 [O, I]   weights, row-major (the model's [out, in])
//   x   f32 [I, T]   inputs, feature-major; T in {1, 2, 4, 8, 16, 32}
//   out f32 [O, T]   w @ x
//
// A tile is 4 rows x up to 4 tokens: 16 accumulators, two FMAs per load
// (with AVX2's 16 registers, 2 x 2 or 4 x 1: kAccumulators below). The
// token groups of one block of rows run back to back, so the rows come from
// memory once and from L1 after; the rows 16 below the block are prefetched
// (the T2 hint) as it reads its own (without that, 2.3x slower at T = 8 in a
// one-thread test: the hardware prefetchers do not run far enough ahead of
// four interleaved streams). Lane j of each accumulator sums the products of
// k = j, j + 16, ... in k order, and the 16 lanes are added by one fixed
// halving tree (j + 8, + 4, + 2, + 1), so each output is the same float32
// arithmetic whatever T, the tile or the thread: a token's result never
// depends on the rest of the batch, nor on its size.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "run_on_pool.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::Fma;
using jaxserve_cpu::kLanes;  // floats per vector (the k step)
using jaxserve_cpu::Load;
using jaxserve_cpu::Store;
using jaxserve_cpu::Vec;
using jaxserve_cpu::Zero;

constexpr int kMaxTokens = 32;   // the largest T
constexpr int kMaxRows = 4;      // rows per tile: up to four weight streams at once
// Accumulators per tile: half the vector registers (the rest hold the
// loaded weights and inputs). AVX-512: 16, a tile of 4 rows x 4 tokens, two
// FMAs per load. AVX2 (a Vec is two registers): 4, so 2 rows x 2 tokens, or
// 4 rows x 1 token; the 16 of AVX-512's tile spilled there.
constexpr int kAccumulators = jaxserve_cpu::kVectorRegisters / (2 * jaxserve_cpu::kRegistersPerVec);
constexpr int kGroupTokens = kAccumulators >= 16 ? 4 : 2;  // tokens per tile
constexpr int64_t kAheadRows = 16;  // how far below the tile the weights are prefetched

#if defined(__AVX512F__)
inline Vec LoadFirst(const float* p, int64_t n) {  // lanes >= n read as 0
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}

// out[i] = the halving-tree sum of v[i]'s 16 lanes, for 16 vectors at once
// (each level adds lanes j and j + h of every vector, h = 8, 4, 2, 1, and
// packs two vectors' halves into one register).
Vec ReduceSixteen(const Vec v[16]) {
  // h = 8: u[m] = (v[2m] lo + hi | v[2m+1] lo + hi), 256 bits each
  Vec u[8];
  for (int m = 0; m < 8; ++m) {
    const Vec a = v[2 * m], b = v[2 * m + 1];
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  // h = 4: each 256-bit half's 128-bit quarters; s[m] holds four vectors' quarters
  Vec s[4];
  for (int m = 0; m < 4; ++m) {
    const Vec a = u[2 * m], b = u[2 * m + 1];
    s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // h = 2 and h = 1, inside each 128-bit lane
  Vec p[2];
  for (int m = 0; m < 2; ++m) {
    const Vec a = s[2 * m], b = s[2 * m + 1];
    p[m] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const Vec r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x88), _mm512_shuffle_ps(p[0], p[1], 0xDD));
  // r holds v[i]'s sum in lane 4 * (i % 4) + i / 4 (a 4 x 4 transpose,
  // its own inverse): put it back in lane i.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#elif defined(JAXSERVE_CPU_VEC16_AVX2)
inline Vec LoadFirst(const float* p, int64_t n) {  // lanes >= n read as 0
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), lane);
  return Vec{_mm256_maskload_ps(p, lo), _mm256_maskload_ps(p + 8, hi)};
}

// The halving-tree sums of eight 8-lane vectors (each already v.lo + v.hi,
// the h = 8 level), in lanes 0-7: h = 4 across the 128-bit halves, then h = 2
// and h = 1 inside them, as in the AVX-512 branch.
__m256 ReduceEight(const __m256 v[8]) {
  __m256 u[4];
  for (int m = 0; m < 4; ++m) {
    const __m256 a = v[2 * m], b = v[2 * m + 1];
    u[m] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  __m256 p[2];
  for (int m = 0; m < 2; ++m) {
    const __m256 a = u[2 * m], b = u[2 * m + 1];
    p[m] = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  }
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x88), _mm256_shuffle_ps(p[0], p[1], 0xDD));
  // r holds the sums of vectors 0, 2, 4, 6 | 1, 3, 5, 7: back in order
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#else
// Portable fallback: the same lanes and the same tree.
inline Vec LoadFirst(const float* p, int64_t n) {
  Vec r{};
  for (int i = 0; i < n; ++i) r.v[i] = p[i];
  return r;
}
Vec ReduceSixteen(const Vec v[16]) {
  Vec r;
  for (int i = 0; i < 16; ++i) {
    float t[16];
    for (int j = 0; j < 16; ++j) t[j] = v[i].v[j];
    for (int h = 8; h >= 1; h /= 2)
      for (int j = 0; j < h; ++j) t[j] = t[j] + t[j + h];
    r.v[i] = t[0];
  }
  return r;
}

#endif

// out[r * ldo + t] = w[r, :] . xt[t, :] for a tile of R rows x G tokens. xt
// rows are ldx floats apart, zero past I. With `prefetch` (the first token
// group of a block), the rows kAheadRows below are asked into L2.
#if defined(JAXSERVE_CPU_VEC16_AVX2)
// The AVX2 build's tile: the same lanes and sums on plain __m256 halves with
// the loops unrolled (JAXSERVE_UNROLL); GCC 12 kept arrays of the
// two-register Vec in memory.
template <int R, int G, bool prefetch>
inline void Tile(const float* w, int64_t I, const float* xt, int64_t ldx, float* out, int64_t ldo) {
  static_assert(R * G <= kAccumulators, "more accumulators than registers");
  constexpr int N = R * G;
  __m256 lo[N], hi[N];
  JAXSERVE_UNROLL for (int a = 0; a < N; ++a) lo[a] = hi[a] = _mm256_setzero_ps();
  const int64_t full = I / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    __m256 wl[R], wh[R];
    JAXSERVE_UNROLL for (int r = 0; r < R; ++r) {
      wl[r] = _mm256_loadu_ps(w + r * I + k);
      wh[r] = _mm256_loadu_ps(w + r * I + k + 8);
    }
    if (prefetch)
      JAXSERVE_UNROLL for (int r = 0; r < R; ++r) __builtin_prefetch(w + (kAheadRows + r) * I + k, 0, 1);
    JAXSERVE_UNROLL for (int t = 0; t < G; ++t) {
      const __m256 xl = _mm256_loadu_ps(xt + t * ldx + k), xh = _mm256_loadu_ps(xt + t * ldx + k + 8);
      JAXSERVE_UNROLL for (int r = 0; r < R; ++r) {
        lo[r * G + t] = _mm256_fmadd_ps(wl[r], xl, lo[r * G + t]);
        hi[r * G + t] = _mm256_fmadd_ps(wh[r], xh, hi[r * G + t]);
      }
    }
  }
  if (full < I) {  // the last I % 16 weights; xt is zero there
    JAXSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const Vec wv = LoadFirst(w + r * I + full, I - full);
      JAXSERVE_UNROLL for (int t = 0; t < G; ++t) {
        lo[r * G + t] = _mm256_fmadd_ps(wv.lo, _mm256_loadu_ps(xt + t * ldx + full), lo[r * G + t]);
        hi[r * G + t] = _mm256_fmadd_ps(wv.hi, _mm256_loadu_ps(xt + t * ldx + full + 8), hi[r * G + t]);
      }
    }
  }
  __m256 h[8];  // the h = 8 level of the tree, then ReduceEight for the rest
  JAXSERVE_UNROLL for (int a = 0; a < 8; ++a) h[a] = a < N ? _mm256_add_ps(lo[a % N], hi[a % N]) : _mm256_setzero_ps();
  float sums[8];
  _mm256_storeu_ps(sums, ReduceEight(h));
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int t = 0; t < G; ++t) out[r * ldo + t] = sums[r * G + t];
}
#else
template <int R, int G, bool prefetch>
inline void Tile(const float* w, int64_t I, const float* xt, int64_t ldx, float* out, int64_t ldo) {
  static_assert(R * G <= kAccumulators, "more accumulators than registers");
  Vec acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = Zero();
  const int64_t full = I / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Load(w + r * I + k);
    if (prefetch)
      for (int r = 0; r < R; ++r) __builtin_prefetch(w + (kAheadRows + r) * I + k, 0, 1);
    for (int t = 0; t < G; ++t) {
      const Vec xv = Load(xt + t * ldx + k);
      for (int r = 0; r < R; ++r) acc[r * G + t] = Fma(wv[r], xv, acc[r * G + t]);
    }
  }
  if (full < I) {  // the last I % 16 weights; xt is zero there
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = LoadFirst(w + r * I + full, I - full);
    for (int t = 0; t < G; ++t) {
      const Vec xv = Load(xt + t * ldx + full);
      for (int r = 0; r < R; ++r) acc[r * G + t] = Fma(wv[r], xv, acc[r * G + t]);
    }
  }
  float sums[16];
  Store(sums, ReduceSixteen(acc));
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < G; ++t) out[r * ldo + t] = sums[r * G + t];
}
#endif

// Rows [o0, o1) of out [O, T]: per block of R rows, the token groups of G in
// turn (the block's weights, R rows, stay in L1 between the groups).
template <int T>
void Rows(const float* w, int64_t I, const float* xt, int64_t ldx, float* out, int64_t o0, int64_t o1) {
  constexpr int G = std::min(T, kGroupTokens), R = std::min(kMaxRows, kAccumulators / G);
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    Tile<R, G, true>(w + o * I, I, xt, ldx, out + o * T, T);
    for (int g = G; g < T; g += G) Tile<R, G, false>(w + o * I, I, xt + g * ldx, ldx, out + o * T + g, T);
  }
  for (; o < o1; ++o)
    for (int g = 0; g < T; g += G) Tile<1, G, false>(w + o * I, I, xt + g * ldx, ldx, out + o * T + g, T);
}

// Work shared by the calling thread and the pool's tasks (run_on_pool.h):
// an item is a block of rows.
struct Job {
  const float* w;
  float* out;
  std::vector<float> xt;  // [T, ldx] token-major copy of x, zero-padded
  int64_t O, I, T, ldx;
  int64_t rows_per_item, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    const int64_t o0 = item * rows_per_item, o1 = std::min(O, o0 + rows_per_item);
    const float* x = xt.data();
    switch (T) {
      case 1: Rows<1>(w, I, x, ldx, out, o0, o1); break;
      case 2: Rows<2>(w, I, x, ldx, out, o0, o1); break;
      case 4: Rows<4>(w, I, x, ldx, out, o0, o1); break;
      case 8: Rows<8>(w, I, x, ldx, out, o0, o1); break;
      case 16: Rows<16>(w, I, x, ldx, out, o0, o1); break;
      default: Rows<32>(w, I, x, ldx, out, o0, o1); break;
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions(), xd = x.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || xd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("matvec_cpu: w, x and out need rank 2");
  }
  const int64_t T = xd[1];
  if (xd[0] != wd[1] || od[0] != wd[0] || od[1] != T || T < 1 || T > kMaxTokens || (T & (T - 1))) {
    return ffi::Error::InvalidArgument("matvec_cpu: needs w [O, I], x [I, T], out [O, T], T in {1, 2, 4, 8, 16, 32}");
  }
  auto job = std::make_shared<Job>();
  job->w = w.typed_data();
  job->out = out->typed_data();
  job->O = wd[0];
  job->I = wd[1];
  job->T = T;
  job->ldx = (job->I + kLanes - 1) / kLanes * kLanes;
  job->xt.assign(T * job->ldx, 0.0f);
  const float* xs = x.typed_data();
  for (int64_t k = 0; k < job->I; ++k)
    for (int64_t t = 0; t < T; ++t) job->xt[t * job->ldx + k] = xs[k * T + t];
  // About 8 items per thread for balance, each a whole number of 4-row tiles
  // of at least 32 rows.
  const int64_t threads = jaxserve_cpu::Workers(pool);
  job->rows_per_item = std::max<int64_t>(32, (job->O / (8 * threads) + 3) / 4 * 4);
  job->items = (job->O + job->rows_per_item - 1) / job->rows_per_item;
  jaxserve_cpu::RunOnThreads(pool, job, threads, job->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatvecCpu, MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
