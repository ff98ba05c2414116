// Quantized-weight matmul (jaxserve.models.quant's q8_0, q4_0, q4_1) as an
// XLA FFI custom call.
//
//   q     int8 [O, I] (q8_0) or uint8 [O, I / 2] packed nibbles (q4_0, q4_1)
//   scale f16  [O, I / 32]  one per block of 32 input features
//   min   f16  [O, I / 32]  q4_1's per-block min (the other kinds: any f16 array, unread)
//   x     f32  [I, T]       inputs, feature-major
//   out   f32  [O, T]       dequantize(w) @ x, with x quantized as below
//
// The activations are quantized per token and block of 32 features to int8
// with a float32 scale (dx = max|x| * f32(1/127), xq = round(x * (1 / dx))), as
// jaxserve.models.quant.quantize_activations does, and each block's product
// is an exact int32 dot of the weight's integers and xq, then
// out += d * dx * dot (q4_0: dot - 8 * sum(xq); q4_1: + m * dx * sum(xq)).
// Chosen by measurement over float FMAs on widened weights
// (benchmarks/quant_kernel_ab.py, the two alternated in one process over
// one SmolLM2-135M layer and its vocabulary projection, q8_0, medians of 3
// rounds on a shared, heavily loaded 2-core AVX-512 VNNI machine, so
// indicative only): float/integer time 1.87x at 1 token, 1.54x at 2, 1.26x
// at 4, 1.43x at 8, 1.05x at 16 (float FMAs in the same loop), and 2.49x at
// 64 tokens against XLA's float32 matmul on a dequantized copy (the float
// side at its best). With VNNI one vpdpbusd does 64 multiply-adds of bytes
// where an FMA does 16 of floats, and the weights are never widened.
//
// Two loops, by token count:
//
// - decode (T <= 8): every weight row is streamed once; a tile of up to 4
//   rows x up to 4 tokens holds 16-lane float accumulators; per 64 weights
//   (two blocks) and (row, token) one vpdpbusd into an int32 vector that
//   starts at the block's offset correction, one conversion, one FMA with
//   the two blocks' d * dx (lanes 0-7 block 0, 8-15 block 1). The rows 16
//   below a tile are prefetched (T1 hint) as it reads its own. With only
//   the next 256 bytes of each row prefetched, as before, 120 SmolLM2-135M
//   layer products at one token took 6.3-7.5 ms (17 GB/s, 30 distinct
//   layers' weights so nothing stays in cache); with 8, 16 or 32 rows
//   ahead 4.9-5.9 ms (alternated runs of a throwaway probe; 16 is
//   matvec_cpu.cc's distance too), and the int8 one-prompt decode of
//   `suite.py run offline-smollm2` went from 86 to 113-117 tok/s
//   (benchmarks/offline_profile.py --quantization int8 --num-prompts 1).
// - prefill (T > 8): tokens in the vector lanes, 16 a vector, so each
//   4-byte group of a weight row is broadcast once for 2 x 16 tokens and
//   each activation vector serves a tile of 6 rows; a block's 8 vpdpbusd
//   per (row, token vector) are summed in int32 before one conversion and
//   FMA per block, a quarter of the instructions of float FMAs on the same
//   products. At 16 tokens it took 0.47x the decode loop's time, at 8
//   1.30x (the same A/B, mode 2), hence the boundary at 8.
//
// The activations are quantized on the calling thread before the pool
// starts, so that loop is vectorised too (QuantizeDecodeVnni,
// QuantizePrefillVnni): done a scalar at a time, reading a feature-major x
// one token at a time (a cache line per value), it took a third of the
// int8 SmolLM2-135M prefill step (2,048 tokens: 1,956 ms scalar, 1,309 ms
// vectorised; benchmarks/offline_profile.py --quantization int8).
//
// vpdpbusd multiplies unsigned by signed bytes: the weights are the
// unsigned side (the nibbles are 0..15 already; int8 weights are flipped to
// q + 128 with one xor, and the accumulator starts at -128 * sum(xq) per
// block to undo it).
//
// Compile-time dispatch (JAXSERVE_QUANT_VNNI, from quant_blocks.h, which
// also holds the block arithmetic shared with moe_cpu.cc): the intrinsic
// loops need AVX-512 VNNI and BW (this library is built with -march=native
// on the machine that runs it); any other target, AVX2-only EPYCs among
// them, builds the portable loops below, the same integers and formula in
// plain C++ for the compiler to vectorise.
// tests/test_quant_kernels.py checks both builds against a numpy reference.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_blocks.h"  // defines JAXSERVE_QUANT_VNNI where the intrinsic loops build
#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu::quant;  // kGroup, the kinds, HalfToFloat, QuantizeBlock, ...

