// Paged attention for the CPU backend, as an XLA FFI custom call.
//
// Why a hand-written kernel: on the CPU, XLA runs paged attention as batched
// matmuls of tiny [G, D] x [D, block] tiles (G = query heads per kv head, 2
// for llama-56m), one library call per block and kv head, which reaches about
// a quarter of the machine's read bandwidth (BENCHMARKS.md). Attention over a
// paged cache is a stream over the blocks each query token can see: this
// kernel walks them in place (no gathered copy) with an online softmax, and
// its loops over a block's 64 key positions and 64 head dimensions are what
// the compiler vectorises.
//
// Semantics are those of jaxserve.kernels.paged_attention.paged_attention
// for the "blocks" layout in float32:
//   q       f32 [T, KVH, G, D]   queries, already scaled by 1/sqrt(D)
//   k_cache f32 [NB, KVH, D, BS] keys, transposed within a block
//   v_cache f32 [NB, KVH, BS, D]
//   tables  i32 [R, M]           block tables, one row per sequence
//   seq     i32 [T]              the row of each token
//   limit   i32 [T]              keys at positions < limit are visible
//   lower   i32 [T]              ... and at positions >= lower (sliding window; 0 without)
//   sinks   f32 [KVH * G] or [0] a logit per query head joining each row's softmax (gpt-oss); [0]: none
//   logit_softcap (attribute)    > 0: each score s becomes cap * tanh(s / cap) (Gemma 2); 0: off
//   out     f32 [T, KVH, G, D]   zeros where nothing is visible
// A sink is an extra softmax column with no value: the pair's online softmax
// starts from max sink[h] and normaliser 1 rather than -inf and 0 (set once
// per pair, outside the loops). The soft-cap is a template parameter of the
// attention loops (AttendOne), so the path without it has no cap code and
// no branch on it: its arithmetic is unchanged, and
// benchmarks/attention_kernel_ab.py finds its outputs bitwise the same as
// before the features and its time within noise.
// Each (token, kv head) pair is computed by one thread in one fixed order,
// so a token's result never depends on the rest of the batch or on threads.
// In the 64-key-block case with head dim 64, 128 or 256 (the unrolled loops)
// the pair's query heads share each key and value load
// three or two at a time where the host has 32 vector registers (AVX-512), and the
// keys of a block no query can see yet (a prompt's last, partly written
// block) are not scored; neither changes any head's order of operations.
//
// A second entry point (PagedAttentionFmImpl) takes q as the fused
// projection leaves it, feature-major [KVH * G * D, T] and not yet rotated,
// with cos/sin [T, D] and the scale: each thread reads a tile of 16 tokens'
// columns at once (one cache line per feature row), rotates and scales them
// (HF rotate_half), then attends as above.
//
// An int8 cache (jaxserve/kernels/kv_cache.py: QuantizedPages) has its own
// two entry points (PagedAttentionI8Impl, PagedAttentionFmI8Impl): the same
// caches in int8, each with float32 scales [NB, KVH, BS], one per token and
// kv head. The loops are the float32 ones instantiated for int8_t elements
// (the element type KV is a template parameter; `if constexpr` adds the
// int8 work, so the float32 instantiation is the code it was): each int8
// row is widened to floats as it is loaded, a block's scores are multiplied
// by its keys' scales and its softmax weights by its values' scales, so no
// element is dequantized on its own. An int8 key or value row of 64 keys is
// one cache line, a quarter of a float32 one.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;
constexpr int64_t kPrefetchBytes = 512;  // of the next block's keys and of its values
// In the unrolled case, while a block's key (value) rows are read, the
// 256-byte row this many ahead is requested into L2; past the keys' end that
// is the first value rows, past the values' end the next block's first key
// rows (in the order the loops read them: ValueRow).
// A block of one kv head (head dim 64) is two 16 KB runs at a random place: the hardware
// prefetcher stops at every 4 KB page and starts each run cold, and decode
// attention (each key read once) ran at half the machine's read bandwidth.
// Into L2 rather than L1: requests into L1 this far ahead measured slower
// than none (commit 85f1e3c).
constexpr int64_t kAheadRows = 32;

// The 256-byte row at p (64 floats), requested into L2.
inline void PrefetchRow(const float* p) {
  for (int i = 0; i < 64; i += 16) __builtin_prefetch(p + i, 0, 2);
}

// The 64-byte row at p (64 int8 values of an int8 cache), requested into L2.
inline void PrefetchRow(const int8_t* p) { __builtin_prefetch(p, 0, 2); }

// Row p (64 elements: 256 bytes in float32) of a [64 keys][kD dims] value
// block in the order Values reads it: dims 0-63 of every key, then dims 64-127, ...
template <int64_t kD, typename KV>
inline const KV* ValueRow(const KV* vb, int64_t p) {
  if constexpr (kD == 64) return vb + p * 64;  // the same thing, spelt as the loops had it before wider heads
  return vb + (p % 64) * kD + (p / 64) * 64;
}

