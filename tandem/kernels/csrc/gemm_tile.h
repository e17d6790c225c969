// The bf16 dot-product micro-kernel shared by the bf16 and the weight-only quantized linear kernels.
//
// dot_tile<MB, RB> computes MB x RB dot products of length K: rows of w in their natural [N, K]
// layout, tokens of x [M, K]. Each `vdpbf16ps` (_mm512_dpbf16_ps, Intel SDM "VDPBF16PS") multiplies
// 32 bf16 pairs exactly and adds them into 16 fp32 lanes; lanes are summed at the end.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

  // The same result as store (bit for bit; overwrites acc), converting 16 values at a time instead of
  // one: at 16 tokens and K = 896 the scalar store took ~10% of linear_bf16's time.
  inline void store_vec(float* acc, int rows, int64_t M, int64_t row0) const {
    const int64_t n = M * rows;
    if (scale != nullptr || bias != nullptr)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = row0 + i % rows;
        if (scale != nullptr) acc[i] *= scale[row];
        if (bias != nullptr) acc[i] += static_cast<float>(bias[row]);
      }
    constexpr int kChunk = 128;  // floats converted at a time, whole tokens
    const int64_t tokens = rows > kChunk ? 1 : kChunk / rows;
    alignas(64) uint16_t tmp[kChunk + 16];
    for (int64_t m0 = 0; m0 < M; m0 += tokens) {
      const int64_t mt = M - m0 < tokens ? M - m0 : tokens, count = mt * rows;
      const float* src = acc + m0 * rows;
      for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 mask = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + i), to_bf16(_mm512_maskz_loadu_ps(mask, src + i)));
      }
      for (int64_t m = 0; m < mt; ++m) std::memcpy(y + (m0 + m) * N + row0, tmp + m * rows, rows * sizeof(uint16_t));
    }
  }

  // 16 floats -> bf16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's own rule
  // (c10/util/BFloat16.h round_to_nearest_even), so store and store_vec agree bit for bit.
  static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
};

inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh load_bf16_masked(const uint16_t* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// acc[m * RB + r] += sum_k x[m, k] * w[r, k] for MB tokens and RB rows: the shared inner loop of
// dot_tile and dot_tile_sums (always inlined, so the accumulators stay in registers).
// pf (or nullptr): rows to prefetch into L1, one cache line per row per 32 elements.
template <int MB, int RB>
__attribute__((always_inline)) inline void accumulate_tile(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                           int64_t ldw, int64_t K, __m512* acc, const uint16_t* pf) {
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
      const __m512bh xv = load_bf16(x + m * ldx + k);
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) acc[m * RB + r] = _mm512_dpbf16_ps(acc[m * RB + r], xv, wv[r]);
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
      const __m512bh xv = load_bf16_masked(x + m * ldx + k, mask);
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) acc[m * RB + r] = _mm512_dpbf16_ps(acc[m * RB + r], xv, wv[r]);
    }
  }
}

