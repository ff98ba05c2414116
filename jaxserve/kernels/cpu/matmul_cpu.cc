// Dense float32 matmul for few tokens, as an XLA FFI custom call.
//
// Why a hand-written kernel: a decode step multiplies every weight matrix by
// the hidden states of a few dozen tokens, feature-major [I, T] with T <= 64
// or so. XLA's CPU backend runs these at about half of the machine's matmul
// rate (87 GFLOP/s for [1024, 512] x [512, 64] against 185 for the
// vocabulary projection, BENCHMARKS.md): the library's packing and thread
// hand-over cost as much as the arithmetic at this size. The product needs
// no packing when T is a multiple of 16: each row of x is T / 16 vectors of
// tokens, and a tile of R weight rows times those vectors lives in the
// vector registers for the whole reduction (AVX-512's 32: up to 64 tokens;
// AVX2's 16: 6 rows x 16 tokens), one broadcast weight times a vector of
// tokens per FMA.
//
//   w   f32 [O, I]   weights, row-major (the model's [out, in])
//   x   f32 [I, T]   inputs, feature-major; T a multiple of 16
//   out f32 [O, T]   w @ x
//
// Each output is one float32 sum over k = 0 .. I-1 in that order, whatever T
// is, whichever thread computes it: a token's result never depends on the
// rest of the batch.

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

// The register tile, R rows x TV vectors of 16 tokens, R = kAccumulators / TV.
// AVX-512: 24 of the 32 registers (the rest hold x), up to 4 vectors (64
// tokens) at once. AVX2, where a Vec is two of 16 registers: 6 rows x 16
// tokens, 12 registers (the shape of the classic 6 x 16 AVX2 micro-kernel),
// the token groups of a tile's rows run back to back while the rows stay in L1.
constexpr bool kWide = jaxserve_cpu::kRegistersPerVec == 1;
constexpr int kAccumulators = kWide ? 24 : 6;
constexpr int kMaxTV = kWide ? 4 : 1;
constexpr int kAheadTiles = 2;  // how far below a tile its weight rows are prefetched

using jaxserve_cpu::Fma;
using jaxserve_cpu::kLanes;  // tokens per vector (and the T granularity)
using jaxserve_cpu::Load;
using jaxserve_cpu::Store;
using jaxserve_cpu::Vec;
using jaxserve_cpu::Zero;

// out[0:R, 0:16*TV] = w[0:R, :] @ x[:, 0:16*TV]; rows of x are ldx apart,
// rows of out ldo. Once per cache line of its rows, the tile asks for the
// same line of the rows kAheadTiles tiles below (T2 hint): 2-9% faster for a
// chain of decode layers at 64 tokens, weights hot or not (commit 9489a6e).
template <int R, int TV>
void Tile(const float* w, int64_t I, const float* x, int64_t ldx, float* out, int64_t ldo) {
  Vec acc[R][TV];
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int j = 0; j < TV; ++j) acc[r][j] = Zero();
  for (int64_t k = 0; k < I; ++k) {
    if ((k & (kLanes - 1)) == 0)
      JAXSERVE_UNROLL for (int r = 0; r < R; ++r) __builtin_prefetch(w + (kAheadTiles * R + r) * I + k, 0, 1);
    Vec xv[TV];
    JAXSERVE_UNROLL for (int j = 0; j < TV; ++j) xv[j] = Load(x + k * ldx + kLanes * j);
    JAXSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const float a = w[r * I + k];
      JAXSERVE_UNROLL for (int j = 0; j < TV; ++j) acc[r][j] = Fma(a, xv[j], acc[r][j]);
    }
  }
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int j = 0; j < TV; ++j) Store(out + r * ldo + kLanes * j, acc[r][j]);
}

// Where the tiles find x's columns: x itself ([I, T], rows T apart), or its
// copy in panels of kPanel columns (panel p holds columns [p * kPanel, ...)
// as [I, width] with rows width apart, width = min(kPanel, T - p * kPanel)).
// Tiles start on panel boundaries, so a tile's columns lie in one panel.
constexpr int64_t kPanel = kMaxTV * kLanes;
struct Inputs {
  const float* x;
  int64_t I, T;
  bool panels;
  const float* At(int64_t c) const { return panels ? x + c * I : x + c; }  // column c's panel starts at c * I
  int64_t Ld(int64_t c) const { return panels ? std::min(kPanel, T - c / kPanel * kPanel) : T; }
};