#if defined(__AVX512F__)
constexpr bool kGroupHeads = true;
#else
constexpr bool kGroupHeads = false;
#endif

struct Shapes {
  int64_t T, KVH, G, D, NB, BS, R, M;
};

// Eight floats as one value (GCC/Clang vector extension): lowered to AVX
// registers where the host has them, to pairs of SSE registers otherwise.
typedef float V8 __attribute__((vector_size(32)));

inline V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The vector of the unrolled score and value loops: sixteen floats
// where the host has AVX-512 (half the instructions of eight), else V8. The
// lane count only splits keys (scores) or dimensions (values) differently;
// every sum is the same chain of operations, so the results are the same.
#if defined(__AVX512F__)
typedef float VW __attribute__((vector_size(64)));
#else
typedef V8 VW;
#endif
constexpr int kW = sizeof(VW) / sizeof(float);

inline VW LoadW(const float* p) {
  VW v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kW int8 values of an int8 cache, widened to floats (exactly: |x| <= 127):
// one sign-extending load (vpmovsxbd) and one conversion (vcvtdq2ps) per
// vector. Written with intrinsics because GCC 12 lowers the same thing
// spelt as __builtin_convertvector (int8 -> float, or int8 -> int32 ->
// float) to a scalar conversion or scalar shifts per lane (seen in the
// disassembly), which made the int8 loops 2.5x slower than the float32 ones.
inline VW LoadW(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<VW>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<VW>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  VW v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// Whether KV is an int8 cache's element (scales to apply) or float32.
template <typename KV>
constexpr bool kQuantized = std::is_same_v<KV, int8_t>;

// exp for the softmax, written so the compiler vectorises it (glibc's expf
// is a call per element): Cephes' range reduction and degree-6 polynomial,
// about 1 ulp in float, inputs clamped to [-87, 88] (masked keys are zeroed
// separately, so the clamp never decides a weight).
[[gnu::always_inline]] inline float VecExp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// tanh for the logit soft-cap, written to vectorise like VecExp (glibc's
// tanhf is a call per element, and the cap runs on every visible score).
// Below |x| = 0.625 the odd polynomial x + x^3 P(x^2) with Cephes' tanhf
// coefficients: no cancellation near 0, where most scaled scores over a
// cap of 20-50 fall, so relative accuracy is kept there. Above it
// 1 - 2 / (exp(2|x|) + 1) with VecExp: 0.55 and more, so the subtraction
// loses at most a bit; the clamp in VecExp makes it exactly 1 past 44.
// Checked against double-precision tanh on [-50, 50] (steps of 2.5e-5):
// at most 1.25 float ulps off (7.4e-8 absolute), far inside the 3e-5 the
// tests hold the kernel to against the pure-JAX kernel
// (tests/test_kernels_cpu.py::test_features_match_the_pure_jax_kernel).
[[gnu::always_inline]] inline float VecTanh(float x) {
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = x + x * z * p;
  const float a = std::fabs(x);
  const float big = 1.0f - 2.0f / (VecExp(2.0f * a) + 1.0f);
  return a < 0.625f ? small : std::copysign(big, x);
}

// Scores of NR query rows (1-3) against one 64-key block (keys transposed:
// kb is [kD dims][64 keys]), for its first NK keys (64, or 32 when only
// those can be visible). The rows share every key load; each row's sums run
// over d in the same order as for one row alone, so a row's scores do not
// depend on which rows it was grouped with.
template <int NK, int NR, int64_t kD, typename KV>
inline void Scores64(const KV* kb, const KV* vb, const float* const* qs, float* const* scs) {
  constexpr int NC = NK / kW;
  VW a[NR][NC] = {};
  for (int64_t d = 0; d < kD; ++d) {
    float x[NR];
    for (int r = 0; r < NR; ++r) x[r] = qs[r][d];
    const KV* krow = kb + d * 64;
    PrefetchRow(d + kAheadRows < kD ? krow + kAheadRows * 64 : ValueRow<kD>(vb, d + kAheadRows - kD));
    for (int i = 0; i < NC; ++i) {
      const VW k = LoadW(krow + kW * i);
      for (int r = 0; r < NR; ++r) a[r][i] += x[r] * k;
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < NC; ++i) std::memcpy(scs[r] + kW * i, &a[r][i], sizeof(VW));
  }
}

// Soft-caps (kCap) and masks a row's block scores to keys [c0, c1) and
// folds them into its online softmax: returns the rescale factor of the
// row's accumulator and leaves the weights (0 outside [c0, c1)) in sc.
// Always inlined, as are VecExp and VecTanh: with the soft-capped and
// wider-head copies of the loops GCC 12 stopped inlining them by itself
// (unit growth limits): a call per head and block, and a scalar call of
// VecExp per score, that the plain 64 x 64 path did not make before them
// (seen in the disassembly).
template <int64_t kBS, bool kCap>
[[gnu::always_inline]] inline float SoftmaxStep(float* sc, int64_t BS, int64_t c0, int64_t c1, float* m, float* l, float cap) {
  // (keys past c1 may not have been computed: Block64's half-block case)
  if constexpr (kCap) {
    const float inv = 1.0f / cap;
    for (int64_t c = 0; c < BS; ++c) sc[c] = (c >= c0 && c < c1) ? cap * VecTanh(sc[c] * inv) : kNeg;
  } else {
    for (int64_t c = 0; c < BS; ++c) sc[c] = (c >= c0 && c < c1) ? sc[c] : kNeg;
  }
  float mx = *m;
  if constexpr (kBS == 64) {  // eight lanes of running maxima, not one 64-long chain
    V8 vm = Load8(sc);
    for (int i = 1; i < 8; ++i) {
      const V8 x = Load8(sc + 8 * i);
      vm = vm > x ? vm : x;
    }
    for (int i = 0; i < 8; ++i) mx = std::max(mx, vm[i]);
  } else {
    for (int64_t c = 0; c < BS; ++c) mx = std::max(mx, sc[c]);
  }
  const float alpha = VecExp(*m - mx);
  float sum = 0.0f;
  for (int64_t c = 0; c < BS; ++c) {
    const float p = (c >= c0 && c < c1) ? VecExp(sc[c] - mx) : 0.0f;
    sc[c] = p;
    sum += p;
  }
  *l = *l * alpha + sum;
  *m = mx;
  return alpha;
}

// NR acc rows (kD dims) rescaled by their alpha and accumulated with their
// weights over keys [c0, c1) of a [64 keys][kD dims] value block, 64 dims at
// a time (the register tile of the head-dim-64 case, so wider heads do not
// spill it); the rows share each value load, and each row's order of
// operations is that of one row alone. nk: the next block's keys (this kv
// head's), to request ahead; or null.
template <int NR, int64_t kD, typename KV>
inline void Values64(const KV* vb, const KV* nk, int64_t c0, int64_t c1, const float* const* ps,
                     const float* alphas, float* const* accs) {
  constexpr int NV = 64 / kW;
  for (int64_t j = 0; j < kD; j += 64) {
    VW o[NR][NV];
    for (int r = 0; r < NR; ++r) {
      for (int i = 0; i < NV; ++i) o[r][i] = alphas[r] * LoadW(accs[r] + j + kW * i);
    }
    for (int64_t c = c0; c < c1; ++c) {
      float w[NR];
      for (int r = 0; r < NR; ++r) w[r] = ps[r][c];
      const KV* vrow = vb + c * kD + j;
      const int64_t ahead = j + c + kAheadRows;  // ValueRow's order: row j + c is this one
      if (ahead < kD) {
        PrefetchRow(ValueRow<kD>(vb, ahead));
      } else if (nk != nullptr) {
        PrefetchRow(nk + (ahead - kD) * 64);
      }
      for (int i = 0; i < NV; ++i) {
        const VW v = LoadW(vrow + kW * i);
        for (int r = 0; r < NR; ++r) o[r][i] += w[r] * v;
      }
    }
    for (int r = 0; r < NR; ++r) {
      for (int i = 0; i < NV; ++i) std::memcpy(accs[r] + j + kW * i, &o[r][i], sizeof(VW));
    }
  }
}

// One 64-key block for query rows g0 .. g0 + NR - 1 of head dim kD. ks/vs:
// an int8 cache's key and value scales of the block's 64 keys (this kv head's).
template <int NR, int64_t kD, bool kCap, typename KV>
inline void Block64(const KV* kb, const KV* vb, const KV* nk, const float* q, int64_t g0, int64_t c0, int64_t c1,
                    float* scores, float* acc, float* m, float* l, float cap, const float* ks, const float* vs) {
  const float* qs[NR];
  float* scs[NR];
  float* accs[NR];
  for (int r = 0; r < NR; ++r) {
    qs[r] = q + (g0 + r) * kD;
    scs[r] = scores + (g0 + r) * 64;
    accs[r] = acc + (g0 + r) * kD;
  }
  if (c1 <= 32) {
    Scores64<32, NR, kD>(kb, vb, qs, scs);
  } else {
    Scores64<64, NR, kD>(kb, vb, qs, scs);
  }
  if constexpr (kQuantized<KV>) {  // a key's scale scales its score (keys past 32 unused when c1 <= 32)
    const int nk_scored = c1 <= 32 ? 32 : 64;
    for (int r = 0; r < NR; ++r) {
      for (int c = 0; c < nk_scored; ++c) scs[r][c] *= ks[c];
    }
  }
  float alphas[NR];
  for (int r = 0; r < NR; ++r) alphas[r] = SoftmaxStep<64, kCap>(scs[r], 64, c0, c1, m + g0 + r, l + g0 + r, cap);
  if constexpr (kQuantized<KV>) {  // a value's scale scales its weight (the normaliser keeps the unscaled ones)
    for (int r = 0; r < NR; ++r) {
      for (int c = 0; c < 64; ++c) scs[r][c] *= vs[c];
    }
  }
  Values64<NR, kD>(vb, nk, c0, c1, scs, alphas, accs);
}

// One (token, kv head) pair: online softmax over the visible blocks.
// kBS/kD > 0 fix the block size and head dim at compile time (blocks of 64
// keys and head dims of 64, 128 or 256, fully unrolled); 0 reads them from
// the shapes. kCap: soft-cap the scores at cap. sink: the pair's G query
// heads' sink logits, or null. KV: the caches' element type (float, or
// int8_t with k_scale/v_scale [NB, KVH, BS] offset to this kv head; null for float).
template <int64_t kBS, int64_t kD, bool kCap, typename KV>
void AttendOne(const Shapes& s, const float* q, const KV* k_cache, const KV* v_cache, const float* k_scale,
               const float* v_scale, const int32_t* tables, int32_t row, int32_t limit, int32_t lower, float cap,
               const float* sink, float* out, float* scores, float* acc, float* m, float* l) {
  const int64_t G = s.G;
  const int64_t D = kD ? kD : s.D;
  const int64_t BS = kBS ? kBS : s.BS;
  std::fill(out, out + G * D, 0.0f);
  lower = std::max<int32_t>(lower, 0);
  if (row < 0 || row >= s.R || limit <= lower) return;
  std::fill(acc, acc + G * D, 0.0f);
  if (sink != nullptr) {  // the sink column: exp(sink - sink) = 1 before any key
    for (int64_t g = 0; g < G; ++g) m[g] = sink[g];
    std::fill(l, l + G, 1.0f);
  } else {
    std::fill(m, m + G, kNeg);
    std::fill(l, l + G, 0.0f);
  }
  const int64_t first = lower / BS, last = (static_cast<int64_t>(limit) - 1) / BS;
  for (int64_t j = first; j <= last && j < s.M; ++j) {
    const int32_t block = tables[row * s.M + j];
    if (block < 0 || block >= s.NB) continue;  // never valid in a table; skipped, not read
    const int64_t base = j * BS;
    const int64_t c0 = std::max<int64_t>(0, lower - base);
    const int64_t c1 = std::min<int64_t>(BS, limit - base);
    const KV* kb = k_cache + block * s.KVH * D * BS;  // [D, BS] of this kv head (offset by the caller)
    const KV* vb = v_cache + block * s.KVH * BS * D;  // [BS, D]
    const float* ksb = nullptr;  // an int8 cache's scales of this block's keys and values: [BS] each
    const float* vsb = nullptr;
    if constexpr (kQuantized<KV>) {
      ksb = k_scale + block * s.KVH * BS;
      vsb = v_scale + block * s.KVH * BS;
    }
    // The next block lies elsewhere in memory (blocks are allocated in any
    // order): ask for its first cache lines now, so they are not a stall per
    // page; in the unrolled case the rows after them are asked for as this
    // block's are read (kAheadRows). (Prefetching every line of both blocks
    // at once cost more than it saved: 256 instructions a block, mostly for
    // lines a prefill chunk's earlier tokens had already brought in;
    // measured for commit d481bd6.)
    const KV* next_kb = nullptr;  // this kv head's keys of the next block
    if (j < last && j + 1 < s.M) {
      const int32_t next = tables[row * s.M + j + 1];
      if (next >= 0 && next < s.NB) {
        next_kb = k_cache + next * s.KVH * D * BS;
        const char* nk = reinterpret_cast<const char*>(next_kb);
        const char* nv = reinterpret_cast<const char*>(v_cache + next * s.KVH * BS * D);
        for (int64_t off = 0; off < kPrefetchBytes; off += 64) {
          __builtin_prefetch(nk + off, 0, 2);
          __builtin_prefetch(nv + off, 0, 2);
        }
        if constexpr (kQuantized<KV>) {  // and the next block's scales (256 bytes each at 64 keys)
          const char* nks = reinterpret_cast<const char*>(k_scale + next * s.KVH * BS);
          const char* nvs = reinterpret_cast<const char*>(v_scale + next * s.KVH * BS);
          for (int64_t off = 0; off < BS * 4; off += 64) {
            __builtin_prefetch(nks + off, 0, 2);
            __builtin_prefetch(nvs + off, 0, 2);
          }
        }
      }
    }
    if constexpr (kBS == 64 && kD > 0) {
      // With 32 vector registers (AVX-512), query heads go in threes (when
      // G is a multiple of 3: SmolLM2's 9 over 3) or pairs: each key and
      // value row is loaded once for the group (three rows hold 12
      // accumulators of 16 floats). With 16 (AVX2) a pair's 16 accumulators
      // of 8 floats would spill, so each head runs alone. Threes against a
      // pair and then the third (29e6eb1): 64 sequences at context 192, 30
      // layers of 9 over 3 heads, 37.8 -> 32.9 ms (1.148x, bitwise the same;
      // benchmarks/attention_kernel_ab.py --baseline 48fba6f --kv-heads 3
      // --group 3 --layers 30, attention-kernel-ab-2026-12-06T040951Z.json).
      int64_t g = 0;
      if constexpr (kGroupHeads) {
        if (G % 3 == 0) {
          for (; g + 2 < G; g += 3) {
            Block64<3, kD, kCap>(kb, vb, next_kb, q, g, c0, c1, scores, acc, m, l, cap, ksb, vsb);
          }
        }
        for (; g + 1 < G; g += 2) Block64<2, kD, kCap>(kb, vb, next_kb, q, g, c0, c1, scores, acc, m, l, cap, ksb, vsb);
      }
      for (; g < G; ++g) Block64<1, kD, kCap>(kb, vb, next_kb, q, g, c0, c1, scores, acc, m, l, cap, ksb, vsb);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* __restrict sc = scores + g * BS;
      const float* qg = q + g * D;
      for (int64_t c = 0; c < BS; ++c) sc[c] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qg[d];
        const KV* __restrict krow = kb + d * BS;
        for (int64_t c = 0; c < BS; ++c) sc[c] += qd * static_cast<float>(krow[c]);
      }
      if constexpr (kQuantized<KV>) {
        for (int64_t c = 0; c < BS; ++c) sc[c] *= ksb[c];
      }
      const float alpha = SoftmaxStep<0, kCap>(sc, BS, c0, c1, m + g, l + g, cap);
      float* __restrict ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
      for (int64_t c = c0; c < c1; ++c) {
        float p = sc[c];
        if constexpr (kQuantized<KV>) p *= vsb[c];
        const KV* __restrict vrow = vb + c * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(vrow[d]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] == 0.0f ? 0.0f : 1.0f / l[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

template <typename KV>
using AttendFn = void (*)(const Shapes&, const float*, const KV*, const KV*, const float*, const float*,
                         const int32_t*, int32_t, int32_t, int32_t, float, const float*, float*, float*, float*,
                         float*, float*);

// The AttendOne for these shapes: the unrolled loops for blocks of 64 keys
// and head dims of 64 (llama-56m, SmolLM2, gpt-oss), 128 (Qwen3, Llama 3) or
// 256 (Gemma), the generic ones otherwise.
template <bool kCap, typename KV>
AttendFn<KV> PickAttend(const Shapes& s) {
  if (s.BS == 64) {
    if (s.D == 64) return AttendOne<64, 64, kCap, KV>;
    if (s.D == 128) return AttendOne<64, 128, kCap, KV>;
    if (s.D == 256) return AttendOne<64, 256, kCap, KV>;
  }
  return AttendOne<0, 0, kCap, KV>;
}

// Work shared by the calling thread and the pool's tasks (run_on_pool.h).
// KV: the caches' element type; ks/vs: an int8 cache's scales [NB, KVH, BS].
template <typename KV>
struct Job {
  Shapes s;
  const float* q;
  const KV *k, *v;
  const float *ks = nullptr, *vs = nullptr;
  const int32_t *tables, *seq, *limit, *lower;
  float* out;
  int64_t items, chunk;
  float softcap = 0.0f;             // > 0: soft-cap the scores at it
  const float* sinks = nullptr;     // [KVH * G] sink logits, or null
  // Feature-major queries (``q`` is then [KVH * G * D, T], not rotated and not
  // scaled): each thread rotates (cos/sin [T, D]) and scales a tile of
  // tokens' queries at a time (LoadQueries) before attending with them.
  bool feature_major = false;
  const float *cos = nullptr, *sin = nullptr;
  float scale = 1.0f;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  static constexpr int64_t kTile = 16;  // tokens whose queries are read together

  // The queries of tokens [t0, t0 + n), rotated (HF rotate_half) and scaled,
  // token-major into qtile [n, KVH * G * D]. Reading kTile columns of each
  // feature row at once touches one cache line per row, not one per value.
  void LoadQueries(int64_t t0, int64_t n, float* qtile) const {
    const int64_t HD = s.KVH * s.G * s.D, D = s.D, half = s.D / 2;
    for (int64_t r = 0; r < HD; ++r) {
      const float* src = q + r * s.T + t0;
      for (int64_t j = 0; j < n; ++j) qtile[j * HD + r] = src[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* c = cos + (t0 + j) * D;
      const float* sn = sin + (t0 + j) * D;
      for (int64_t head = 0; head < HD / D; ++head) {
        float* x = qtile + j * HD + head * D;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = x[d], x2 = x[d + half];
          x[d] = (x1 * c[d] - x2 * sn[d]) * scale;
          x[d + half] = (x2 * c[d + half] + x1 * sn[d + half]) * scale;
        }
      }
    }
  }

  void Run() {
    const int64_t GD = s.G * s.D;
    std::vector<float> scores(s.G * s.BS), acc(GD), m(s.G), l(s.G);
    // (sized for the step's tokens: at one token a 16-token tile was 110 KB
    // to zero in each of a SmolLM2 step's 30 calls)
    std::vector<float> qtile(feature_major ? std::min(kTile, s.T) * s.KVH * GD : 0);
    int64_t finished = 0;
    const AttendFn<KV> attend = softcap > 0.0f ? PickAttend<true, KV>(s) : PickAttend<false, KV>(s);
    for (;;) {
      const int64_t start = next.fetch_add(chunk);
      if (start >= items) break;
      const int64_t stop = std::min(items, start + chunk);
      int64_t tile0 = -1, tile_n = 0;
      for (int64_t it = start; it < stop; ++it) {
        const int64_t t = it / s.KVH, h = it % s.KVH;
        const float* qi = q + it * GD;
        if (feature_major) {
          if (t < tile0 || t >= tile0 + tile_n) {
            tile0 = t;
            tile_n = std::min<int64_t>(kTile, (stop - 1) / s.KVH + 1 - t);
            LoadQueries(tile0, tile_n, qtile.data());
          }
          qi = qtile.data() + ((t - tile0) * s.KVH + h) * GD;
        }
        // this kv head's slice of the block: the caches are [NB, KVH, ...]
        attend(s, qi, k + h * s.D * s.BS, v + h * s.BS * s.D, ks == nullptr ? nullptr : ks + h * s.BS,
               vs == nullptr ? nullptr : vs + h * s.BS, tables, seq[t], limit[t], lower[t], softcap,
               sinks == nullptr ? nullptr : sinks + h * s.G, out + it * GD, scores.data(), acc.data(), m.data(),
               l.data());
      }
      finished += stop - start;
    }
    done.fetch_add(finished);
  }
};

// Runs a prepared job on the calling thread and the pool's.
template <typename KV>
void RunJob(ffi::ThreadPool& pool, const std::shared_ptr<Job<KV>>& job) {
  job->items = job->s.T * job->s.KVH;
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(jaxserve_cpu::Workers(pool) - 1, job->items / 8));
  job->chunk = std::max<int64_t>(1, job->items / (8 * (helpers + 1)));
  if (job->feature_major) {  // whole tiles of tokens per chunk, so each tile's queries are read once
    const int64_t tile = Job<KV>::kTile * job->s.KVH;
    job->chunk = (job->chunk + tile - 1) / tile * tile;
  }
  jaxserve_cpu::RunOnPool(pool, job, helpers, job->items);
}

template <ffi::DataType T>
ffi::Error CheckCaches(const Shapes& s, ffi::Buffer<T>& k_cache, ffi::Buffer<T>& v_cache,
                       ffi::Buffer<ffi::S32>& seq, ffi::Buffer<ffi::S32>& limit, ffi::Buffer<ffi::S32>& lower,
                       ffi::Buffer<ffi::F32>& sinks, float softcap) {
  const auto kd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (kd[1] != s.KVH || kd[2] != s.D || vd[0] != s.NB || vd[1] != s.KVH || vd[2] != s.BS || vd[3] != s.D) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: cache shapes do not match q");
  }
  if (seq.element_count() != s.T || limit.element_count() != s.T || lower.element_count() != s.T) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: seq, limit and lower need one entry per token");
  }
  if (sinks.element_count() != 0 && sinks.element_count() != s.KVH * s.G) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: sinks need one logit per query head, or none");
  }
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: logit_softcap must be finite and >= 0 (0: off)");
  }
  return ffi::Error::Success();
}

// An int8 cache's scales: [NB, KVH, BS] each, as the caches' blocks.
ffi::Error CheckScales(const Shapes& s, ffi::Buffer<ffi::F32>& k_scale, ffi::Buffer<ffi::F32>& v_scale) {
  const auto kd = k_scale.dimensions(), vd = v_scale.dimensions();
  if (kd.size() != 3 || vd.size() != 3 || kd[0] != s.NB || kd[1] != s.KVH || kd[2] != s.BS || vd[0] != s.NB ||
      vd[1] != s.KVH || vd[2] != s.BS) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: int8 cache scales must be [NB, KVH, BS]");
  }
  return ffi::Error::Success();
}

