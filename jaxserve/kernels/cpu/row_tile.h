// The rows-in-lanes tile: 16 rows of a weight matrix (or of one expert of
// a stack) in the 16 vector lanes against a few tokens, each (row, token)
// summed block by block in one fixed order. Shared by moe_cpu.cc (every
// expert group) and qmatmul_cpu.cc (its decode loop, 1-8 tokens), so both
// compute a (row, token) with the float arithmetic of qmatmul_cpu.cc's
// prefill loop, whatever the call's token count: a token's outputs do not
// depend on the rest of the batch or on which loop served it
// (tests/test_quant_kernels.py, tests/test_moe.py).
//
// The tile: 16 weight rows in the 16 lanes, tokens one at a time. Weights
// are stored row by row ([out, in]), so each 64-byte chunk of 16 rows is
// loaded as 16 vectors and transposed in registers (64 shuffles) into
// vectors holding the same 4 input features of the 16 rows; each serves
// every token of the group through one vpdpbusd against that token's 4
// int8 inputs broadcast. A block's 8 vpdpbusd give its exact int32 dot for
// the 16 rows, then acc = fma(float(dot), d * dx, acc) in block order: for
// one (row, token) the same float arithmetic as qmatmul_cpu.cc's prefill
// loop (tokens in lanes), so the grouped layer is the dense product applied
// to each expert's rows. The alternative, tokens in lanes, pays only for
// groups of 16 tokens or more: a decode step's groups hold 1 to a dozen
// tokens (64 sequences, 8 of 128 experts each: about 4 per expert), where
// the lanes would be mostly empty; rows in lanes keeps every lane busy at
// any group size, and the transpose costs 4 shuffles per 64 weight bytes,
// once per group, against the memory time of reading them at decode
// sizes. float32 stacks use the same tile with one FMA per input feature, in
// feature order.
//
// A group of one token (every group of a one-sequence decode step, and many
// at 64 sequences) skips the transpose: each of the 16 rows' 64 bytes meets
// the token's 64 bytes in one vpdpbusd, and an add tree of 30 shuffles
// (BlockSums16) gathers the 16 rows' block dots into lanes. The dots are
// integers, so they equal the transposed tile's exactly and the float
// arithmetic after them is shared (tests/test_moe.py: a token alone, in
// groups of one, bitwise as in a batch). One Qwen3-30B-A3B layer, Q8_0, one
// token: 1.97 ms against 3.10 ms with the transpose
// (benchmarks/moe_kernel_ab.py --tokens 1,2 --rounds 3 --no-f32, medians, a
// quiet 2-core AVX-512 VNNI EPYC).
//
// The next tile's rows are prefetched as a tile reads its own (16 streams;
// matvec_cpu.cc found the hardware prefetchers do not run far enough ahead
// of interleaved rows).
//
// Compile-time dispatch as quant_blocks.h: the intrinsic tiles need AVX-512
// VNNI and BW; other targets build PortableTile, the same integer dots and
// per-(row, token) sums.

#ifndef JAXSERVE_KERNELS_CPU_ROW_TILE_H_
#define JAXSERVE_KERNELS_CPU_ROW_TILE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

namespace jaxserve_cpu::quant {

inline constexpr int64_t kTileRows = 16;
inline constexpr int32_t kF32 = 3;  // a float32 matrix's kind; the quantized ones are QuantKind's

// A stack of X matrices [O, K] (X = 1: one dense weight).
struct Stack {
  int32_t kind = kF32;
  const uint8_t* q = nullptr;  // int8/uint8 blocks' quants, or float32 values
  const uint16_t* scale = nullptr;
  const uint16_t* mins = nullptr;
  int64_t X = 1, O = 0, K = 0, G = 0, row_bytes = 0;

