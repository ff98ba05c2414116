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
// Two loops, by token count, and the prefill loop's AMX form:
//
// - decode (T <= 8): row_tile.h's tile, shared with moe_cpu.cc: 16 weight
//   rows in the vector lanes, every token of the call against them (one
//   vpdpbusd per row and an add tree at one token, a transpose of the
//   rows' bytes above), the next tile's rows prefetched (T1 hint) as a
//   tile reads its own (16 rows ahead: with only the next 256 bytes of each
//   row prefetched an earlier loop took 6.3-7.5 ms for 120 SmolLM2-135M
//   layer products at one token, 4.9-5.9 ms with 8-32 rows ahead). Each
//   (row, token) is summed block by block as the prefill loop sums it: the
//   exact int32 block dot, then acc = fma(float(dot), d * dx, acc) in block
//   order, so a token's outputs are the same bits whatever the call's
//   token count and loop (tests/test_quant_kernels.py). With speculative
//   decoding a step's guesses are tokens of the same call: the loop before
//   this one summed each row's 16 lanes apart and added them at the end,
//   its outputs parted from the prefill loop's in the last bit, the next
//   layer's activation quantization made that another integer, and int8
//   greedy text changed with speculation on (tests/test_speculative.py).
//   Against that loop, alternated in one process over 120 SmolLM2-135M
//   layer products (30 layers' distinct weights, medians of 11 rounds, a
//   2-core AVX-512 EPYC): q8_0 0.95x at 1 token (3.18 ms, 35.5 GB/s: the
//   machine's read rate), 0.92x at 2, 1.11x at 4, 1.72x at 8; q4_1 0.92x,
//   1.05x, 1.36x, 1.87x. What is left of the one-token gap is the
//   transposition of the rows' scales (row_tile.h's ScalePairs16); a
//   layout of the scales by 16-row tiles, made at load, would remove it.
//   End to end (SmolLM2-135M, one sequence, 127 greedy tokens after a
//   128-token prompt, medians of 5 runs, two processes each alternated
//   against the commit before): int8 132-144 tok/s against 131, int4
//   150-152 against 160-162 (0.94x).
// - prefill (T > 8): tokens in the vector lanes, 16 a vector, so each
//   4-byte group of a weight row is broadcast once for 2 x 16 tokens and
//   each activation vector serves a tile of 6 rows; a block's 8 vpdpbusd
//   per (row, token vector) are summed in int32 before one conversion and
//   FMA per block, a quarter of the instructions of float FMAs on the same
//   products. At 16 tokens it took 0.47x the decode loop's time, at 8
//   1.30x (the same A/B, mode 2), hence the boundary at 8.
// - prefill on AMX (JAXSERVE_QUANT_AMX: the CPU has AMX-TILE and
//   AMX-INT8, Sapphire Rapids and later Xeons, and Linux grants the tile
//   state): a 16-row panel of weights against 16-token tiles, one TDPBSSD
//   per block of 32 (16 x 16 x 32 signed byte products into int32 with no
//   offset correction: the tile unit multiplies signed by signed), each
//   block's tile stored and scaled by d * dx in the VNNI prefill loop's
//   order of operations, so the two loops give the same bits
//   (tests/test_quant_kernels.py). A block's scales differ per row and per
//   token, so every 32-deep product needs its own store and scaling: that,
//   not the tile unit, bounds the loop (AmxTile), at about 800 GOP/s on
//   SmolLM2-135M's layer matrices at 2,048 tokens on a 2-core AMX Xeon,
//   1.5-1.8x the VNNI loop and a quarter of XLA's plain s8 GEMM there
//   (benchmarks/quant_kernel_ab.py; the engine's prefill steps:
//   BENCHMARKS.md, int8-prefill).
//
// The activations are quantized before the matmul's items start, so that
// loop is vectorised too (QuantizeDecodeVnni, QuantizePrefillVnni): done a
// scalar at a time, reading a feature-major x one token at a time (a cache
// line per value), it took a third of the int8 SmolLM2-135M prefill step
// (2,048 tokens: 1,956 ms scalar, 1,309 ms vectorised;
// benchmarks/offline_profile.py --quantization int8). The decode layout is
// quantized on the calling thread, the prefill layout on the pool by
// 16-token tiles (PrefillPrep).
//
// vpdpbusd multiplies unsigned by signed bytes: the weights are the
// unsigned side (the nibbles are 0..15 already; int8 weights are flipped to
// q + 128 with one xor, and the accumulator starts at -128 * sum(xq) per
// block to undo it).
//
// Compile-time dispatch (JAXSERVE_QUANT_VNNI and JAXSERVE_QUANT_AMX, from
// quant_blocks.h, which also holds the block arithmetic shared with
// moe_cpu.cc): the intrinsic loops need AVX-512 VNNI and BW, the tile loop
// AMX as well (this library is built with -march=native on the machine that
// runs it); any other target, AVX2-only EPYCs among them, builds the
// portable loops below, the same integers and formula in plain C++ for the
// compiler to vectorise. JaxserveInt8Units says which a build runs.
// tests/test_quant_kernels.py checks both builds against a numpy reference.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_blocks.h"  // defines JAXSERVE_QUANT_VNNI where the intrinsic loops build
#include "row_tile.h"      // the decode loop's tile
#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu::quant;  // kGroup, the kinds, HalfToFloat, QuantizeBlock, ...

