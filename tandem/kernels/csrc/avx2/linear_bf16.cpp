// bf16 linear for every token count, AVX2 + FMA: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in
// and out, fp32 in registers (bf16 widens to fp32 exactly, so each product is exact in the FMA).
//
// Each (token, row) output is one 8-lane fp32 accumulator over K in order (_mm256_fmadd_ps; per
// group of 16 columns, lane j adds column 2j then column 2j + 1: the even / odd split widens bf16
// with an AND and a shift, gemm.h widen16; a zero-padded tail), then hsum8 and Output::store: the
// same operations whatever M is, so a token's output is bit-identical alone or in any batch.
// - M <= 3 (decode, memory-bound): rows are read once, straight from the bf16 weights, 4 rows at a
//   time (4 sequential streams, 4 independent FMA chains per token).
// - M >= 4 (compute-bound): the usual cache blocking of a GEMM (Goto & van de Geijn, "Anatomy of
//   high-performance matrix multiplication", 2008): a thread converts a block of kRowBlock rows x
//   kChunk columns of w to fp32 once into an L1 buffer and runs every token through it with a
//   3-token x 4-row register tile (12 accumulators + 3 activations + 1 weight = the 16 ymm
//   registers); the unreduced accumulators wait in a buffer between K chunks.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "gemm.h"
#include "ops.h"

namespace {

using tandem::avx2::hsum8;
using tandem::avx2::Output;

constexpr int64_t kRowBlock = 16;  // rows of one fp32 weight block
constexpr int64_t kChunk = 256;    // columns of one block: 16 x 256 x 4 bytes = 16 KB in L1

// Half h (0: even columns, 1: odd) of the 16 weights at p: bf16 widened here, or an fp32 block
// already in the split layout.
inline __m256 load_w(const uint16_t* p, int h) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return h == 0 ? tandem::avx2::bf16_even(raw) : tandem::avx2::bf16_odd(raw);
}
inline __m256 load_w(const float* p, int h) { return _mm256_loadu_ps(p + 8 * h); }

// acc[m * RB + r] += x[m, k] * w[r, k] for k in [0, n) (n a multiple of 16; x in the split layout).
// W: bf16 weights or an fp32 block. Always inlined, so the accumulators stay in registers. pf (or
// nullptr): RB rows (stride ldw) to prefetch, one cache line per row per 32 columns.
template <int MB, int RB, typename W>
__attribute__((always_inline)) inline void accumulate(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t n,
                                                      __m256* acc, const W* pf = nullptr) {
  for (int64_t k = 0; k < n; k += 16) {
    if (pf != nullptr && (k & 31) == 0)
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 xv[MB];
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256 wv = load_w(w + r * ldw + k, h);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) acc[m * RB + r] = _mm256_fmadd_ps(xv[m], wv, acc[m * RB + r]);
      }
    }
  }
}

// MB tokens x RB rows straight from the bf16 weights (K columns; x32 zero-padded to a multiple of 16,
// the weights' tail loaded as zeros), reduced and stored. pf: the next tile's rows (or nullptr).
// NOTE: rows of a few KB are short streams for the hardware prefetcher (measured 5 GB/s at K = 896
// against 9 GB/s at K = 4864 on one loaded Zen 3 core), so the next tile is requested by hand.
template <int MB, int RB>
void direct_tile(const float* x32, int64_t ldx, const uint16_t* w, int64_t K, int64_t m0, int64_t row0,
                 const Output& out, const uint16_t* pf = nullptr) {
  __m256 acc[MB * RB];
#pragma GCC unroll 16
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t full = K / 16 * 16;
  accumulate<MB, RB>(x32, ldx, w, K, full, acc, pf);
  if (full < K) {
    alignas(32) float tail[RB][16];
    for (int r = 0; r < RB; ++r)
      tandem::avx2::widen16(reinterpret_cast<const c10::BFloat16*>(w + r * K + full), K - full, tail[r]);
    accumulate<MB, RB>(x32 + full, ldx, &tail[0][0], 16, 16, acc);
  }
  float sums[MB * RB];
  for (int i = 0; i < MB * RB; ++i) sums[i] = hsum8(acc[i]);
  out.store(sums, RB, MB, m0, row0);
}