// The shapes of token-major queries q [T, KVH, G, D] (already rotated and
// scaled) and of the caches and block tables they attend over.
template <ffi::DataType T>
ffi::Error TokenMajorShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<T>& k_cache, ffi::Buffer<T>& v_cache,
                            ffi::Buffer<ffi::S32>& tables, Shapes* s) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: q, k, v need rank 4 and tables rank 2");
  }
  *s = Shapes{qd[0], qd[1], qd[2], qd[3], kd[0], kd[3], td[0], td[1]};
  return ffi::Error::Success();
}

// The same for feature-major queries q [KVH * G * D, T] (PagedAttentionFmImpl)
// with their cos and sin [T, D]; G and D are out's [T, KVH, G, D].
template <ffi::DataType T>
ffi::Error FeatureMajorShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& cos, ffi::Buffer<ffi::F32>& sin,
                              ffi::Buffer<T>& k_cache, ffi::Buffer<T>& v_cache, ffi::Buffer<ffi::S32>& tables,
                              ffi::ResultBuffer<ffi::F32>& out, Shapes* s) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions(), td = tables.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 2 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || od.size() != 4) {
    return ffi::Error::InvalidArgument("paged_attention_cpu_fm: q needs rank 2, k, v and out rank 4, tables rank 2");
  }
  *s = Shapes{qd[1], od[1], od[2], od[3], kd[0], kd[3], td[0], td[1]};
  if (od[0] != s->T || qd[0] != s->KVH * s->G * s->D || s->D % 2) {
    return ffi::Error::InvalidArgument("paged_attention_cpu_fm: q rows must be KVH * G * D (D even), one column per token");
  }
  if (cos.element_count() != s->T * s->D || sin.element_count() != s->T * s->D) {
    return ffi::Error::InvalidArgument("paged_attention_cpu_fm: cos and sin need [T, D]");
  }
  return ffi::Error::Success();
}

