// A mixture-of-experts MLP computed grouped by expert, as an XLA FFI custom
// call (jaxserve.models.moe), routing included.
//
//   x        f32 [E, T]     the layer's input, feature-major
//   router   f32 [X, E]     b_router f32 [X] (or [0]: no bias)
//   gate_up  [X, 2I, E]     q8_0/q4_0/q4_1 blocks (q, scale, min as in
//   down     [X, E, I]      qmatmul_cpu.cc; min unread but for q4_1) or f32
//   b_gate_up f32 [X, 2I], b_down f32 [X, E]   (or [0]: no bias)
//   token_mask s32 [T]     0: a padding token, left out (its output 0), or [0]: none
//   out      f32 [E, T]
//   attributes: top_k, router (0: softmax over all experts then the top k,
//   optionally renormalized; 1: the top k logits then their softmax), the
//   stacks' kinds, the activation (0: silu; 1: gpt-oss's clamped swiglu)
//
// Five steps, four of them on XLA's thread pool:
//
// R. The router logits of every token (the tile below on float32), then on
//    the calling thread each token's top k experts and weights, as
//    moe.route computes them (ties to the lower expert, as lax.top_k).
//    Routing here rather than in XLA keeps a token's choice independent of
//    the batch: XLA's matmul of a few tokens may sum a logit in another
//    order than its matmul of many (tests/test_moe.py).
// 0. (calling thread) The T * k (token, expert) pairs are counted into
//    groups by expert, stable by token, and the inputs quantized per token
//    and block of 32 (quantized gate_up; as quant.quantize_activations and
//    qmatmul_cpu.cc do), once for every expert that reads them.
// 1. Items of (expert, 32 or more rows of the intermediate): the gate and
//    up rows of the expert's tokens, the activation, and (quantized down)
//    the activation quantized per pair and block of 32 intermediate rows.
// 2. Items of (expert, 128 rows of the output): down over the same tokens,
//    one float32 row of E per pair.
// 3. Items of output rows: each token's k pair rows weighted and added in
//    its routing order.
//
// So each expert's weights are read once per call, whatever its number of
// tokens, an expert no token chose is never read, and a token's result is
// a fixed function of its own inputs: a tile computes each (weight row,
// token) the same way whatever else the group holds, and step 3 adds a
// token's k rows in routing order (tests/test_moe.py: bitwise the same
// alone or in a batch).
//
// The tile (row_tile.h): 16 weight rows in the lanes, tokens one at a
// time, a (row, token) summed block by block in qmatmul_cpu.cc's prefill
// loop's order, so the grouped layer is the dense product applied to each
// expert's rows. The next tile's rows are prefetched as a tile reads its
// own.
//
// Indicative only (benchmarks/moe_kernel_ab.py, one Qwen3-30B-A3B layer: 128
// experts of 2 x 768 + 768 rows over 2048, routing included, sides
// alternated in one process on a 2-core AVX-512 VNNI EPYC shared with other
// work, load average about 4.5): Q8_0 stacks at 1 / 8 / 64 / 512 tokens,
// 4.2 / 27 / 52 / 130 ms here against 32 / 400 / 624 / 9,516 ms for the
// pure-JAX loop over expert tiles on the same blocks; float32 stacks 5.0 /
// 48 / 144 / 471 ms against the pure-JAX loop's 9.4 / 126 / 698 / 1,184 and
// ragged_dot_general's 1,980 / 4,876 ms at 1 / 8 tokens (dense over all 128
// experts on the CPU), and 113 / 695 ms for the per-pair gather the kernel
// replaced. Single-threaded on the same machine the tile computed 312 GOP/s
// at 64 tokens a group and 126 GOP/s at 4 (8 experts' gate/up); splitting
// each block's 8 vpdpbusd into two chains measured no faster.
//
// Compile-time dispatch as qmatmul_cpu.cc (quant_blocks.h, which also holds
// the block quantization both use): the intrinsic tiles need AVX-512 VNNI
// and BW; other targets build portable loops with the same integer dots and
// per-(row, token) sums.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "quant_blocks.h"  // defines JAXSERVE_QUANT_VNNI where the intrinsic tiles build
#include "row_tile.h"      // the tile: Stack, Inputs, Tile
#include "run_on_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu::quant;  // kGroup, the kinds, HalfToFloat, QuantizeBlock, ...