// Decode: the weight rows this far below a tile are prefetched into L2 as
// the tile reads its own (matvec_cpu.cc's kAheadRows, for the same reason).
constexpr int64_t kDecodeAheadRows = 16;
constexpr int64_t kDecodeMaxTokens = 8;  // above: the prefill loop (benchmarks/quant_kernel_ab.py)

// The activations of one call, quantized (see the header comment).
struct Activations {
  int64_t I = 0, T = 0, G = 0, Tp = 0;
  std::vector<int8_t> xq;     // decode: [T, I] token-major; prefill: [I / 4, Tp, 4]
  std::vector<float> dx;      // decode: [T, G]; prefill: [G, Tp]
  std::vector<int32_t> sx;    // same layout as dx: sum of the block's xq
};

#if defined(JAXSERVE_QUANT_VNNI)
// x [I, T] (feature-major) as token-major rows [T, I].
std::vector<float> TokenMajor(const float* x, int64_t I, int64_t T) {
  std::vector<float> out(static_cast<size_t>(T * I));
  for (int64_t k = 0; k < I; ++k)
    for (int64_t t = 0; t < T; ++t) out[t * I + k] = x[k * T + t];
  return out;
}

// The decode layout's quantization with AVX-512 (quant_blocks.h's
// QuantizeBlock: the same integers as the scalar loop below,
// tests/test_quant_kernels.py): one token's 32 features a block, read from
// x directly at T = 1, from a token-major copy above.
void QuantizeDecodeVnni(const float* x, int64_t I, int64_t T, Activations& a) {
  const int64_t G = a.G;
  const std::vector<float> tm = T > 1 ? TokenMajor(x, I, T) : std::vector<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = T > 1 ? tm.data() + t * I : x;
    for (int64_t b = 0; b < G; ++b) {
      a.dx[t * G + b] = QuantizeBlock(xt + b * kGroup, a.xq.data() + t * I + b * kGroup, &a.sx[t * G + b]);
    }
  }
}

// The prefill layout's quantization with AVX-512, tokens in the lanes: x is
// feature-major, so one block's 32 features of 16 tokens are 32 contiguous
// vector loads. d and 1 / d are computed with explicit rounding (the _round
// forms), which -ffast-math may not rewrite into 127 / amax, so the integers
// are the scalar loop's. Four features of a token are packed into one int32
// lane: one 64-byte store writes xq's [4 features x 16 tokens] group.
void QuantizePrefillVnni(const float* x, int64_t I, int64_t T, Activations& a) {
  const int64_t G = a.G, Tp = a.Tp;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  const __m512 inv127 = _mm512_set1_ps(1.0f / 127.0f);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t t0 = 0; t0 < Tp; t0 += 16) {
    const __mmask16 live = T - t0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (T - t0)) - 1);
    for (int64_t b = 0; b < G; ++b) {
      __m512 v[kGroup];
      __m512 amax = zero;
      for (int k = 0; k < kGroup; ++k) {
        v[k] = _mm512_maskz_loadu_ps(live, x + (b * kGroup + k) * T + t0);
        amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[k]));
      }
      const __m512 d = _mm512_mul_round_ps(amax, inv127, kRound);
      const __m512 inv = _mm512_maskz_div_round_ps(_mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), one, d, kRound);
      __m512i sum = _mm512_setzero_si512();
      for (int k = 0; k < kGroup; k += 4) {
        __m512i packed = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(v[k + j], inv, kRound), kRound);
          sum = _mm512_add_epi32(sum, q);
          packed = _mm512_or_si512(packed, _mm512_slli_epi32(_mm512_and_si512(q, byte), 8 * j));
        }
        _mm512_storeu_si512(a.xq.data() + ((b * kGroup + k) / 4 * Tp + t0) * 4, packed);
      }
      _mm512_storeu_ps(a.dx.data() + b * Tp + t0, d);
      _mm512_storeu_si512(a.sx.data() + b * Tp + t0, sum);
    }
  }
}
#endif

