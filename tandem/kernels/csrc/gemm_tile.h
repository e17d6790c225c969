// The bf16 dot-product micro-kernel shared by the bf16 and the weight-only quantized linear kernels.
//
// dot_tile<MB, RB> computes MB x RB dot products of length K: rows of w in their natural [N, K]
// layout, tokens of x [M, K]. Each `vdpbf16ps` (_mm512_dpbf16_ps, Intel SDM "VDPBF16PS") multiplies
// 32 bf16 pairs exactly and adds them into 16 fp32 lanes; lanes are summed at the end.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

// NOTE: GCC keeps arrays of vector accumulators on the stack (a store and a load per dot product,
// 15% slower when streaming from DRAM) unless the small loops over them are unrolled early.
#define TANDEM_UNROLL _Pragma("GCC unroll 16")

namespace tandem {

constexpr int kRowTile = 4;

// Where a linear kernel writes: y [M, N] bf16 = acc (* scale[n]) (+ bias[n]). Raw pointers, fetched
// once per call: rows can take only ~50 ns each, so per-row tensor accessors would cost 20-40%.
struct Output {
  c10::BFloat16* y;
  int64_t N;
  const float* scale;          // per-row scale or nullptr
  const c10::BFloat16* bias;   // or nullptr

  // acc [M, rows] holds rows row0 .. row0 + rows - 1.
  inline void store(const float* acc, int rows, int64_t M, int64_t row0) const {
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) {
        float v = acc[m * rows + r];
        if (scale != nullptr) v *= scale[row0 + r];
        if (bias != nullptr) v += static_cast<float>(bias[row0 + r]);
        y[m * N + row0 + r] = c10::BFloat16(v);
      }
  }
};

inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh load_bf16_masked(const uint16_t* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// out[m * RB + r] = sum_k x[m, k] * w[r, k] for MB tokens and RB rows.
// pf (or nullptr): rows to prefetch into L1, one cache line per row per 32 elements.
template <int MB, int RB>
inline void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* out,
                     const uint16_t* pf) {
  __m512 acc[MB][RB];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m)
    TANDEM_UNROLL
    for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf != nullptr)
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T0);
    __m512bh wv[RB];
    TANDEM_UNROLL
    for (int r = 0; r < RB; ++r) wv[r] = load_bf16(w + r * ldw + k);
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      __m512bh xv = load_bf16(x + m * ldx + k);
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (k < K) {
    // NOTE: masked-off lanes load as zero, so any K (odd included) works: 0 * 0 adds nothing.
    const __mmask32 mask = (__mmask32)((1ULL << (K - k)) - 1);
    __m512bh wv[RB];
    TANDEM_UNROLL
    for (int r = 0; r < RB; ++r) wv[r] = load_bf16_masked(w + r * ldw + k, mask);
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      __m512bh xv = load_bf16_masked(x + m * ldx + k, mask);
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m)
    TANDEM_UNROLL
    for (int r = 0; r < RB; ++r) out[m * RB + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// out[m] = sum_k x[m, k] * w[k] for MB tokens and one row, U accumulators per token (K unrolled
// by 32 U). One row at a time keeps a single sequential stream for the hardware prefetcher, which
// measured faster for 1-2 tokens (memory-bound) than interleaving 4 rows (36 vs 28 GB/s on one
// Zen 4 core); more tokens are compute-bound and use 4-row tiles, which load less per dot product.
template <int MB, int U>
inline void dot_row(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out) {
  __m512 acc[MB][U];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m)
    TANDEM_UNROLL
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U)
    TANDEM_UNROLL
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = load_bf16(w + k + 32 * u);
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], load_bf16(x + m * ldx + k + 32 * u), wv);
    }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1ULL << (K - k)) - 1);
    const __m512bh wv = load_bf16_masked(w + k, mask);
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], load_bf16_masked(x + m * ldx + k, mask), wv);
  }
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[m][0];
    TANDEM_UNROLL
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    out[m] = _mm512_reduce_add_ps(sum);
  }
}

// out [M, RB] = x [M, K] (row stride ldx) . w [RB, K] (row stride ldw), tokens 4 at a time.
// NOTE: only the first token pass prefetches `next`: later passes re-read the tile from L1, which
// breaks the hardware prefetcher's sequential stream, so the next tile must be requested by hand.
template <int RB>
inline void dot_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t ldw,
                     float* out, const uint16_t* next) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile<4, RB>(x + m * ldx, ldx, w, ldw, K, out + m * RB, m == 0 ? next : nullptr);
  const uint16_t* pf = m == 0 ? next : nullptr;
  switch (M - m) {
    case 3: dot_tile<3, RB>(x + m * ldx, ldx, w, ldw, K, out + m * RB, pf); break;
    case 2: dot_tile<2, RB>(x + m * ldx, ldx, w, ldw, K, out + m * RB, pf); break;
    case 1: dot_tile<1, RB>(x + m * ldx, ldx, w, ldw, K, out + m * RB, pf); break;
    default: break;
  }
}

}  // namespace tandem