constexpr int64_t kUpRowsPerItem = 64;     // step 1: intermediate rows per item (whole blocks)
constexpr int64_t kDownRowsPerItem = 128;  // step 2: output rows per item
constexpr int64_t kCombineRowsPerItem = 256;
enum Activation : int32_t { kSilu = 0, kSwigluOss = 1 };

// A buffer that only grows: the calls of one XLA thread reuse it, so a
// layer's scratch (the pairs' activations and outputs: 6 MB in a
// 64-sequence decode step of Qwen3-30B-A3B's shape) is not mapped afresh,
// page-faulted and zeroed by the kernel on every call. Uninitialised. The
// price: each calling thread keeps its largest call's scratch (about 215 MB
// after a 2,048-token prefill step of that shape).
template <class T>
struct Grow {
  std::unique_ptr<T[]> data;
  int64_t capacity = 0;
  T* Get(int64_t n) {
    if (n > capacity) {
      data.reset(new T[n]);
      capacity = n;
    }
    return data.get();
  }
};

struct InputsBuffers {
  Grow<int8_t> xq;
  Grow<float> dx, dxs, xf;
  Grow<int32_t> start;
};

// Quantizes one row of K floats into row `r` of `in` (as
// quant.quantize_activations and qmatmul_cpu.cc: quant_blocks.h's QuantizeBlock).
void QuantizeRow(const float* x, int64_t r, int32_t kind, Inputs& in, int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t K = in.K, G = in.G;
  if (b1 < 0) b1 = G;
  const int32_t per_block = WeightOffset(kind);
  for (int64_t b = b0; b < b1; ++b) {
    int32_t sum;
    const float d = QuantizeBlock(x + b * kGroup, in.xq + r * K + b * kGroup, &sum);
    in.dx[r * G + b] = d;
    in.start[r * G + b] = -per_block * sum;
    in.dxs[r * G + b] = d * static_cast<float>(sum);
  }
}

void AllocateInputs(Inputs& in, InputsBuffers& b, int64_t rows, int64_t K, bool quantized) {
  in.K = K;
  in.G = K / kGroup;
  if (quantized) {
    in.xq = b.xq.Get(rows * K);
    in.dx = b.dx.Get(rows * in.G);
    in.dxs = b.dxs.Get(rows * in.G);
    in.start = b.start.Get(rows * in.G);
  } else {
    in.xf = b.xf.Get(rows * K);
  }
}


// e^x, written so that a loop of it vectorises (glibc's expf is a call per
// element: 512 pairs x 768 rows of a 64-sequence decode step's layer took a
// call each): x = n ln 2 + r with ln 2 in two parts (the product n ln 2
// exact in the first), e^r by its Taylor series to r^7 (|r| <= 0.35: a
// remainder below 1e-8), 2^n from the exponent bits; x clamped to [-87, 88],
// whose e^x are float32's ends (a sigmoid there is 0 or 1 either way).
[[gnu::always_inline]] inline float Exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The experts' activation over `count` (gate, up) values, into g: silu(g) *
// u, or gpt-oss's (clamp(u) + 1) * g' * sigmoid(alpha * g') with g' = min(g,
// limit) (moe.expert_activation). Branch-free loops, so both vectorise.
void Activate(float* g, const float* u, int64_t count, int32_t activation, float limit, float alpha) {
  if (activation == kSwigluOss) {
    for (int64_t i = 0; i < count; ++i) {
      const float gv = std::min(g[i], limit), uv = std::min(std::max(u[i], -limit), limit);
      g[i] = (uv + 1.0f) * (gv / (1.0f + Exp(-alpha * gv)));
    }
  } else {
    for (int64_t i = 0; i < count; ++i) g[i] = g[i] / (1.0f + Exp(-g[i])) * u[i];
  }
}

struct Moe {
  int64_t E = 0, T = 0, k = 0, X = 0, I = 0, P = 0;
  Stack router, gate_up, down;
  const float* b_router = nullptr;   // [X] or null
  const float* b_gate_up = nullptr;  // [X, 2I] or null
  const float* b_down = nullptr;     // [X, E] or null
  std::vector<float> logits;         // [T, X]
  std::vector<int32_t> ids;          // [T, k]
  std::vector<float> weights;        // [T, k]
  int32_t activation = kSilu;
  float limit = 7.0f, alpha = 1.702f;
  float* out = nullptr;  // [E, T]