// Quantizes x [I, T] (feature-major): for the decode loop token-major; for
// the prefill loop in groups of 4 features per token, tokens padded to Tp.
void QuantizeActivations(const float* x, int64_t I, int64_t T, bool prefill, Activations& a) {
  a.I = I;
  a.T = T;
  a.G = I / kGroup;
  a.Tp = prefill ? (T + 15) / 16 * 16 : T;
  const int64_t Tp = a.Tp, G = a.G;
  a.xq.assign(static_cast<size_t>(I * Tp), 0);
  a.dx.assign(static_cast<size_t>(G * Tp), 0.0f);
  a.sx.assign(static_cast<size_t>(G * Tp), 0);
#if defined(JAXSERVE_QUANT_VNNI)
  if (!prefill) return QuantizeDecodeVnni(x, I, T, a);
  return QuantizePrefillVnni(x, I, T, a);
#endif
  float v[kGroup];
  int8_t q[kGroup];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < G; ++b) {
      for (int64_t k = 0; k < kGroup; ++k) v[k] = x[(b * kGroup + k) * T + t];
      int32_t sum;
      const float d = QuantizeBlock(v, q, &sum);  // each rounding as the Python side's (quant_blocks.h)
      for (int64_t k = 0; k < kGroup; ++k) {
        const int64_t f = b * kGroup + k;
        if (prefill)
          a.xq[(f / 4 * Tp + t) * 4 + f % 4] = q[k];
        else
          a.xq[t * I + f] = q[k];
      }
      const int64_t at = prefill ? b * Tp + t : t * G + b;
      a.dx[at] = d;
      a.sx[at] = sum;
    }
  }
}

// ------------------------------------------------------------------ portable

// The weight integers of row `row`, block `b` (0..15 nibbles or -127..127).
inline void BlockInts(int32_t kind, const uint8_t* q, int64_t I, int64_t row, int64_t b, int32_t w[kGroup]) {
  if (kind == kQ8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(q) + row * I + b * kGroup;
    for (int k = 0; k < kGroup; ++k) w[k] = p[k];
  } else {
    const uint8_t* p = q + row * (I / 2) + b * (kGroup / 2);
    for (int k = 0; k < kGroup / 2; ++k) {
      w[k] = p[k] & 0x0F;
      w[k + kGroup / 2] = p[k] >> 4;
    }
  }
}

// The weight's contribution for block b of token t: d * dx * (dot + offset) (+ m * dx * sum).
inline float BlockTerm(int32_t kind, int32_t dot, int32_t sx, float d, float m, float dx) {
  if (kind == kQ4_0) dot -= 8 * sx;
  float r = d * dx * static_cast<float>(dot);
  if (kind == kQ4_1) r += m * (dx * static_cast<float>(sx));
  return r;
}

void PortableRows(int32_t kind, const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
                  bool prefill, float* out, int64_t o0, int64_t o1) {
  const int64_t I = a.I, T = a.T, G = a.G, Tp = a.Tp;
  int32_t w[kGroup];
  std::vector<float> acc(static_cast<size_t>(T));
  for (int64_t o = o0; o < o1; ++o) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < G; ++b) {
      BlockInts(kind, q, I, o, b, w);
      const float d = HalfToFloat(scale[o * G + b]);
      const float m = kind == kQ4_1 ? HalfToFloat(mins[o * G + b]) : 0.0f;
      for (int64_t t = 0; t < T; ++t) {
        int32_t dot = 0;
        for (int k = 0; k < kGroup; ++k) {
          const int64_t f = b * kGroup + k;
          const int8_t xv = prefill ? a.xq[(f / 4 * Tp + t) * 4 + f % 4] : a.xq[t * I + f];
          dot += w[k] * xv;
        }
        const int64_t at = prefill ? b * Tp + t : t * G + b;
        acc[t] += BlockTerm(kind, dot, a.sx[at], d, m, a.dx[at]);
      }
    }
    for (int64_t t = 0; t < T; ++t) out[o * T + t] = acc[t];
  }
}

#if defined(JAXSERVE_QUANT_VNNI)
// ------------------------------------------------------------------ VNNI