  const uint8_t* Row(int64_t e, int64_t o) const { return q + (e * O + o) * row_bytes; }
  const uint16_t* Scales(int64_t e, int64_t o) const { return scale + (e * O + o) * G; }
  const uint16_t* Mins(int64_t e, int64_t o) const { return mins + (e * O + o) * G; }
};

// The inputs of a set of rows (tokens, or pairs), K features each: int8
// quants token-major with per-block dx, the vpdpbusd start (the offset
// correction of the weight kind: -128 * sum(xq) for q8_0's flipped weights,
// -8 * sum for q4_0, 0 for q4_1) and dx * sum (q4_1); or float32 rows.
struct Inputs {
  int64_t K = 0, G = 0;
  int8_t* xq = nullptr;
  float *dx = nullptr, *dxs = nullptr, *xf = nullptr;
  int32_t* start = nullptr;
};

// ------------------------------------------------------------------ portable

// acc[i * 16 + r] = row (o0 + r) of expert e times input row rows[i], for
// r < nrows (the tile's valid rows).
inline void PortableTile(const Stack& w, int64_t e, int64_t o0, int64_t nrows, const Inputs& in, const int32_t* rows,
                  int64_t n, float* acc) {
  const int64_t K = w.K, G = w.G;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = rows[i];
    for (int64_t r = 0; r < nrows; ++r) {
      float a = 0.0f;
      if (w.kind == kF32) {
        const float* wr = reinterpret_cast<const float*>(w.Row(e, o0 + r));
        const float* x = in.xf + t * K;
        for (int64_t f = 0; f < K; ++f) a = std::fma(wr[f], x[f], a);
      } else {
        const uint8_t* wr = w.Row(e, o0 + r);
        const uint16_t* sc = w.Scales(e, o0 + r);
        const int8_t* x = in.xq + t * K;
        for (int64_t b = 0; b < G; ++b) {
          int32_t dot = 0;
          for (int k = 0; k < kGroup; ++k) {
            int32_t wv;
            if (w.kind == kQ8_0) {  // signed as stored: no offset to undo
              wv = reinterpret_cast<const int8_t*>(wr)[b * kGroup + k];
            } else {
              const uint8_t byte = wr[b * (kGroup / 2) + k % 16];
              wv = k < 16 ? (byte & 0x0F) : (byte >> 4);
            }
            dot += wv * x[b * kGroup + k];
          }
          if (w.kind != kQ8_0) dot += in.start[t * G + b];  // q4_0: -8 * sum(xq); q4_1: 0
          const float dx = in.dx[t * G + b];
          a = std::fma(static_cast<float>(dot), HalfToFloat(sc[b]) * dx, a);
          if (w.kind == kQ4_1) a = std::fma(HalfToFloat(w.Mins(e, o0 + r)[b]), in.dxs[t * G + b], a);
        }
      }
      acc[i * kTileRows + r] = a;
    }
  }
}

#if defined(JAXSERVE_QUANT_VNNI)
// ------------------------------------------------------------------ AVX-512

// v[j] (16 dwords, one row each) -> v[j] holding dword j of every row, row r in lane r.
inline void Transpose16(__m512i v[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // u[4a + b], 128-bit lane L: rows 4a..4a+3, dword 4L + b
  for (int a = 0; a < 4; ++a) {
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    const __m512i p0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x44), p1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xEE);
    const __m512i p2 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x44), p3 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xEE);
    v[b] = _mm512_shuffle_i32x4(p0, p2, 0x88);
    v[4 + b] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
    v[8 + b] = _mm512_shuffle_i32x4(p1, p3, 0x88);
    v[12 + b] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
  }
}