  std::vector<int64_t> offset, count;  // per expert: first sorted row, rows
  std::vector<int32_t> token;          // sorted row -> token
  std::vector<int32_t> sorted_of_pair;  // pair t * k + j -> sorted row
  std::vector<int32_t> iota;           // 0, 1, 2, ...: the rows of all tokens, or of a group's pairs
  Inputs x_float;  // per token, float32 (the router's, and a float32 gate_up's)
  Inputs x_in;     // per token, quantized for a quantized gate_up
  Inputs act_in;  // per sorted row, for down
  float* act = nullptr;  // [P, I] (the float act when down is quantized)
  float* y = nullptr;    // [P, E]
  struct Item {
    int32_t expert;
    int32_t r0, r1;
  };
  std::vector<Item> up_items, down_items;
};

// Step R item: router rows [16 item, 16 item + 16) for every token.
void RouterItem(Moe& m, int64_t item) {
  const int64_t T = m.T, X = m.X, r0 = item * kTileRows, nrows = std::min<int64_t>(kTileRows, X - r0);
  std::vector<float> acc(static_cast<size_t>(T * kTileRows));
  Tile(m.router, 0, r0, nrows, m.x_float, m.iota.data(), T, acc.data(), nullptr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < nrows; ++j)
      m.logits[t * X + r0 + j] = m.b_router ? acc[t * kTileRows + j] + m.b_router[r0 + j] : acc[t * kTileRows + j];
}

// One token's experts and weights from its logits, as moe.route: kind 0
// softmax over all, the top k, optionally renormalized; kind 1 the top k
// logits, then their softmax. Top k by value, ties to the lower expert.
void Route(const float* logits, int64_t X, int64_t k, int32_t kind, bool normalize, int32_t* ids, float* weights) {
  std::vector<float> p(logits, logits + X);
  if (kind == 0) {
    float mx = p[0];
    for (int64_t e = 1; e < X; ++e) mx = std::max(mx, p[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < X; ++e) sum += (p[e] = std::exp(p[e] - mx));
    for (int64_t e = 0; e < X; ++e) p[e] /= sum;
  }
  std::vector<bool> taken(static_cast<size_t>(X), false);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < X; ++e)
      if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
    taken[best] = true;
    ids[j] = static_cast<int32_t>(best);
    weights[j] = p[best];
  }
  if (kind == 1) {
    const float mx = weights[0];
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += (weights[j] = std::exp(weights[j] - mx));
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
  } else if (normalize) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += weights[j];
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
  }
}

// Step 1 item: gate and up rows [r0, r1) of an expert, its activation.
void UpItem(Moe& m, const Moe::Item& it) {
  const int64_t e = it.expert, n = m.count[e], I = m.I;
  const int32_t* rows = m.token.data() + m.offset[e];
  std::vector<float> g(static_cast<size_t>(n * kTileRows)), u(static_cast<size_t>(n * kTileRows));
  const bool quantized_down = m.down.kind != kF32;
  const Inputs& in = m.gate_up.kind == kF32 ? m.x_float : m.x_in;
  for (int64_t r = it.r0; r < it.r1; r += kTileRows) {
    const int64_t nrows = std::min<int64_t>(kTileRows, it.r1 - r);
    Tile(m.gate_up, e, r, nrows, in, rows, n, g.data(), m.gate_up.Row(e, I + r));
    const uint8_t* next = r + kTileRows < I ? m.gate_up.Row(e, r + kTileRows) : nullptr;
    Tile(m.gate_up, e, I + r, nrows, in, rows, n, u.data(), next);
    if (m.b_gate_up) {
      const float* bg = m.b_gate_up + e * 2 * I + r;
      const float* bu = bg + I;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < nrows; ++j) g[i * kTileRows + j] += bg[j], u[i * kTileRows + j] += bu[j];
    }
    Activate(g.data(), u.data(), n * kTileRows, m.activation, m.limit, m.alpha);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = (quantized_down ? m.act : m.act_in.xf) + (m.offset[e] + i) * I + r;
      std::memcpy(dst, g.data() + i * kTileRows, sizeof(float) * nrows);
    }
  }
  if (quantized_down) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = m.offset[e] + i;
      QuantizeRow(m.act + s * I, s, m.down.kind, m.act_in, it.r0 / kGroup, it.r1 / kGroup);
    }
  }
}