// Feature-major queries' rotation (cos/sin [T, D]) and scale: Job's.
struct Rope {
  ffi::Buffer<ffi::F32>* cos;
  ffi::Buffer<ffi::F32>* sin;
  float scale;
};

// The four entry points' work: checks the shapes (rope: feature-major
// queries', null for token-major ones) and the caches (T: F32, or S8 with
// k_scale/v_scale, null for F32), fills the job and runs it.
template <ffi::DataType T>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<T>& k_cache,
                  ffi::Buffer<ffi::F32>* k_scale, ffi::Buffer<T>& v_cache, ffi::Buffer<ffi::F32>* v_scale,
                  ffi::Buffer<ffi::S32>& tables, ffi::Buffer<ffi::S32>& seq, ffi::Buffer<ffi::S32>& limit,
                  ffi::Buffer<ffi::S32>& lower, ffi::Buffer<ffi::F32>& sinks, float softcap, const Rope* rope,
                  ffi::ResultBuffer<ffi::F32>& out) {
  using KV = ffi::NativeType<T>;  // float or int8_t
  Shapes s;
  if (rope == nullptr) {
    if (ffi::Error e = TokenMajorShapes(q, k_cache, v_cache, tables, &s); e.failure()) return e;
  } else {
    if (ffi::Error e = FeatureMajorShapes(q, *rope->cos, *rope->sin, k_cache, v_cache, tables, out, &s); e.failure()) {
      return e;
    }
  }
  if (ffi::Error e = CheckCaches(s, k_cache, v_cache, seq, limit, lower, sinks, softcap); e.failure()) return e;
  if constexpr (kQuantized<KV>) {
    if (ffi::Error e = CheckScales(s, *k_scale, *v_scale); e.failure()) return e;
  }
  auto job = std::make_shared<Job<KV>>();
  if constexpr (kQuantized<KV>) {
    job->ks = k_scale->typed_data();
    job->vs = v_scale->typed_data();
  }
  job->s = s;
  job->q = q.typed_data();
  job->k = reinterpret_cast<const KV*>(k_cache.typed_data());
  job->v = reinterpret_cast<const KV*>(v_cache.typed_data());
  job->tables = tables.typed_data();
  job->seq = seq.typed_data();
  job->limit = limit.typed_data();
  job->lower = lower.typed_data();
  job->out = out->typed_data();
  job->softcap = softcap;
  job->sinks = sinks.element_count() == 0 ? nullptr : sinks.typed_data();
  if (rope != nullptr) {
    job->feature_major = true;
    job->cos = rope->cos->typed_data();
    job->sin = rope->sin->typed_data();
    job->scale = rope->scale;
  }
  RunJob(pool, job);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                              ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> limit,
                              ffi::Buffer<ffi::S32> lower, ffi::Buffer<ffi::F32> sinks, float logit_softcap,
                              ffi::ResultBuffer<ffi::F32> out) {
  return Attend(pool, q, k_cache, nullptr, v_cache, nullptr, tables, seq, limit, lower, sinks, logit_softcap, nullptr,
                out);
}