// p[r]: row r's 16 partial dots of one 64-byte chunk (LoadChunk's lanes)
// -> s0, s1 with row r in lane r: its sum over the chunk's first block's
// lanes and over its second's (q8_0: 128-bit lanes 0, 1 and 2, 3; the q4
// kinds: 0, 2 and 1, 3, ChunkLanes). Integer adds, so the sums are the
// chained vpdpbusd's exactly, in whatever order.
template <int32_t kind>
inline void BlockSums16(const __m512i p[16], __m512i& s0, __m512i& s1) {
  // 128-bit lanes [0, 2] + [1, 3] of two vectors (q8_0), or [0, 1] + [2, 3]
  constexpr int kFirst = kind == kQ8_0 ? 0x88 : 0x44, kSecond = kind == kQ8_0 ? 0xDD : 0xEE;
  __m512i a[8], b[4];
  // a[i], 128-bit lane L: rows 2i, 2i + 1 interleaved, dwords 4L + {0, 2} and 4L + {1, 3} added
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  // b[i], 128-bit lane L: rows 4i .. 4i + 3, each summed over features 16L .. 16L + 15
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  // c[h], 128-bit lanes: rows 8h .. 8h + 3 block 0, block 1, rows 8h + 4 .. 8h + 7 block 0, block 1
  __m512i c[2];
  for (int h = 0; h < 2; ++h)
    c[h] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * h], b[2 * h + 1], kFirst),
                            _mm512_shuffle_i32x4(b[2 * h], b[2 * h + 1], kSecond));
  s0 = _mm512_shuffle_i32x4(c[0], c[1], 0x88);
  s1 = _mm512_shuffle_i32x4(c[0], c[1], 0xDD);
}

// 64 weights (blocks 2c, 2c + 1) of a row as unsigned bytes; `two` false:
// block 2c only (a row's last, odd block). q8_0's in feature order, flipped
// to q + 128. The q4 kinds' 32 bytes hold a block's weight k in the low
// nibble of its byte k and weight k + 16 in the high one; they are left in
// the lanes one broadcast load and one shift give: 128-bit lanes [block 2c
// weights 0-15, block 2c + 1 weights 0-15, block 2c 16-31, block 2c + 1
// 16-31] (ChunkLanes), and the activations meet them in that order. Put in
// feature order (two more shuffles a row, as the decode loop once did) a
// one-token int4 decode took a quarter longer (SmolLM2-135M's layers).
template <int32_t kind>
inline __m512i LoadChunk(const uint8_t* row, int64_t c, bool two) {
  if (kind == kQ8_0) {
    const __m512i w = two ? _mm512_loadu_si512(row + c * 64) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + c * 64);
    return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i packed = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32))
                               : _mm256_maskz_loadu_epi8(0xFFFFu, row + c * 32);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(packed), shift), _mm512_set1_epi8(0x0F));
  }
}

// The activations' 64 bytes of a chunk in LoadChunk's lane order: as they
// lie for q8_0; 128-bit lanes [0, 2, 1, 3] for the q4 kinds.
template <int32_t kind>
inline __m512i ChunkLanes(__m512i x) {
  return kind == kQ8_0 ? x : _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));
}

// Of a transposed chunk (v[j]: LoadChunk's dword j of every row), the
// index holding input dword g (0-15, 4 features each) of the chunk.
template <int32_t kind>
constexpr int ChunkDword(int g) {
  return kind == kQ8_0 ? g : (g % 8 < 4 ? g % 4 + (g / 8) * 4 : g % 4 + 8 + (g / 8) * 4);
}

// The scales (or mins) of the tile's 16 rows for chunks c0 .. c0 + 15
// (blocks 2 c0 .. 2 c0 + 31; row r's halves at h + row_of_lane[r] * G):
// each row's 64 bytes loaded once and transposed (Transpose16), so
// pairs[c - c0] holds chunk c's two halves of every row, row r in dword r
// (dwords past the row's last chunk hold what follows it, unread). `end`:
// the array's end; a load that would pass it is masked. A masked load
// everywhere, or a gather per chunk instead, each cost a one-token int4
// decode of SmolLM2-135M's layers about a quarter of its time on an
// AVX-512 EPYC (masked loads across cache lines and gathers are microcoded
// there); with these loads the one-token decode runs at 0.92-0.95x the loop
// before it, the transposition being what is left (qmatmul_cpu.cc's header).
inline void ScalePairs16(const uint16_t* h, const uint16_t* end, const int64_t* row_of_lane, int64_t G, int64_t c0,
                         __m512i pairs[16]) {
  const int64_t left = std::min<int64_t>(32, G - 2 * c0);  // halves of this group
  const __mmask32 keep = left == 32 ? ~0u : (1u << left) - 1;
  for (int r = 0; r < 16; ++r) {
    const uint16_t* p = h + row_of_lane[r] * G + 2 * c0;
    pairs[r] = p + 32 <= end ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(keep, p);
  }
  Transpose16(pairs);
}