constexpr int64_t kDecodeMaxTokens = 8;  // above: the prefill loop (benchmarks/quant_kernel_ab.py)

// The activations of one call, quantized (see the header comment).
struct Activations {
  int64_t I = 0, T = 0, G = 0, Tp = 0;
  std::vector<int8_t> xq;     // decode: [T, I] token-major; prefill: [Tp / 16, I / 4, 16, 4]
  std::vector<float> dx;      // decode: [T, G]; prefill: [Tp / 16, G, 16]
  std::vector<int32_t> sx;    // same layout as dx: sum of the block's xq

  // The prefill layout, by tiles of 16 tokens: a tile's activations are
  // contiguous (I / 4 rows of 4 features x 16 tokens, 64 bytes each), and so
  // are its block scales and sums. A loop over one tile's blocks then reads
  // consecutive bytes; with a [I / 4, Tp, 4] layout each of its 64-byte
  // reads was 4 x Tp bytes from the last, a new page at 2,048 tokens, and
  // the AMX loop's tile loads of it took a third of its time (perf record).
  int64_t TileXq(int64_t t0) const { return t0 * I; }            // xq offset of the tile holding token t0
  int64_t TileBlocks(int64_t t0) const { return t0 * G; }        // dx / sx offset of that tile
  int64_t PrefillXq(int64_t f, int64_t t) const { return TileXq(t - t % 16) + (f / 4) * 64 + (t % 16) * 4 + f % 4; }
  int64_t PrefillBlock(int64_t b, int64_t t) const { return TileBlocks(t - t % 16) + b * 16 + t % 16; }
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
// Tokens [t_begin, t_end), both multiples of 16 (PrefillPrep splits a call
// by them over the pool).
void QuantizePrefillVnni(const float* x, int64_t T, int64_t t_begin, int64_t t_end, Activations& a) {
  const int64_t G = a.G;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  const __m512 inv127 = _mm512_set1_ps(1.0f / 127.0f);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
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
        _mm512_storeu_si512(a.xq.data() + a.TileXq(t0) + (b * kGroup + k) / 4 * 64, packed);
      }
      _mm512_storeu_ps(a.dx.data() + a.TileBlocks(t0) + b * 16, d);
      _mm512_storeu_si512(a.sx.data() + a.TileBlocks(t0) + b * 16, sum);
    }
  }
}
#endif

// Quantizes x [I, T] (feature-major): for the decode loop token-major; for
// the prefill loop in groups of 4 features per token, tokens padded to Tp.
// With VNNI the prefill layout is left to PrefillPrep (on the pool).
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
  return;
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
          a.xq[a.PrefillXq(f, t)] = q[k];
        else
          a.xq[t * I + f] = q[k];
      }
      const int64_t at = prefill ? a.PrefillBlock(b, t) : t * G + b;
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
  const int64_t I = a.I, T = a.T, G = a.G;
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
          const int8_t xv = prefill ? a.xq[a.PrefillXq(f, t)] : a.xq[t * I + f];
          dot += w[k] * xv;
        }
        const int64_t at = prefill ? a.PrefillBlock(b, t) : t * G + b;
        acc[t] += BlockTerm(kind, dot, a.sx[at], d, m, a.dx[at]);
      }
    }
    for (int64_t t = 0; t < T; ++t) out[o * T + t] = acc[t];
  }
}

