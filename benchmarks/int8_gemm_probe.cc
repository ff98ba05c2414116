// int8 GEMM rate of this CPU: the ceiling an int8 (VNNI) kernel works against.
//
// Built and run by benchmarks/machine_rates.py (g++ -O3 -march=native -fopenmp);
// prints one line: "<M> <N> <K> <median seconds> <GOP/s> <checksum>" (an op is a multiply or an
// add, as for the f32 GFLOP/s figure). C[M,N] (int32) = A[M,K] (uint8) x
// B[K,N] (int8), B packed four k at a time per column (the layout vpdpbusd
// reads), 4 rows x 64 columns of C held in 16 zmm accumulators, column panels
// of B split over the OpenMP threads and kept in L2 while every row block
// passes. Not a tuned library kernel: a reference point that a serious int8
// kernel should reach or pass. Without AVX-512 VNNI it prints "unsupported".
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

static void gemm(const uint8_t* a, const int8_t* bp, int32_t* c, int m, int n, int k) {
  // bp: [n/64][k/4][64][4]
#pragma omp parallel for schedule(static)
  for (int jb = 0; jb < n / 64; ++jb) {
    const int8_t* panel = bp + static_cast<size_t>(jb) * k * 64;
    for (int i = 0; i < m; i += 4) {
      __m512i acc[4][4];
      for (int r = 0; r < 4; ++r)
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_si512();
      for (int kk = 0; kk < k; kk += 4) {
        const int8_t* bk = panel + static_cast<size_t>(kk) * 64;
        __m512i b0 = _mm512_loadu_si512(bk);
        __m512i b1 = _mm512_loadu_si512(bk + 64);
        __m512i b2 = _mm512_loadu_si512(bk + 128);
        __m512i b3 = _mm512_loadu_si512(bk + 192);
        for (int r = 0; r < 4; ++r) {
          int32_t word;
          __builtin_memcpy(&word, a + static_cast<size_t>(i + r) * k + kk, 4);
          __m512i av = _mm512_set1_epi32(word);
          acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
          acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
          acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], av, b2);
          acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], av, b3);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int q = 0; q < 4; ++q)
          _mm512_storeu_si512(c + static_cast<size_t>(i + r) * n + jb * 64 + q * 16, acc[r][q]);
    }
  }
}

int main(int argc, char** argv) {
  const int size = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const int m = size, n = size, k = size;
  std::vector<uint8_t> a(static_cast<size_t>(m) * k);
  std::vector<int8_t> bp(static_cast<size_t>(k) * n);
  std::vector<int32_t> c(static_cast<size_t>(m) * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7 % 251);
  for (size_t i = 0; i < bp.size(); ++i) bp[i] = static_cast<int8_t>(i * 13 % 127 - 63);
  std::vector<double> times;
  for (int rep = 0; rep < reps + 1; ++rep) {  // the first is a warm-up
    auto t0 = std::chrono::steady_clock::now();
    gemm(a.data(), bp.data(), c.data(), m, n, k);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  const double best = times[times.size() / 2];  // the median, as the f32 figure
  long long check = 0;
  for (size_t i = 0; i < c.size(); i += 4099) check += c[i];
  std::printf("%d %d %d %.6f %.1f %lld\n", m, n, k, best, 2.0 * m * n * k / best / 1e9, check);
  return 0;
}
#else
int main() {
  std::printf("unsupported\n");
  return 0;
}
#endif