// A chunk's pair of halves per row (ScalePairs16) as the two blocks' float vectors.
inline void PairToFloats(__m512i pair, __m512& s0, __m512& s1) {
  s0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));
  s1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
}

template <int32_t kind>
inline void QuantTile(const Stack& w, int64_t e, int64_t o0, int64_t nrows, const Inputs& in, const int32_t* rows,
               int64_t n, float* acc, const uint8_t* next) {
  const int64_t K = w.K, G = w.G, rb = w.row_bytes, chunks = (G + 1) / 2;
  const uint8_t* rowp[16];
  int64_t lane_row[16];
  for (int r = 0; r < 16; ++r) {
    lane_row[r] = std::min<int64_t>(r, nrows - 1);
    rowp[r] = w.Row(e, o0 + lane_row[r]);
  }
  const uint16_t* sc = w.Scales(e, o0);
  const uint16_t* mn = kind == kQ4_1 ? w.Mins(e, o0) : nullptr;
  __m512i scale_pairs[16], min_pairs[16];
  const uint16_t* scale_end = w.scale + w.X * w.O * G;
  const uint16_t* min_end = kind == kQ4_1 ? w.mins + w.X * w.O * G : nullptr;
  for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(acc + i * 16, _mm512_setzero_ps());
  const int64_t chunk_bytes = kind == kQ8_0 ? 64 : 32;
  // One (row, token)'s two blocks into its lanes of acc: the same float
  // arithmetic whichever way dot0 / dot1 (exact int32 block dots) were made.
  const auto add_blocks = [&](int64_t i, int64_t at, bool two, __m512i dot0, __m512i dot1, __m512 d0, __m512 d1,
                              __m512 m0, __m512 m1) {
    __m512 a = _mm512_loadu_ps(acc + i * 16);
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(d0, _mm512_set1_ps(in.dx[at])), a);
    if (kind == kQ4_1) a = _mm512_fmadd_ps(m0, _mm512_set1_ps(in.dxs[at]), a);
    if (two) {
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(d1, _mm512_set1_ps(in.dx[at + 1])), a);
      if (kind == kQ4_1) a = _mm512_fmadd_ps(m1, _mm512_set1_ps(in.dxs[at + 1]), a);
    }
    _mm512_storeu_ps(acc + i * 16, a);
  };
  for (int64_t c = 0; c < chunks; ++c) {
    const bool two = 2 * c + 1 < G;
    __m512i v[16];
    for (int r = 0; r < 16; ++r) {
      v[r] = LoadChunk<kind>(rowp[r], c, two);
      if (next != nullptr) __builtin_prefetch(next + r * rb + c * chunk_bytes, 0, 1);
    }
    if (c % 16 == 0) {
      ScalePairs16(sc, scale_end, lane_row, G, c, scale_pairs);
      if (kind == kQ4_1) ScalePairs16(mn, min_end, lane_row, G, c, min_pairs);
    }
    __m512 d0, d1, m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    PairToFloats(scale_pairs[c % 16], d0, d1);
    if (kind == kQ4_1) PairToFloats(min_pairs[c % 16], m0, m1);
    const int64_t b0 = 2 * c;
    if (n == 1) {
      // One token (every group of a one-sequence decode): each row's
      // vpdpbusd against the token's 64 bytes in the weights' lane order,
      // then BlockSums16 (30 shuffles) instead of Transpose16 (64) for one
      // token's 16 dots.
      const int64_t at = rows[0] * G + b0;
      const int8_t* x = in.xq + rows[0] * K + c * 64;
      const __m512i xv = ChunkLanes<kind>(two ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, x));
      __m512i dots[16];
      for (int r = 0; r < 16; ++r) dots[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[r], xv);
      __m512i dot0, dot1;
      BlockSums16<kind>(dots, dot0, dot1);
      dot0 = _mm512_add_epi32(dot0, _mm512_set1_epi32(in.start[at]));
      dot1 = _mm512_add_epi32(dot1, _mm512_set1_epi32(two ? in.start[at + 1] : 0));
      add_blocks(0, at, two, dot0, dot1, d0, d1, m0, m1);
      continue;
    }
    Transpose16(v);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = rows[i];
      const int8_t* x = in.xq + t * K + c * 64;
      const int64_t at = t * G + b0;
      __m512i dot0 = _mm512_set1_epi32(in.start[at]);
      __m512i dot1 = _mm512_set1_epi32(two ? in.start[at + 1] : 0);
      for (int j = 0; j < 8; ++j) {
        int32_t x0;
        std::memcpy(&x0, x + 4 * j, 4);
        dot0 = _mm512_dpbusd_epi32(dot0, v[ChunkDword<kind>(j)], _mm512_set1_epi32(x0));
        if (two) {
          int32_t x1;
          std::memcpy(&x1, x + 32 + 4 * j, 4);
          dot1 = _mm512_dpbusd_epi32(dot1, v[ChunkDword<kind>(8 + j)], _mm512_set1_epi32(x1));
        }
      }
      add_blocks(i, at, two, dot0, dot1, d0, d1, m0, m1);
    }
  }
}