// The f32 vector [h[0] x 8, h[1] x 8] of two consecutive float16 values.
inline __m512 PairOfHalves(const uint16_t* h) {
  const __m256i idx = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  uint32_t two;
  std::memcpy(&two, h, sizeof two);
  return _mm512_cvtph_ps(_mm256_permutexvar_epi16(idx, _mm256_castsi128_si256(_mm_cvtsi32_si128(two))));
}

inline __m512 OneHalf(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(*h)));
}

// Per token and chunk of 64 features, what the decode loop adds to each
// block's lanes: the int32 start (offset correction spread over the 8 lanes
// of a block), dx, and dx * sum(xq) (q4_1).
struct DecodeTokenVectors {
  std::vector<int32_t> start;  // [T, chunks, 16]
  std::vector<float> dx, dxs;  // [T, chunks, 16]
};

void BuildDecodeVectors(int32_t kind, const Activations& a, DecodeTokenVectors& v) {
  const int64_t chunks = (a.G + 1) / 2, T = a.T, G = a.G;
  v.start.assign(static_cast<size_t>(T * chunks * 16), 0);
  v.dx.assign(static_cast<size_t>(T * chunks * 16), 0.0f);
  v.dxs.assign(static_cast<size_t>(T * chunks * 16), 0.0f);
  // q8_0 flips weights to q + 128 (subtract 128 * sum / 8 lanes = 16 * sum
  // a lane); q4_0 subtracts 8 * sum (sum a lane)
  const int32_t per_lane = WeightOffset(kind) / 8;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < G; ++b) {
      const int64_t base = (t * chunks + b / 2) * 16 + (b % 2) * 8;
      for (int l = 0; l < 8; ++l) {
        v.start[base + l] = -per_lane * a.sx[t * G + b];
        v.dx[base + l] = a.dx[t * G + b];
        v.dxs[base + l] = a.dx[t * G + b] * static_cast<float>(a.sx[t * G + b]) * 0.125f;  // 8 lanes a block
      }
    }
}

// 64 weights (two blocks) of one row as unsigned bytes in feature order;
// `half`: only the first block (the last, odd block of a row).
template <int32_t kind>
inline __m512i LoadWeights(const uint8_t* row, int64_t c, bool half) {
  if (kind == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i w = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + c * 64) : _mm512_loadu_si512(row + c * 64);
    return half ? _mm512_maskz_xor_epi32(0x00FF, w, flip) : _mm512_xor_si512(w, flip);
  } else {
    return UnpackNibbles(half ? _mm256_maskz_loadu_epi8(0xFFFFu, row + c * 32)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
  }
}

template <int32_t kind, int R, int GT>
void DecodeTile(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
                const DecodeTokenVectors& v, int64_t o, int64_t t0, float* out) {
  const int64_t I = a.I, G = a.G, chunks = (G + 1) / 2;
  const int64_t row_bytes = kind == kQ8_0 ? I : I / 2;
  __m512 acc[R][GT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < GT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const bool half = 2 * c + 1 == G;
    __m512i w[R];
    __m512 d[R], m[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = q + (o + r) * row_bytes;
      __builtin_prefetch(row + kDecodeAheadRows * row_bytes + c * (kind == kQ8_0 ? 64 : 32), 0, 1);
      w[r] = LoadWeights<kind>(row, c, half);
      d[r] = half ? OneHalf(scale + (o + r) * G + 2 * c) : PairOfHalves(scale + (o + r) * G + 2 * c);
      if (kind == kQ4_1) m[r] = half ? OneHalf(mins + (o + r) * G + 2 * c) : PairOfHalves(mins + (o + r) * G + 2 * c);
    }
    for (int t = 0; t < GT; ++t) {
      const int64_t tt = t0 + t;
      const __m512i xv = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, a.xq.data() + tt * I + c * 64)
                              : _mm512_loadu_si512(a.xq.data() + tt * I + c * 64);
      const int64_t vi = (tt * chunks + c) * 16;
      const __m512i start = _mm512_loadu_si512(v.start.data() + vi);
      const __m512 dx = _mm512_loadu_ps(v.dx.data() + vi);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(start, w[r], xv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[r], dx), acc[r][t]);
        if (kind == kQ4_1) acc[r][t] = _mm512_fmadd_ps(m[r], _mm512_loadu_ps(v.dxs.data() + vi), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < GT; ++t) out[(o + r) * a.T + t0 + t] = _mm512_reduce_add_ps(acc[r][t]);
}