// PagedAttentionImpl over an int8 cache (the header comment's int8 entry points).
ffi::Error PagedAttentionI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_cache,
                                ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::S8> v_cache,
                                ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> tables,
                                ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> limit, ffi::Buffer<ffi::S32> lower,
                                ffi::Buffer<ffi::F32> sinks, float logit_softcap, ffi::ResultBuffer<ffi::F32> out) {
  return Attend(pool, q, k_cache, &k_scale, v_cache, &v_scale, tables, seq, limit, lower, sinks, logit_softcap,
                nullptr, out);
}

// The same attention for queries straight out of the fused projection,
// feature-major [KVH * G * D, T] and not yet rotated: the kernel applies
// RoPE (cos/sin [T, D]) and the scale as it reads each tile of tokens, so the
// step needs no transposed, rotated copy of q (XLA's fusion for it cost
// about as much as the attention itself in prefill steps).
ffi::Error PagedAttentionFmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                                ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> k_cache,
                                ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> tables,
                                ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> limit,
                                ffi::Buffer<ffi::S32> lower, ffi::Buffer<ffi::F32> sinks, float scale,
                                float logit_softcap, ffi::ResultBuffer<ffi::F32> out) {
  const Rope rope{&cos, &sin, scale};
  return Attend(pool, q, k_cache, nullptr, v_cache, nullptr, tables, seq, limit, lower, sinks, logit_softcap, &rope,
                out);
}