// Rows [o0, o1) of out for token columns [c0, c1), in groups of 16 * TV: per
// tile of R rows, the groups in turn.
template <int TV>
void Rows(const float* w, int64_t I, const Inputs& x, int64_t T, float* out, int64_t o0, int64_t o1, int64_t c0,
          int64_t c1) {
  constexpr int R = kAccumulators / TV;
  constexpr int64_t width = TV * kLanes;
  int64_t o = o0;
  for (; o + R <= o1; o += R)
    for (int64_t c = c0; c < c1; c += width) Tile<R, TV>(w + o * I, I, x.At(c), x.Ld(c), out + o * T + c, T);
  for (; o < o1; ++o)
    for (int64_t c = c0; c < c1; c += width) Tile<1, TV>(w + o * I, I, x.At(c), x.Ld(c), out + o * T + c, T);
}

// Work shared by the calling thread and the pool's tasks (run_on_pool.h).
// An item is a block of rows, every token column.
struct Job {
  const float* w;
  Inputs x;
  float* out;
  int64_t O, I, T;
  int64_t rows_per_item, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItem(int64_t item) const {
    const int64_t o0 = item * rows_per_item, o1 = std::min(O, o0 + rows_per_item);
    // groups of kMaxTV vectors, then one narrower group for the rest
    const int64_t full = T / (kMaxTV * kLanes) * (kMaxTV * kLanes);
    // Panels one after another, each through all the item's rows: one panel
    // (I x 64 floats) and the item's weight rows stay in L2 together, where
    // the whole of a wide x (3 MB at 512 tokens of a 1536-wide input) did not.
    for (int64_t c = 0; c < full; c += x.panels ? kPanel : full) Rows<kMaxTV>(w, I, x, T, out, o0, o1, c, x.panels ? c + kPanel : full);
    switch ((T - full) / kLanes) {
      case 3: Rows<3>(w, I, x, T, out, o0, o1, full, T); break;
      case 2: Rows<2>(w, I, x, T, out, o0, o1, full, T); break;
      case 1: Rows<1>(w, I, x, T, out, o0, o1, full, T); break;
      default: break;
    }
  }

  void Run() { jaxserve_cpu::RunItems(*this, items); }
};

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions(), xd = x.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || xd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("matmul_cpu: w, x and out need rank 2");
  }
  if (xd[0] != wd[1] || od[0] != wd[0] || od[1] != xd[1] || xd[1] % kLanes) {
    return ffi::Error::InvalidArgument("matmul_cpu: needs w [O, I], x [I, T], out [O, T], T a multiple of 16");
  }
  auto job = std::make_shared<Job>();
  job->w = w.typed_data();
  job->out = out->typed_data();
  job->O = wd[0];
  job->I = wd[1];
  job->T = xd[1];
  job->x = Inputs{x.typed_data(), job->I, job->T, job->T > kPanel};
  if (job->x.panels) {
    // Wider than one tile (prefill-sized programs): x's rows are T floats
    // apart, so a tile reading 64 columns of each of I rows touched a new
    // page every few rows and kept the prefetchers guessing (about 0.7x the
    // 64-token rate at 512 tokens). Copied once into panels of 64 columns,
    // each tile reads one contiguous run. The copy is this thread's buffer,
    // reused across calls; the helpers read it only until the job is done.
    thread_local std::vector<float> packed;
    packed.resize(job->I * job->T);
    const float* src = x.typed_data();
    for (int64_t c0 = 0; c0 < job->T; c0 += kPanel) {
      const int64_t width = std::min(kPanel, job->T - c0);
      float* dst = packed.data() + c0 * job->I;
      for (int64_t k = 0; k < job->I; ++k) std::copy(src + k * job->T + c0, src + k * job->T + c0 + width, dst + k * width);
    }
    job->x.x = packed.data();
  }
  // About 8 items per thread for balance, each a whole number of 6-row tiles
  // (the tile height at 64 columns, and AVX2's) of at least 48 rows.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->rows_per_item = std::max<int64_t>(48, (job->O / (8 * threads) + 5) / 6 * 6);
  job->items = (job->O + job->rows_per_item - 1) / job->rows_per_item;
  jaxserve_cpu::RunOnThreads(pool, job, threads, job->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