template <int32_t kind>
void DecodeRows(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
                const DecodeTokenVectors& v, float* out, int64_t o0, int64_t o1) {
  const int64_t T = a.T;
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) DecodeTile<kind, 2, 4>(q, scale, mins, a, v, o, t, out), DecodeTile<kind, 2, 4>(q, scale, mins, a, v, o + 2, t, out);
    for (; t + 2 <= T; t += 2) DecodeTile<kind, 4, 2>(q, scale, mins, a, v, o, t, out);
    for (; t < T; ++t) DecodeTile<kind, 4, 1>(q, scale, mins, a, v, o, t, out);
  }
  for (; o < o1; ++o)
    for (int64_t t = 0; t < T; ++t) DecodeTile<kind, 1, 1>(q, scale, mins, a, v, o, t, out);
}

// Per block and token: the int32 start (-128 * sum for q8_0, -8 * sum for
// q4_0, 0 for q4_1), for the prefill loop's token-lane vectors.
void BuildPrefillStarts(int32_t kind, const Activations& a, std::vector<int32_t>& start, std::vector<float>& dxs) {
  const int32_t per_block = WeightOffset(kind);
  start.resize(a.sx.size());
  dxs.resize(a.sx.size());
  for (size_t i = 0; i < a.sx.size(); ++i) {
    start[i] = -per_block * a.sx[i];
    dxs[i] = a.dx[i] * static_cast<float>(a.sx[i]);
  }
}

// The 4-byte group j (0..7) of block b of a row as unsigned weight bytes.
template <int32_t kind>
inline uint32_t WeightGroup(const uint8_t* row, int64_t b, int j) {
  uint32_t v;
  if (kind == kQ8_0) {
    std::memcpy(&v, row + b * kGroup + 4 * j, 4);
    return v ^ 0x80808080u;
  }
  std::memcpy(&v, row + b * (kGroup / 2) + 4 * (j & 3), 4);
  return (j < 4 ? v : v >> 4) & 0x0F0F0F0Fu;
}

// out rows [o, o + R), token columns [t0, t0 + 16 * TV): tokens in lanes.
template <int32_t kind, int R, int TV>
void PrefillTile(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
                 const int32_t* start, const float* dxs, int64_t o, int64_t t0, float* out) {
  const int64_t I = a.I, G = a.G, Tp = a.Tp, T = a.T;
  const int64_t row_bytes = kind == kQ8_0 ? I : I / 2;
  __m512 acc[R][TV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    __m512i dot[R][TV];
    for (int j = 0; j < TV; ++j) {
      const __m512i s = _mm512_loadu_si512(start + b * Tp + t0 + 16 * j);
      for (int r = 0; r < R; ++r) dot[r][j] = s;
    }
    for (int g = 0; g < 8; ++g) {
      __m512i xv[TV];
      for (int j = 0; j < TV; ++j) xv[j] = _mm512_loadu_si512(a.xq.data() + ((b * 8 + g) * Tp + t0 + 16 * j) * 4);
      for (int r = 0; r < R; ++r) {
        const __m512i wb = _mm512_set1_epi32(static_cast<int>(WeightGroup<kind>(q + (o + r) * row_bytes, b, g)));
        for (int j = 0; j < TV; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], wb, xv[j]);
      }
    }
    __m512 dx[TV];
    for (int j = 0; j < TV; ++j) dx[j] = _mm512_loadu_ps(a.dx.data() + b * Tp + t0 + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 d = OneHalf(scale + (o + r) * G + b);
      for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), _mm512_mul_ps(d, dx[j]), acc[r][j]);
      if (kind == kQ4_1) {
        const __m512 m = OneHalf(mins + (o + r) * G + b);
        for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(dxs + b * Tp + t0 + 16 * j), acc[r][j]);
      }
    }
  }
  for (int j = 0; j < TV; ++j) {
    const int64_t c = t0 + 16 * j;
    if (c >= T) break;
    const __mmask16 keep = T - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (T - c)) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (o + r) * T + c, keep, acc[r][j]);
  }
}