// PagedAttentionFmImpl over an int8 cache.
ffi::Error PagedAttentionFmI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                                  ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S8> k_cache,
                                  ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::S8> v_cache,
                                  ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> tables,
                                  ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> limit,
                                  ffi::Buffer<ffi::S32> lower, ffi::Buffer<ffi::F32> sinks, float scale,
                                  float logit_softcap, ffi::ResultBuffer<ffi::F32> out) {
  const Rope rope{&cos, &sin, scale};
  return Attend(pool, q, k_cache, &k_scale, v_cache, &v_scale, tables, seq, limit, lower, sinks, logit_softcap,
                &rope, out);
}

// The four entry points' FFI bindings, in their parameters' order. They
// differ in two places only: q's layout (feature-major q comes with cos and
// sin, and takes the scale as an attribute) and the cache's element type (an
// int8 cache passes each of its keys and values with their scales). Built
// from one list, so the four cannot drift apart.

template <bool kFeatureMajor, class Binding>
auto QueryArgs(Binding&& binding) {
  if constexpr (kFeatureMajor) {
    return std::move(binding)
        .template Arg<ffi::Buffer<ffi::F32>>()   // q, feature-major [KVH * G * D, T]
        .template Arg<ffi::Buffer<ffi::F32>>()   // cos
        .template Arg<ffi::Buffer<ffi::F32>>();  // sin
  } else {
    return std::move(binding).template Arg<ffi::Buffer<ffi::F32>>();  // q [T, KVH, G, D]
  }
}