// Step 2 item: down rows [r0, r1) of an expert over its sorted rows.
void DownItem(Moe& m, const Moe::Item& it) {
  const int64_t e = it.expert, n = m.count[e], E = m.E;
  const int32_t* rows = m.iota.data() + m.offset[e];
  std::vector<float> acc(static_cast<size_t>(n * kTileRows));
  for (int64_t r = it.r0; r < it.r1; r += kTileRows) {
    const int64_t nrows = std::min<int64_t>(kTileRows, it.r1 - r);
    const uint8_t* next = r + kTileRows < E ? m.down.Row(e, r + kTileRows) : nullptr;
    Tile(m.down, e, r, nrows, m.act_in, rows, n, acc.data(), next);
    const float* b = m.b_down ? m.b_down + e * E + r : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      float* dst = m.y + (m.offset[e] + i) * E + r;
      for (int64_t j = 0; j < nrows; ++j) dst[j] = b ? acc[i * kTileRows + j] + b[j] : acc[i * kTileRows + j];
    }
  }
}

// Step 3 item: output rows [r0, r1), each token's pairs in routing order.
void CombineItem(Moe& m, int64_t r0, int64_t r1) {
  const int64_t T = m.T, k = m.k, E = m.E;
  float sum[kCombineRowsPerItem];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = r0; r < r1; ++r) sum[r - r0] = 0.0f;
    for (int64_t j = 0; j < k && m.sorted_of_pair[t * k + j] >= 0; ++j) {  // a masked token: none, out 0
      const float wj = m.weights[t * k + j];
      const float* y = m.y + static_cast<int64_t>(m.sorted_of_pair[t * k + j]) * E;
      for (int64_t r = r0; r < r1; ++r) sum[r - r0] += wj * y[r];
    }
    for (int64_t r = r0; r < r1; ++r) m.out[r * T + t] = sum[r - r0];
  }
}

template <int Step>
struct StepJob {
  Moe* m;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    if (Step == 0) {
      RouterItem(*m, item);
    } else if (Step == 1) {
      UpItem(*m, m->up_items[item]);
    } else if (Step == 2) {
      DownItem(*m, m->down_items[item]);
    } else {
      const int64_t r0 = item * kCombineRowsPerItem;
      CombineItem(*m, r0, std::min(m->E, r0 + kCombineRowsPerItem));
    }
  }
  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

template <int Step>
void RunStep(ffi::ThreadPool& pool, Moe& m, int64_t items) {
  if (items == 0) return;
  auto job = std::make_shared<StepJob<Step>>();
  job->m = &m;
  job->items = items;
  const int64_t threads = jaxserve_cpu::Workers(pool);
  jaxserve_cpu::RunOnThreads(pool, job, threads, items);
}

Stack MakeStack(int32_t kind, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer mins, int64_t X, int64_t O,
                int64_t K) {
  Stack s;
  s.kind = kind;
  s.q = static_cast<const uint8_t*>(q.untyped_data());
  s.scale = static_cast<const uint16_t*>(scale.untyped_data());
  s.mins = static_cast<const uint16_t*>(mins.untyped_data());
  s.O = O;
  s.K = K;
  s.G = K / kGroup;
  s.row_bytes = kind == kF32 ? 4 * K : (kind == kQ8_0 ? K : K / 2);
  s.X = X;
  return s;
}

// Whether a stack's buffers have the shapes of X matrices [O, K] of `kind`.
bool StackShapeOk(int32_t kind, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer mins, int64_t X, int64_t O,
                  int64_t K) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 || qd[0] != X || qd[1] != O) return false;
  if (kind == kF32) return q.element_type() == ffi::DataType::F32 && qd[2] == K;
  if (K % kGroup || qd[2] != (kind == kQ8_0 ? K : K / 2)) return false;
  const auto sd = scale.dimensions();
  if (sd.size() != 3 || sd[0] != X || sd[1] != O || sd[2] != K / kGroup) return false;
  if (kind == kQ4_1) {
    const auto md = mins.dimensions();
    if (md.size() != 3 || md[0] != X || md[1] != O || md[2] != K / kGroup) return false;
  }
  return true;
}