template <int32_t kind>
void PrefillRows(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
                 const int32_t* start, const float* dxs, float* out, int64_t o0, int64_t o1) {
  const int64_t Tp = a.Tp;
  int64_t o = o0;
  for (; o + 6 <= o1; o += 6) {
    int64_t t = 0;
    for (; t + 32 <= Tp; t += 32) PrefillTile<kind, 6, 2>(q, scale, mins, a, start, dxs, o, t, out);
    if (t < Tp) PrefillTile<kind, 6, 1>(q, scale, mins, a, start, dxs, o, t, out);
  }
  for (; o < o1; ++o) {
    int64_t t = 0;
    for (; t + 32 <= Tp; t += 32) PrefillTile<kind, 1, 2>(q, scale, mins, a, start, dxs, o, t, out);
    if (t < Tp) PrefillTile<kind, 1, 1>(q, scale, mins, a, start, dxs, o, t, out);
  }
}

// The measured alternative at decode sizes (mode 1, benchmarks/quant_kernel_ab.py
// only): float activations, each 16 weights widened to float and scaled by
// their block's d (and min), one FMA per token.
template <int32_t kind>
inline void WidenWeights(const uint8_t* row, int64_t c, __m512 d0, __m512 d1, __m512 m0, __m512 m1, __m512 w[4]) {
  __m128i b[4];
  if (kind == kQ8_0) {
    for (int s = 0; s < 4; ++s) b[s] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 64 + 16 * s));
    for (int s = 0; s < 4; ++s) w[s] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b[s]));
  } else {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h) {
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32 + 16 * h));
      b[2 * h] = _mm_and_si128(p, mask);
      b[2 * h + 1] = _mm_and_si128(_mm_srli_epi16(p, 4), mask);
    }
    for (int s = 0; s < 4; ++s) w[s] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b[s]));
    if (kind == kQ4_0)
      for (int s = 0; s < 4; ++s) w[s] = _mm512_sub_ps(w[s], _mm512_set1_ps(8.0f));
  }
  for (int s = 0; s < 4; ++s) w[s] = _mm512_mul_ps(w[s], s < 2 ? d0 : d1);
  if (kind == kQ4_1)
    for (int s = 0; s < 4; ++s) w[s] = _mm512_add_ps(w[s], s < 2 ? m0 : m1);
}

template <int32_t kind, int GT>
void FloatDecodeRow(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const float* xt, int64_t I,
                    int64_t T, int64_t o, int64_t t0, float* out) {
  const int64_t G = I / kGroup, row_bytes = kind == kQ8_0 ? I : I / 2;
  const uint8_t* row = q + o * row_bytes;
  __m512 acc[GT];
  for (int t = 0; t < GT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < G / 2; ++c) {
    const __m512 d0 = OneHalf(scale + o * G + 2 * c), d1 = OneHalf(scale + o * G + 2 * c + 1);
    const __m512 m0 = kind == kQ4_1 ? OneHalf(mins + o * G + 2 * c) : d0;
    const __m512 m1 = kind == kQ4_1 ? OneHalf(mins + o * G + 2 * c + 1) : d1;
    __m512 w[4];
    WidenWeights<kind>(row, c, d0, d1, m0, m1, w);
    for (int t = 0; t < GT; ++t)
      for (int s = 0; s < 4; ++s) acc[t] = _mm512_fmadd_ps(w[s], _mm512_loadu_ps(xt + (t0 + t) * I + c * 64 + 16 * s), acc[t]);
  }
  for (int t = 0; t < GT; ++t) out[o * T + t0 + t] = _mm512_reduce_add_ps(acc[t]);
}

template <int32_t kind>
void FloatDecodeRows(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const float* xt, int64_t I,
                     int64_t T, float* out, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) FloatDecodeRow<kind, 4>(q, scale, mins, xt, I, T, o, t, out);
    for (; t < T; ++t) FloatDecodeRow<kind, 1>(q, scale, mins, xt, I, T, o, t, out);
  }
}
#endif  // JAXSERVE_QUANT_VNNI