template <ffi::DataType kCache, class Binding>
auto CacheArgs(Binding&& binding) {
  if constexpr (kCache == ffi::S8) {
    return std::move(binding)
        .template Arg<ffi::Buffer<ffi::S8>>()    // k_cache
        .template Arg<ffi::Buffer<ffi::F32>>()   // k_scale
        .template Arg<ffi::Buffer<ffi::S8>>()    // v_cache
        .template Arg<ffi::Buffer<ffi::F32>>();  // v_scale
  } else {
    return std::move(binding).template Arg<ffi::Buffer<kCache>>().template Arg<ffi::Buffer<kCache>>();
  }
}

// What follows the caches: the same arguments for all four, the scale
// attribute for feature-major q only.
template <bool kFeatureMajor, class Binding>
auto TableArgsAndAttrs(Binding&& binding) {
  auto args = std::move(binding)
                  .template Arg<ffi::Buffer<ffi::S32>>()   // tables
                  .template Arg<ffi::Buffer<ffi::S32>>()   // seq
                  .template Arg<ffi::Buffer<ffi::S32>>()   // limit
                  .template Arg<ffi::Buffer<ffi::S32>>()   // lower
                  .template Arg<ffi::Buffer<ffi::F32>>();  // sinks
  if constexpr (kFeatureMajor) {
    return std::move(args).template Attr<float>("scale").template Attr<float>("logit_softcap");
  } else {
    return std::move(args).template Attr<float>("logit_softcap");
  }
}

template <ffi::DataType kCache, bool kFeatureMajor>
auto PagedAttentionBinding() {
  auto args = CacheArgs<kCache>(QueryArgs<kFeatureMajor>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
  return TableArgsAndAttrs<kFeatureMajor>(std::move(args)).template Ret<ffi::Buffer<ffi::F32>>();  // out
}

}  // namespace

// (Each binding in parentheses: the macro would take the comma between its
// template arguments for one between its own.)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpu, PagedAttentionImpl,
                              (PagedAttentionBinding<ffi::F32, false>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpuFm, PagedAttentionFmImpl,
                              (PagedAttentionBinding<ffi::F32, true>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpuI8, PagedAttentionI8Impl,
                              (PagedAttentionBinding<ffi::S8, false>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpuFmI8, PagedAttentionFmI8Impl,
                              (PagedAttentionBinding<ffi::S8, true>()));