#if defined(JAXSERVE_QUANT_VNNI)
// ------------------------------------------------------------------ VNNI

inline __m512 OneHalf(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(*h)));
}

// Per block and token: the int32 start (-128 * sum for q8_0, -8 * sum for
// q4_0, 0 for q4_1) and q4_1's dx * sum, for the blocks [i0, i1) of a's dx
// and sx (either layout: the same index in all four arrays; the arrays
// sized by the caller). Both loops read them, so a (row, token) is the same
// float arithmetic in either.
void BlockStarts(int32_t kind, const Activations& a, int64_t i0, int64_t i1, int32_t* start, float* dxs) {
  const int32_t per_block = WeightOffset(kind);
  for (int64_t i = i0; i < i1; ++i) {
    start[i] = -per_block * a.sx[i];
    dxs[i] = a.dx[i] * static_cast<float>(a.sx[i]);
  }
}

// The decode loop (T <= 8): row_tile.h's tile, 16 rows in the lanes, over
// every token of the call, on the call's activations and BlockStarts.
struct DecodeInputs {
  std::vector<int32_t> tokens;  // 0 .. T - 1: the tile's rows of the inputs
  Inputs in;
  Stack w;
};

void BuildDecodeInputs(int32_t kind, const uint8_t* q, const uint16_t* scale, const uint16_t* mins, int64_t O,
                       Activations& a, int32_t* start, float* dxs, DecodeInputs& d) {
  d.tokens.resize(static_cast<size_t>(a.T));
  for (int64_t t = 0; t < a.T; ++t) d.tokens[t] = static_cast<int32_t>(t);
  d.in.K = a.I;
  d.in.G = a.G;
  d.in.xq = a.xq.data();
  d.in.dx = a.dx.data();
  d.in.dxs = dxs;
  d.in.start = start;
  d.w.kind = kind;
  d.w.q = q;
  d.w.scale = scale;
  d.w.mins = mins;
  d.w.O = O;
  d.w.K = a.I;
  d.w.G = a.G;
  d.w.row_bytes = kind == kQ8_0 ? a.I : a.I / 2;
}

// Rows [o0, o1) by tiles of 16, each prefetching the next tile's rows.
void TileRows(const DecodeInputs& d, int64_t T, float* out, int64_t o0, int64_t o1) {
  alignas(64) float acc[kDecodeMaxTokens * kTileRows];
  // The item's first tile is requested whole (into L2) before it is read:
  // every later tile was requested as the one before it was read, but an
  // item starts cold, and with SmolLM2-135M's small matrices (48-row items,
  // a third of the tiles first ones) a one-sequence int8 decode step moved
  // its layer weights at 17 GB/s against 25 for the 28 MB vocabulary
  // projection on a 2-core EPYC. With it the step's time (runner.execute +
  // fetch, 10th percentile of 150) fell in 7 of 8 alternated rounds, by
  // about 6 % (9.9 -> 9.3 ms at context 192).
  for (int64_t r = o0; r < std::min(o1, o0 + kTileRows); ++r) {
    const uint8_t* row = d.w.Row(0, r);
    for (int64_t off = 0; off < d.w.row_bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
  }
  for (int64_t o = o0; o < o1; o += kTileRows) {
    const int64_t nrows = std::min<int64_t>(kTileRows, o1 - o);
    const uint8_t* next = o + kTileRows < d.w.O ? d.w.Row(0, o + kTileRows) : nullptr;
    Tile(d.w, 0, o, nrows, d.in, d.tokens.data(), T, acc, next);
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t t = 0; t < T; ++t) out[(o + r) * T + t] = acc[t * kTileRows + r];
  }
}