template <int MB>
void direct_rows(const float* x32, int64_t ldx, const uint16_t* w, int64_t N, int64_t K, int64_t m0,
                 const Output& out, int64_t begin, int64_t end) {
  int64_t row = begin;
  for (; row + 4 <= end; row += 4)
    direct_tile<MB, 4>(x32, ldx, w + row * K, K, m0, row, out, row + 8 <= end ? w + (row + 4) * K : nullptr);
  for (; row < end; ++row) direct_tile<MB, 1>(x32, ldx, w + row * K, K, m0, row, out);
}

// M <= 3: every token with every row, rows split over threads.
void run_direct(const float* x32, int64_t ldx, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                const Output& out) {
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (M == 1) direct_rows<1>(x32, ldx, w, N, K, 0, out, begin, end);
    if (M == 2) direct_rows<2>(x32, ldx, w, N, K, 0, out, begin, end);
    if (M == 3) direct_rows<3>(x32, ldx, w, N, K, 0, out, begin, end);
  });
}

// One register tile of the blocked path: tokens [m, m + MB) x RB rows of the fp32 block, columns
// [k0, k0 + n); the accumulators live in accbuf [M][kRowBlock] between chunks.
template <int MB, int RB>
inline void block_tile(const float* x32, int64_t ldx, const float* wb, int64_t m, int64_t r0, int64_t k0,
                       int64_t n, __m256* accbuf) {
  __m256 acc[MB * RB];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
      acc[i * RB + r] = k0 == 0 ? _mm256_setzero_ps() : accbuf[(m + i) * kRowBlock + r0 + r];
  accumulate<MB, RB>(x32 + m * ldx + k0, ldx, wb + r0 * kChunk, kChunk, n, acc);
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) accbuf[(m + i) * kRowBlock + r0 + r] = acc[i * RB + r];
}

template <int RB>
inline void block_tokens(const float* x32, int64_t ldx, const float* wb, int64_t M, int64_t r0, int64_t k0,
                         int64_t n, __m256* accbuf) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block_tile<3, RB>(x32, ldx, wb, m, r0, k0, n, accbuf);
  if (M - m == 2) block_tile<2, RB>(x32, ldx, wb, m, r0, k0, n, accbuf);
  if (M - m == 1) block_tile<1, RB>(x32, ldx, wb, m, r0, k0, n, accbuf);
}

// M >= 4: blocks of kRowBlock rows split over threads; per block and K chunk, the weights are
// widened to fp32 once and every token runs through them.
void run_blocked(const float* x32, int64_t ldx, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                 const Output& out) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock, K16 = ldx;
  tandem::avx2::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(kRowBlock * kChunk);
    std::vector<__m256> accbuf(M * kRowBlock);
    std::vector<float> sums(M * kRowBlock);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t row0 = blk * kRowBlock, rows = std::min(kRowBlock, N - row0);
      for (int64_t k0 = 0; k0 < K16; k0 += kChunk) {
        const int64_t n = std::min(kChunk, K16 - k0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < n; k += 16)
            tandem::avx2::widen16(reinterpret_cast<const c10::BFloat16*>(w + (row0 + r) * K + k0 + k), K - k0 - k,
                                  &wbuf[r * kChunk + k]);
        int64_t r0 = 0;
        for (; r0 + 4 <= rows; r0 += 4) block_tokens<4>(x32, ldx, wbuf.data(), M, r0, k0, n, accbuf.data());
        for (; r0 < rows; ++r0) block_tokens<1>(x32, ldx, wbuf.data(), M, r0, k0, n, accbuf.data());
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) sums[m * rows + r] = hsum8(accbuf[m * kRowBlock + r]);
      out.store(sums.data(), rows, M, 0, row0);
    }
  });
}

}  // namespace

// x [M, K] bf16, w [N, K] bf16 (contiguous), bias [N] bf16 or None -> y [M, N] bf16, any M.
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_bf16: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(w.is_contiguous(), "linear_bf16: w must be contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor b;
  at::Tensor y = tandem::avx2::prepare_linear(x, N, K, bias, b, "linear_bf16");
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return y;
  const Output out(y, nullptr, b);
  const std::vector<float> x32 = tandem::avx2::activations_fp32(x);
  const int64_t ldx = tandem::avx2::round_up(K, 16);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (M <= 3)
    run_direct(x32.data(), ldx, wp, M, N, K, out);
  else
    run_blocked(x32.data(), ldx, wp, M, N, K, out);
  return y;
}