// out[m * RB + r] = sum_k x[m, k] * w[r, k] for MB tokens and RB rows, each sum reduced on its own.
template <int MB, int RB>
inline void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* out,
                     const uint16_t* pf) {
  __m512 acc[MB * RB];
  TANDEM_UNROLL
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm512_setzero_ps();
  accumulate_tile<MB, RB>(x, ldx, w, ldw, K, acc, pf);
  TANDEM_UNROLL
  for (int i = 0; i < MB * RB; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
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

// ---- Tiles with a transposing reduction (bf16 linear, 3 or more tokens) ----
// Each dot product ends as 16 fp32 lanes to be summed. _mm512_reduce_add_ps takes ~8 instructions
// per dot product; at K = 896 (28 vdpbf16ps per dot product) that is a third of the work. sum16
// sums 16 vectors at once in 46 instructions: halve the lanes of pairs of vectors, interleaving
// them, until each lane holds one vector's total (the usual transpose-and-add reduction).

// r[n] = sum of the 16 lanes of v[n], n < 16.
inline __m512 sum16(const __m512* v) {
  __m512 s[8], t[4], u[2];
  TANDEM_UNROLL
  for (int j = 0; j < 8; ++j)  // s[j]: 128-bit quarters 0-1 hold 8-lane partials of v[2j], 2-3 of v[2j+1]
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  TANDEM_UNROLL
  for (int j = 0; j < 4; ++j)  // t[j]: quarter q holds a 4-lane partial of v[4j + q]
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  TANDEM_UNROLL
  for (int j = 0; j < 2; ++j)  // u[j]: quarter q holds 2-lane partials of v[8j + q] and v[8j + 4 + q], interleaved
    u[j] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * j], t[2 * j + 1]), _mm512_unpackhi_ps(t[2 * j], t[2 * j + 1]));
  const __m512d g = _mm512_castps_pd(u[0]), h = _mm512_castps_pd(u[1]);
  // r[4q + i] = sum of v[4i + q]; the permutation puts sum v[n] in lane n.
  const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(g, h)), _mm512_castpd_ps(_mm512_unpackhi_pd(g, h)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// r[n] = sum of the 16 lanes of v[n] for n < 8 (lanes 8-15 are unspecified).
inline __m512 sum8(const __m512* v) {
  __m512 s[4], t[2];
  TANDEM_UNROLL
  for (int j = 0; j < 4; ++j)
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  TANDEM_UNROLL
  for (int j = 0; j < 2; ++j)
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 w = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));  // w[4q] = sum v[q], w[4q + 1] = sum v[4 + q]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), w);
}

// out[i] = sum of the lanes of v[i], i < N.
template <int N>
inline void store_sums(const __m512* v, float* out) {
  int i = 0;
  TANDEM_UNROLL
  for (; i + 16 <= N; i += 16) _mm512_storeu_ps(out + i, sum16(v + i));
  if constexpr (N % 16 >= 8) {
    _mm256_storeu_ps(out + i, _mm512_castps512_ps256(sum8(v + i)));
    i += 8;
  }
  TANDEM_UNROLL
  for (; i < N; ++i) out[i] = _mm512_reduce_add_ps(v[i]);
}

// dot_tile with the sum16 reduction: out[m * RB + r] = sum_k x[m, k] * w[r, k], MB * RB <= 24
// accumulators (of 32 zmm registers; RB weight vectors and one token vector take the rest).
template <int MB, int RB>
inline void dot_tile_sums(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* out,
                          const uint16_t* pf) {
  static_assert(MB * RB <= 24, "dot_tile_sums: too many accumulators for 32 registers");
  __m512 acc[MB * RB];
  TANDEM_UNROLL
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm512_setzero_ps();
  accumulate_tile<MB, RB>(x, ldx, w, ldw, K, acc, pf);
  store_sums<MB * RB>(acc, out);
}

// The last T or fewer tokens of dot_rows_sums: one dot_tile_sums of exactly `rest` (1..T) tokens.
template <int T, int RB>
inline void dot_rest_sums(int64_t rest, const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* w, int64_t ldw,
                          float* out, const uint16_t* pf) {
  if constexpr (T > 0) {
    if (rest == T)
      dot_tile_sums<T, RB>(x, ldx, w, ldw, K, out, pf);
    else
      dot_rest_sums<T - 1, RB>(rest, x, ldx, K, w, ldw, out, pf);
  }
}

// out [M, RB] = x [M, K] . w [RB, K] in token tiles of MB (dot_tile_sums), the last tile smaller;
// only the first token tile prefetches `next` (as in dot_rows).
template <int MB, int RB>
inline void dot_rows_sums(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t ldw,
                          float* out, const uint16_t* next) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB)
    dot_tile_sums<MB, RB>(x + m * ldx, ldx, w, ldw, K, out + m * RB, m == 0 ? next : nullptr);
  if (m < M) dot_rest_sums<MB - 1, RB>(M - m, x + m * ldx, ldx, K, w, ldw, out + m * RB, m == 0 ? next : nullptr);
}

}  // namespace tandem