inline void FloatTile(const Stack& w, int64_t e, int64_t o0, int64_t nrows, const Inputs& in, const int32_t* rows,
               int64_t n, float* acc, const uint8_t* next) {
  const int64_t K = w.K, rb = w.row_bytes;
  const float* rowp[16];
  for (int r = 0; r < 16; ++r) rowp[r] = reinterpret_cast<const float*>(w.Row(e, o0 + std::min<int64_t>(r, nrows - 1)));
  for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(acc + i * 16, _mm512_setzero_ps());
  for (int64_t f0 = 0; f0 < K; f0 += 16) {
    const int64_t valid = std::min<int64_t>(16, K - f0);
    const __mmask16 keep = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    __m512i v[16];
    for (int r = 0; r < 16; ++r) {
      v[r] = _mm512_castps_si512(_mm512_maskz_loadu_ps(keep, rowp[r] + f0));
      if (next != nullptr) __builtin_prefetch(next + r * rb + f0 * 4, 0, 1);
    }
    Transpose16(v);
    for (int64_t i = 0; i < n; ++i) {
      const float* x = in.xf + rows[i] * K + f0;
      __m512 a = _mm512_loadu_ps(acc + i * 16);
      for (int64_t j = 0; j < valid; ++j) a = _mm512_fmadd_ps(_mm512_castsi512_ps(v[j]), _mm512_set1_ps(x[j]), a);
      _mm512_storeu_ps(acc + i * 16, a);
    }
  }
}
#endif  // JAXSERVE_QUANT_VNNI

// acc [n, 16]: rows o0 .. o0 + nrows - 1 of expert e against inputs rows[0..n).
inline void Tile(const Stack& w, int64_t e, int64_t o0, int64_t nrows, const Inputs& in, const int32_t* rows, int64_t n,
          float* acc, const uint8_t* next) {
#if defined(JAXSERVE_QUANT_VNNI)
  switch (w.kind) {
    case kQ8_0: return QuantTile<kQ8_0>(w, e, o0, nrows, in, rows, n, acc, next);
    case kQ4_0: return QuantTile<kQ4_0>(w, e, o0, nrows, in, rows, n, acc, next);
    case kQ4_1: return QuantTile<kQ4_1>(w, e, o0, nrows, in, rows, n, acc, next);
    default: return FloatTile(w, e, o0, nrows, in, rows, n, acc, next);
  }
#else
  (void)next;
  PortableTile(w, e, o0, nrows, in, rows, n, acc);
#endif
}

}  // namespace jaxserve_cpu::quant

#endif  // JAXSERVE_KERNELS_CPU_ROW_TILE_H_