// A prefill call's activations quantized (QuantizePrefillVnni) and its
// starts built, by items of whole 16-token tiles on the pool before the
// matmul's items start: on the calling thread alone, as before, it was a
// serial fifth of an AMX product's time at 2,048 tokens (SmolLM2-135M's
// gate/up projection: 0.9 of 4-5 ms; the down projection 2.5 of 6).
struct PrefillPrep {
  const float* x;
  int32_t kind;
  Activations* a;
  int32_t* start;
  float* dxs;
  int64_t tiles_per_item, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    const int64_t t_begin = item * tiles_per_item * 16, t_end = std::min(a->Tp, t_begin + tiles_per_item * 16);
    QuantizePrefillVnni(x, a->T, t_begin, t_end, *a);
    BlockStarts(kind, *a, a->TileBlocks(t_begin), a->TileBlocks(t_end), start, dxs);
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

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
  const int64_t I = a.I, G = a.G, T = a.T;
  const int64_t row_bytes = kind == kQ8_0 ? I : I / 2;
  __m512 acc[R][TV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    __m512i dot[R][TV];
    for (int j = 0; j < TV; ++j) {
      const __m512i s = _mm512_loadu_si512(start + a.TileBlocks(t0 + 16 * j) + b * 16);
      for (int r = 0; r < R; ++r) dot[r][j] = s;
    }
    for (int g = 0; g < 8; ++g) {
      __m512i xv[TV];
      for (int j = 0; j < TV; ++j) xv[j] = _mm512_loadu_si512(a.xq.data() + a.TileXq(t0 + 16 * j) + (b * 8 + g) * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i wb = _mm512_set1_epi32(static_cast<int>(WeightGroup<kind>(q + (o + r) * row_bytes, b, g)));
        for (int j = 0; j < TV; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], wb, xv[j]);
      }
    }
    __m512 dx[TV];
    for (int j = 0; j < TV; ++j) dx[j] = _mm512_loadu_ps(a.dx.data() + a.TileBlocks(t0 + 16 * j) + b * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 d = OneHalf(scale + (o + r) * G + b);
      for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), _mm512_mul_ps(d, dx[j]), acc[r][j]);
      if (kind == kQ4_1) {
        const __m512 m = OneHalf(mins + (o + r) * G + b);
        for (int j = 0; j < TV; ++j) acc[r][j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(dxs + a.TileBlocks(t0 + 16 * j) + b * 16), acc[r][j]);
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

#if defined(JAXSERVE_QUANT_AMX)
// ------------------------------------------------------------------ AMX

// The tile registers (palette 1), by number since the tile intrinsics take
// literals: tmm0, tmm1 C, 16 x 16 int32 dots; tmm2, tmm3 A, 16 weight rows
// x one block (32 bytes); tmm4, tmm5 B, one block x 16 tokens, 8 rows of 4
// features x 16 tokens (the prefill activation layout's rows as they lie).
constexpr int64_t kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the tile shapes on the calling thread; AmxRows releases them at the
// end of its item so a context switch does not carry 8 KB of tile state.
inline void ConfigureTiles() {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = kGroup;
  for (int t : {4, 5}) cfg.rows[t] = kGroup / 4, cfg.colsb[t] = 64;
  // GCC 12 does not count ldtilecfg as reading cfg and drops the stores
  // above it (the tile load then faults on a config of zeros): a barrier.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One 16-row panel of the weight as signed bytes, row-major [16, I], with
// its scales (and q4_1's mins) as float32 [16, G]. q8_0 is read in place;
// q4 nibbles are unpacked here once per panel (q4_0 as q - 8, so the
// integer dot needs no correction; q4_1 as q, its min term added apart)
// and then serve every token tile.
struct AmxPanel {
  std::vector<int8_t> ints;
  std::vector<float> d, m;
  const int8_t* rows = nullptr;
};

template <int32_t kind>
void LoadPanel(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, int64_t I, int64_t o, AmxPanel& p) {
  const int64_t G = I / kGroup;
  p.d.resize(static_cast<size_t>(kAmxRows * G));
  for (int64_t i = 0; i < kAmxRows * G; ++i) p.d[i] = HalfToFloat(scale[o * G + i]);
  if (kind == kQ4_1) {
    p.m.resize(static_cast<size_t>(kAmxRows * G));
    for (int64_t i = 0; i < kAmxRows * G; ++i) p.m[i] = HalfToFloat(mins[o * G + i]);
  }
  if (kind == kQ8_0) {
    p.rows = reinterpret_cast<const int8_t*>(q) + o * I;
    return;
  }
  p.ints.resize(static_cast<size_t>(kAmxRows * I));
  const int8_t shift = kind == kQ4_0 ? 8 : 0;
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const uint8_t* src = q + (o + r) * (I / 2);
    int8_t* dst = p.ints.data() + r * I;
    for (int64_t b = 0; b < G; ++b)
      for (int k = 0; k < kGroup / 2; ++k) {
        const uint8_t v = src[b * (kGroup / 2) + k];
        dst[b * kGroup + k] = static_cast<int8_t>((v & 0x0F) - shift);
        dst[b * kGroup + k + kGroup / 2] = static_cast<int8_t>((v >> 4) - shift);
      }
  }
  p.rows = p.ints.data();
}

// What block b adds to the 16 x 16 outputs in acc: the tile's int32 dots
// (stored to dots) times d * dx (plus q4_1's m * dx * sum(xq)), in the VNNI
// prefill loop's order of operations, so the two loops give the same bits.
template <int32_t kind>
[[gnu::always_inline]] inline void AddBlock(const int32_t* dots, const AmxPanel& p, const float* dx_row,
                                            const float* dxs_row, int64_t G, int64_t b, __m512 acc[kAmxRows]) {
  const __m512 dx = _mm512_loadu_ps(dx_row);
#pragma GCC unroll 16  // acc stays in registers only if every index is a constant
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * r));
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_set1_ps(p.d[r * G + b]), dx), acc[r]);
    if (kind == kQ4_1) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p.m[r * G + b]), _mm512_loadu_ps(dxs_row), acc[r]);
  }
}