struct Job {
  int32_t kind;
  const uint8_t* q;
  const uint16_t *scale, *mins;
  float* out;
  int64_t O;
  bool prefill;
  bool float_decode = false;  // mode 1 (see FloatDecodeRow)
  std::vector<float> xt;      // mode 1: x token-major [T, I]
  Activations a;
#if defined(JAXSERVE_QUANT_VNNI)
  DecodeTokenVectors dv;
  std::vector<int32_t> start;
  std::vector<float> dxs;
#endif
  int64_t rows_per_item, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    const int64_t o0 = item * rows_per_item, o1 = std::min(O, o0 + rows_per_item);
#if defined(JAXSERVE_QUANT_VNNI)
    if (float_decode) {
      const int64_t I = a.I, T = a.T;
      switch (kind) {
        case kQ8_0: FloatDecodeRows<kQ8_0>(q, scale, mins, xt.data(), I, T, out, o0, o1); break;
        case kQ4_0: FloatDecodeRows<kQ4_0>(q, scale, mins, xt.data(), I, T, out, o0, o1); break;
        default: FloatDecodeRows<kQ4_1>(q, scale, mins, xt.data(), I, T, out, o0, o1); break;
      }
    } else if (prefill) {
      switch (kind) {
        case kQ8_0: PrefillRows<kQ8_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        case kQ4_0: PrefillRows<kQ4_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        default: PrefillRows<kQ4_1>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
      }
    } else {
      switch (kind) {
        case kQ8_0: DecodeRows<kQ8_0>(q, scale, mins, a, dv, out, o0, o1); break;
        case kQ4_0: DecodeRows<kQ4_0>(q, scale, mins, a, dv, out, o0, o1); break;
        default: DecodeRows<kQ4_1>(q, scale, mins, a, dv, out, o0, o1); break;
      }
    }
#else
    PortableRows(kind, q, scale, mins, a, prefill, out, o0, o1);
#endif
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error QmatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer mins,
                       ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out, int32_t kind, int32_t mode) {
  const auto qd = q.dimensions(), sd = scale.dimensions(), xd = x.dimensions(), od = out->dimensions();
  if (qd.size() != 2 || sd.size() != 2 || xd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("qmatmul_cpu: q, scale, x and out need rank 2");
  }
  if (kind < kQ8_0 || kind > kQ4_1) return ffi::Error::InvalidArgument("qmatmul_cpu: kind must be 0, 1 or 2");
  const int64_t O = qd[0], I = kind == kQ8_0 ? qd[1] : 2 * qd[1], T = xd[1];
  if (I % kGroup || xd[0] != I || sd[0] != O || sd[1] != I / kGroup || od[0] != O || od[1] != T || T < 1) {
    return ffi::Error::InvalidArgument("qmatmul_cpu: needs q [O, I or I/2], scale [O, I/32], x [I, T], out [O, T]");
  }
  if (kind == kQ4_1 && (mins.dimensions().size() != 2 || mins.dimensions()[0] != O || mins.dimensions()[1] != I / kGroup)) {
    return ffi::Error::InvalidArgument("qmatmul_cpu: q4_1 needs min [O, I/32]");
  }
  auto job = std::make_shared<Job>();
  job->kind = kind;
  job->q = static_cast<const uint8_t*>(q.untyped_data());
  job->scale = static_cast<const uint16_t*>(scale.untyped_data());
  job->mins = static_cast<const uint16_t*>(mins.untyped_data());
  job->out = out->typed_data();
  job->O = O;
  job->prefill = T > kDecodeMaxTokens || mode == 2;  // mode 2: the prefill loop at any T (A/B)
#if defined(JAXSERVE_QUANT_VNNI)
  if (mode == 1 && T <= 16 && (I / kGroup) % 2 == 0) {  // the A/B alternative
    job->float_decode = true;
    job->prefill = false;
    job->a.I = I;
    job->a.T = T;
    job->xt = TokenMajor(x.typed_data(), I, T);
  } else
#endif
  {
    QuantizeActivations(x.typed_data(), I, T, job->prefill, job->a);
#if defined(JAXSERVE_QUANT_VNNI)
    if (job->prefill)
      BuildPrefillStarts(kind, job->a, job->start, job->dxs);
    else
      BuildDecodeVectors(kind, job->a, job->dv);
#endif
  }
  // About 8 items per thread for balance, each a whole number of 12-row
  // pieces (both loops' row tiles divide it) of at least 48 rows.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->rows_per_item = std::max<int64_t>(48, (O / (8 * threads) + 11) / 12 * 12);
  job->items = (O + job->rows_per_item - 1) / job->rows_per_item;
  jaxserve_cpu::RunOnPool(pool, job, std::min<int64_t>(threads - 1, job->items - 1), job->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmatmulCpu, QmatmulImpl,
                              QuantizedWeightArgs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("mode"));