ffi::Error MoeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> router,
                   ffi::Buffer<ffi::F32> b_router, ffi::AnyBuffer gu_q, ffi::AnyBuffer gu_scale, ffi::AnyBuffer gu_min,
                   ffi::AnyBuffer dn_q, ffi::AnyBuffer dn_scale, ffi::AnyBuffer dn_min, ffi::Buffer<ffi::F32> b_gate_up,
                   ffi::Buffer<ffi::F32> b_down, ffi::Buffer<ffi::S32> token_mask, ffi::ResultBuffer<ffi::F32> out,
                   int32_t top_k, int32_t router_kind,
                   int32_t normalize, int32_t kind_gate_up, int32_t kind_down, int32_t activation, float limit,
                   float alpha) {
  const auto xd = x.dimensions(), rd = router.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || rd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("moe_cpu: x, router and out need rank 2");
  }
  const int64_t E = xd[0], T = xd[1], k = top_k;
  const auto gd = gu_q.dimensions();
  if (gd.size() != 3) return ffi::Error::InvalidArgument("moe_cpu: gate_up needs rank 3");
  const int64_t X = gd[0], I = gd[1] / 2;
  auto kind_ok = [](int32_t kd) { return kd >= kQ8_0 && kd <= kF32; };
  if (!kind_ok(kind_gate_up) || !kind_ok(kind_down) || (activation != kSilu && activation != kSwigluOss) ||
      (router_kind != 0 && router_kind != 1)) {
    return ffi::Error::InvalidArgument("moe_cpu: kind must be 0-3, activation and router 0 or 1");
  }
  if (rd[0] != X || rd[1] != E || od[0] != E || od[1] != T || k < 1 || k > X || I < 1 || gd[1] != 2 * I ||
      !StackShapeOk(kind_gate_up, gu_q, gu_scale, gu_min, X, 2 * I, E) ||
      !StackShapeOk(kind_down, dn_q, dn_scale, dn_min, X, E, I) || (kind_down != kF32 && I % kGroup)) {
    return ffi::Error::InvalidArgument(
        "moe_cpu: needs x [E, T], router [X, E], gate_up [X, 2I, E] and down [X, E, I] stacks of their kinds, "
        "1 <= top_k <= X");
  }
  const bool has_mask = token_mask.element_count() > 0;
  if (has_mask && token_mask.element_count() != static_cast<size_t>(T)) {
    return ffi::Error::InvalidArgument("moe_cpu: token_mask must be [T] (or empty: every token)");
  }
  const bool has_br = b_router.element_count() > 0;
  const bool has_bgu = b_gate_up.element_count() > 0, has_bdn = b_down.element_count() > 0;
  if ((has_br && b_router.element_count() != static_cast<size_t>(X)) ||
      (has_bgu && b_gate_up.element_count() != static_cast<size_t>(X * 2 * I)) ||
      (has_bdn && b_down.element_count() != static_cast<size_t>(X * E))) {
    return ffi::Error::InvalidArgument("moe_cpu: b_router must be [X], b_gate_up [X, 2I] and b_down [X, E] (or empty)");
  }
  Moe m;
  m.E = E, m.T = T, m.k = k, m.X = X, m.I = I, m.P = T * k;
  m.router.kind = kF32;
  m.router.q = reinterpret_cast<const uint8_t*>(router.typed_data());
  m.router.O = X, m.router.K = E, m.router.row_bytes = 4 * E;
  m.gate_up = MakeStack(kind_gate_up, gu_q, gu_scale, gu_min, X, 2 * I, E);
  m.down = MakeStack(kind_down, dn_q, dn_scale, dn_min, X, E, I);
  m.b_router = has_br ? b_router.typed_data() : nullptr;
  m.b_gate_up = has_bgu ? b_gate_up.typed_data() : nullptr;
  m.b_down = has_bdn ? b_down.typed_data() : nullptr;
  m.activation = activation, m.limit = limit, m.alpha = alpha;
  m.out = out->typed_data();
  if (T == 0) return ffi::Error::Success();
  m.iota.resize(std::max(T, m.P));
  for (size_t i = 0; i < m.iota.size(); ++i) m.iota[i] = static_cast<int32_t>(i);

  // The inputs token-major in float32 (the router's), quantized for a quantized gate_up.
  const float* xf = x.typed_data();
  // scratch of this calling thread, kept for its next call (see Grow)
  thread_local InputsBuffers x_float_buffers, x_buffers, act_buffers;
  thread_local Grow<float> act_buffer, y_buffer;
  AllocateInputs(m.x_float, x_float_buffers, T, E, false);
  for (int64_t f = 0; f < E; ++f)
    for (int64_t t = 0; t < T; ++t) m.x_float.xf[t * E + f] = xf[f * T + t];
  if (kind_gate_up != kF32) {
    AllocateInputs(m.x_in, x_buffers, T, E, true);
    for (int64_t t = 0; t < T; ++t) QuantizeRow(m.x_float.xf + t * E, t, kind_gate_up, m.x_in);
  }

  // Step R: logits, then each token's experts.
  m.logits.resize(T * X);
  RunStep<0>(pool, m, (X + kTileRows - 1) / kTileRows);
  m.ids.resize(m.P);
  m.weights.resize(m.P);
  for (int64_t t = 0; t < T; ++t)
    Route(m.logits.data() + t * X, X, k, router_kind, normalize != 0, m.ids.data() + t * k, m.weights.data() + t * k);

  // Step 0: group the pairs by expert (counting sort, stable by token); a
  // masked token's pairs are left out (sorted row -1).
  const int32_t* id = m.ids.data();
  const int32_t* keep = has_mask ? token_mask.typed_data() : nullptr;
  m.count.assign(X, 0);
  for (int64_t p = 0; p < m.P; ++p)
    if (!keep || keep[p / k]) ++m.count[id[p]];
  m.offset.assign(X, 0);
  for (int64_t e = 1; e < X; ++e) m.offset[e] = m.offset[e - 1] + m.count[e - 1];
  const int64_t used = m.offset[X - 1] + m.count[X - 1];  // sorted rows
  std::vector<int64_t> fill(m.offset);
  m.token.resize(used);
  m.sorted_of_pair.resize(m.P);
  for (int64_t p = 0; p < m.P; ++p) {
    if (keep && !keep[p / k]) {
      m.sorted_of_pair[p] = -1;
      continue;
    }
    const int64_t s = fill[id[p]]++;
    m.token[s] = static_cast<int32_t>(p / k);
    m.sorted_of_pair[p] = static_cast<int32_t>(s);
  }
  AllocateInputs(m.act_in, act_buffers, used, I, kind_down != kF32);
  if (kind_down != kF32) m.act = act_buffer.Get(used * I);
  m.y = y_buffer.Get(used * E);

  for (int64_t e = 0; e < X; ++e) {
    if (m.count[e] == 0) continue;
    for (int64_t r = 0; r < I; r += kUpRowsPerItem)
      m.up_items.push_back({static_cast<int32_t>(e), static_cast<int32_t>(r), static_cast<int32_t>(std::min(I, r + kUpRowsPerItem))});
    for (int64_t r = 0; r < E; r += kDownRowsPerItem)
      m.down_items.push_back({static_cast<int32_t>(e), static_cast<int32_t>(r), static_cast<int32_t>(std::min(E, r + kDownRowsPerItem))});
  }
  RunStep<1>(pool, m, static_cast<int64_t>(m.up_items.size()));
  RunStep<2>(pool, m, static_cast<int64_t>(m.down_items.size()));
  RunStep<3>(pool, m, (E + kCombineRowsPerItem - 1) / kCombineRowsPerItem);
  return ffi::Error::Success();
}

// MoeImpl's binding, in its parameters' order.
auto MoeBinding() {
  auto routing = ffi::Ffi::Bind()
                     .Ctx<ffi::ThreadPool>()
                     .Arg<ffi::Buffer<ffi::F32>>()   // x
                     .Arg<ffi::Buffer<ffi::F32>>()   // router
                     .Arg<ffi::Buffer<ffi::F32>>();  // b_router
  return QuantizedWeightArgs(QuantizedWeightArgs(std::move(routing)))  // gate_up's stack, then down's
      .Arg<ffi::Buffer<ffi::F32>>()                                     // b_gate_up
      .Arg<ffi::Buffer<ffi::F32>>()                                     // b_down
      .Arg<ffi::Buffer<ffi::S32>>()                                     // token_mask
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int32_t>("top_k")
      .Attr<int32_t>("router")
      .Attr<int32_t>("normalize")
      .Attr<int32_t>("kind_gate_up")
      .Attr<int32_t>("kind_down")
      .Attr<int32_t>("activation")
      .Attr<float>("limit")
      .Attr<float>("alpha");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeCpu, MoeImpl, MoeBinding());