// out rows [o, o + 16) x token columns [t0, t0 + 16): per block one
// TDPBSSD (16 x 16 x 32 signed byte products into int32), its tile stored
// and scaled into float accumulators. The tile registers are not renamed
// and a tile store waits for its product, so blocks alternate between two
// sets (tmm0/2/4, tmm1/3/5) and the work is skewed: each pair of blocks
// issues its products, stores the tiles of the blocks before, and scales
// blocks stored one step earlier (three dots buffers), in block order. Of
// the orders tried in a one-core probe (one panel, 256 tokens in L2), this
// one did 200 multiply-adds a cycle; issuing block b then storing and
// scaling block b - 1 at once, 165; with no overlap, 155.
template <int32_t kind>
void AmxTile(const AmxPanel& p, const Activations& a, const float* dxs, int64_t o, int64_t t0, float* out) {
  const int64_t I = a.I, G = a.G, T = a.T;
  alignas(64) int32_t dots[3][kAmxRows * 16];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xq = a.xq.data() + a.TileXq(t0);
  const float* dx = a.dx.data() + a.TileBlocks(t0);
  dxs += a.TileBlocks(t0);
  const int8_t* w = p.rows;
  auto x_at = [&](int64_t b) { return xq + b * (kGroup / 4) * 64; };
  auto scale = [&](int64_t b) { AddBlock<kind>(dots[b % 3], p, dx + b * 16, dxs + b * 16, G, b, acc); };
  for (int64_t b = 0; b < G + 2; b += 2) {  // b even: tmm0's block; b + 1: tmm1's
    if (b < G) {
      _tile_zero(0);
      _tile_loadd(2, w + b * kGroup, I);
      _tile_loadd(4, x_at(b), 64);
      _tile_dpbssd(0, 2, 4);
    }
    if (b >= 1 && b - 1 < G) _tile_stored(1, dots[(b - 1) % 3], 64);
    if (b >= 2) scale(b - 2);
    if (b + 1 < G) {
      _tile_zero(1);
      _tile_loadd(3, w + (b + 1) * kGroup, I);
      _tile_loadd(5, x_at(b + 1), 64);
      _tile_dpbssd(1, 3, 5);
    }
    if (b < G) _tile_stored(0, dots[b % 3], 64);
    if (b >= 1 && b - 1 < G) scale(b - 1);
  }
  const __mmask16 keep = T - t0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (T - t0)) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) _mm512_mask_storeu_ps(out + (o + r) * T + t0, keep, acc[r]);
}

// Rows [o0, o1) by chunks of kAmxTokens tokens, whose activations (I x 256
// bytes) stay in L2 while every 16-row panel of the item passes over them,
// a panel's weights (16 x I bytes) in L1 for the chunk's 16 token tiles.
// SmolLM2-135M's gate/up projection (3,072 x 576) at 2,048 tokens, two
// threads, alternated runs: 6.4-7.4 ms this way; with 4 panels sharing
// each token tile (36 KB of weights, which L1 did not hold beside the
// tile) 11.7-12.5 ms; chunks of 128 or 512 tokens 7-15 ms; all tokens at
// once, on one core, 23 ms against 8 x its 256-token time, 14.5. A
// remainder of fewer than 16 rows goes to the VNNI loop (the same bits,
// see AddBlock).
constexpr int64_t kAmxTokens = 256;

template <int32_t kind>
void AmxRows(const uint8_t* q, const uint16_t* scale, const uint16_t* mins, const Activations& a,
             const int32_t* start, const float* dxs, float* out, int64_t o0, int64_t o1) {
  ConfigureTiles();
  AmxPanel panel;
  const int64_t whole = o0 + (o1 - o0) / kAmxRows * kAmxRows;
  for (int64_t t0 = 0; t0 < a.T; t0 += kAmxTokens) {
    const int64_t t1 = std::min(a.T, t0 + kAmxTokens);
    for (int64_t o = o0; o < whole; o += kAmxRows) {
      LoadPanel<kind>(q, scale, mins, a.I, o, panel);
      for (int64_t t = t0; t < t1; t += 16) AmxTile<kind>(panel, a, dxs, o, t, out);
    }
  }
  _tile_release();
  if (whole < o1) PrefillRows<kind>(q, scale, mins, a, start, dxs, out, whole, o1);
}
#endif  // JAXSERVE_QUANT_AMX

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
  bool amx = false;           // the prefill loop on AMX tiles (AmxRows)
  std::vector<float> xt;      // mode 1: x token-major [T, I]
  Activations a;
#if defined(JAXSERVE_QUANT_VNNI)
  DecodeInputs di;
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
    } else if (amx) {
#if defined(JAXSERVE_QUANT_AMX)
      switch (kind) {
        case kQ8_0: AmxRows<kQ8_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        case kQ4_0: AmxRows<kQ4_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        default: AmxRows<kQ4_1>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
      }
#endif
    } else if (prefill) {
      switch (kind) {
        case kQ8_0: PrefillRows<kQ8_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        case kQ4_0: PrefillRows<kQ4_0>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
        default: PrefillRows<kQ4_1>(q, scale, mins, a, start.data(), dxs.data(), out, o0, o1); break;
      }
    } else {
      TileRows(di, a.T, out, o0, o1);
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
#if defined(JAXSERVE_QUANT_AMX)
  job->amx = job->prefill && mode != 3 && AmxUsable();  // mode 3: the VNNI prefill loop where AMX serves (A/B)
#endif
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
    job->start.resize(job->a.sx.size());
    job->dxs.resize(job->a.sx.size());
    if (job->prefill) {
      auto prep = std::make_shared<PrefillPrep>();
      prep->x = x.typed_data();
      prep->kind = kind;
      prep->a = &job->a;
      prep->start = job->start.data();
      prep->dxs = job->dxs.data();
      const int64_t tiles = job->a.Tp / 16, workers = jaxserve_cpu::Workers(pool);
      prep->tiles_per_item = std::max<int64_t>(4, tiles / (4 * workers));
      prep->items = (tiles + prep->tiles_per_item - 1) / prep->tiles_per_item;
      jaxserve_cpu::RunOnThreads(pool, prep, workers, prep->items);
    } else {
      BlockStarts(kind, job->a, 0, static_cast<int64_t>(job->a.sx.size()), job->start.data(), job->dxs.data());
      BuildDecodeInputs(kind, job->q, job->scale, job->mins, O, job->a, job->start.data(), job->dxs.data(), job->di);
    }
#endif
  }
  // About 8 items per thread for balance, each a whole number of pieces of
  // at least 48 rows: 12 for the VNNI prefill loop's 6-row tiles, 48 for
  // the decode loop's 16-row tiles and AMX's 16-row panels.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t piece = job->amx || !job->prefill ? 48 : 12;
  job->rows_per_item = std::max<int64_t>(48, (O / (8 * threads) + piece - 1) / piece * piece);
  job->items = (O + job->rows_per_item - 1) / job->rows_per_item;
  jaxserve_cpu::RunOnThreads(pool, job, threads, job->items);
  return ffi::Error::Success();
}

}  // namespace

// Which units this build's int8 prefill loop runs on: 2 AMX tiles, 1 AVX-512
// VNNI, 0 the portable loops (jaxserve.kernels.cpu.int8_units, which the
// benchmarks' machine record carries). AMX also needs Linux's grant.
extern "C" int JaxserveInt8Units() {
#if defined(JAXSERVE_QUANT_AMX)
  if (AmxUsable()) return 2;
#endif
#if defined(JAXSERVE_QUANT_VNNI)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmatmulCpu, QmatmulImpl,
                              QuantizedWeightArgs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("mode"));
