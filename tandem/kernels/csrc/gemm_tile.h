// The bf16 dot-product micro-kernel shared by the bf16 and the weight-only quantized linear kernels.
//
// dot_row<MB, U> and dot_tile_passes<MB, RB, CP> compute MB x 1 and MB x RB dot products of length K: rows
// of w in their natural [N, K] layout, tokens of x [M, K], in one order for both (see kChains).
// Each `vdpbf16ps` (_mm512_dpbf16_ps, Intel SDM "VDPBF16PS") multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes; lanes are summed at the end.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// NOTE: GCC keeps arrays of vector accumulators on the stack (a store and a load per dot product,
// 15% slower when streaming from DRAM) unless the small loops over them are unrolled early.
#define TANDEM_UNROLL _Pragma("GCC unroll 16")
// The same for loops over up to 32 accumulators (dot_tile_passes' 24): "unroll 16" leaves such a loop
// rolled, and the whole array then lives on the stack.
#define TANDEM_UNROLL_ALL _Pragma("GCC unroll 32")

namespace tandem {

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

// ---- The bf16 linear's one reduction order (batch invariance) ----
// Every dot product of linear_bf16, whatever the number of tokens, is summed as dot_row<MB, kChains> sums
// it: 32-element chunks in K order, chunk c of the first kChains * floor(K / (32 kChains)) into
// accumulator c % kChains, the rest (whole or masked) into accumulator 0; then a0 + a1 (+ a2 ...) in
// order and the lane sum of _mm512_reduce_add_ps (sum8 adds the lanes in the same tree, bit for bit:
// halves, quarters, pairs, then the two lanes). The tiles below (dot_tile_passes: MB tokens x RB rows)
// keep that order, so a token's value does not depend on how many tokens share the call (issue 11, item 5).
// NOTE: 4 chains, the one-token kernel's order from before (one chain is vdpbf16ps-latency-bound, 25-35%
// slower at one token on Zen 5), so batch-1 decode runs unchanged code. 2 chains (4x3 tiles, sum8) were
// faster at 16 tokens but 8-14% slower at one token (README, Performance).
constexpr int kChains = 4;

// r[n] = sum of the 16 lanes of v[n] for n < 8 (lanes 8-15 are unspecified), in _mm512_reduce_add_ps's
// order: lanes i + (i + 8), then + 4, + 2, + 1 (transposing 8 vectors, about a third of the instructions).
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

// One pass of dot_tile_passes over the K block [k0, k1) (k1 <= the end of the 4-chain loop): chains
// p CP .. p CP + CP - 1 of MB x RB dot products, continuing from their partial sums in part
// (part[(c D + i) 16 ..]: chain c of dot product i), or from zero in the first block.
template <int MB, int RB, int CP, int p, bool first>
__attribute__((always_inline)) inline void tile_pass(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                                                     int64_t k0, int64_t k1, float* part, const uint16_t* pf) {
  constexpr int U = kChains, D = MB * RB;
  __m512 acc[D * CP];
  TANDEM_UNROLL_ALL
  for (int i = 0; i < D; ++i)
    TANDEM_UNROLL
    for (int u = 0; u < CP; ++u)
      acc[i * CP + u] = first ? _mm512_setzero_ps() : _mm512_load_ps(part + ((p * CP + u) * D + i) * 16);
  for (int64_t k = k0 + 32 * CP * p; k < k1; k += 32 * U) {
    // NOTE: each pass prefetches its own lines of the next tile's rows; all of them in pass 0 measured
    // 1.21x the time at 16 tokens on a 151936-row LM head streamed from memory (1.14x on gate_up).
    if (pf != nullptr)
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r)
        TANDEM_UNROLL
        for (int u = 0; u < CP; ++u) _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k + 32 * u), _MM_HINT_T0);
    TANDEM_UNROLL
    for (int u = 0; u < CP; ++u) {
      __m512bh wv[RB];
      TANDEM_UNROLL
      for (int r = 0; r < RB; ++r) wv[r] = load_bf16(w + r * ldw + k + 32 * u);
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = load_bf16(x + m * ldx + k + 32 * u);
        TANDEM_UNROLL
        for (int r = 0; r < RB; ++r) acc[(m * RB + r) * CP + u] = _mm512_dpbf16_ps(acc[(m * RB + r) * CP + u], xv, wv[r]);
      }
    }
  }
  TANDEM_UNROLL_ALL
  for (int i = 0; i < D; ++i)
    TANDEM_UNROLL
    for (int u = 0; u < CP; ++u) _mm512_store_ps(part + ((p * CP + u) * D + i) * 16, acc[i * CP + u]);
}

// The kChains / CP passes of one K block.
template <int MB, int RB, int CP, bool first>
__attribute__((always_inline)) inline void block_passes(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                        int64_t ldw, int64_t k0, int64_t k1, float* part,
                                                        const uint16_t* pf) {
  tile_pass<MB, RB, CP, 0, first>(x, ldx, w, ldw, k0, k1, part, pf);
  if constexpr (CP < 4) tile_pass<MB, RB, CP, 1, first>(x, ldx, w, ldw, k0, k1, part, pf);
  if constexpr (CP < 2) {
    tile_pass<MB, RB, CP, 2, first>(x, ldx, w, ldw, k0, k1, part, pf);
    tile_pass<MB, RB, CP, 3, first>(x, ldx, w, ldw, k0, k1, part, pf);
  }
}

// The passes of dot_tile_passes over one K block [k0, k1) of the 4-chain loop (k0 a multiple of
// 32 kChains), each chain continued from part (64-byte aligned, kChains MB RB 16 floats), or from zero when
// first. A caller can run the blocks of several token tiles in turn, so a block of rows stays in L1.
template <int MB, int RB, int CP>
inline void tile_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k0, int64_t k1,
                       bool first, float* part, const uint16_t* pf) {
  static_assert(kChains == 4 && (CP == 1 || CP == 2 || CP == 4), "tile_block: 4 chains, 1, 2 or 4 per pass");
  static_assert(MB * RB * CP <= 24, "tile_block: too many accumulators for 32 registers");
  if (first)
    block_passes<MB, RB, CP, true>(x, ldx, w, ldw, k0, k1, part, pf);
  else
    block_passes<MB, RB, CP, false>(x, ldx, w, ldw, k0, k1, part, pf);
}

// After the blocks of the 4-chain loop (none when K < 32 kChains): the chunks past it into chain 0, the
// combine a0 + a1 + a2 + a3 and the lane sums, as dot_row; out[m * RB + r].
template <int MB, int RB>
inline void tile_finish(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* part,
                        float* out) {
  constexpr int U = kChains, D = MB * RB;
  const int64_t main_end = K / (32 * U) * (32 * U);
  if (main_end == 0)
    for (int i = 0; i < U * D * 16; ++i) part[i] = 0.0f;
  __m512 acc[D];  // chain 0 + the chunks past the 4-chain loop, then + chains 1, 2, 3
  TANDEM_UNROLL_ALL
  for (int i = 0; i < D; ++i) acc[i] = _mm512_load_ps(part + i * 16);
  for (int64_t k = main_end; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1ULL << (K - k)) - 1);
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
  TANDEM_UNROLL_ALL
  for (int i = 0; i < D; ++i)
    TANDEM_UNROLL
    for (int c = 1; c < U; ++c) acc[i] = _mm512_add_ps(acc[i], _mm512_load_ps(part + (c * D + i) * 16));
  int i = 0;
  TANDEM_UNROLL
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, _mm512_castps512_ps256(sum8(acc + i)));
  TANDEM_UNROLL
  for (; i < D; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

// out[m * RB + r] = sum_k x[m, k] * w[r, k] in dot_row<1, kChains>'s order, chain-major: for each block of
// kb elements of K (a multiple of 32 kChains), kChains / CP passes, pass p summing only chains
// p CP .. p CP + CP - 1 (chunk c of the 4-chain loop belongs to chain c % kChains) with CP accumulators
// per dot product, each continued from its partial sum of the blocks before; then the chunks past the
// 4-chain loop into chain 0, the combine a0 + a1 + a2 + a3 and the lane sums, as dot_row. So MB x RB dot
// products need MB RB CP accumulators, not MB RB kChains (4 x 4 tiles with CP = 1 where 4 chains in
// registers allow 2 x 3), and the K block of the tile's rows and tokens stays in L1 between passes (each
// pass reads one 64-byte line in kChains).
template <int MB, int RB, int CP>
inline void dot_tile_passes(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, int64_t kb,
                            float* out, const uint16_t* pf) {
  alignas(64) float buf[kChains * MB * RB * 16];
  float* part = buf;
  // NOTE: an opaque pointer, so that GCC keeps the partial sums in memory: given the array itself it
  // splits it into 4 D vector variables and spills them all around the passes (1.6x the time).
  asm("" : "+r"(part));
  const int64_t main_end = K / (32 * kChains) * (32 * kChains);
  for (int64_t k0 = 0; k0 < main_end; k0 += kb)
    tile_block<MB, RB, CP>(x, ldx, w, ldw, k0, main_end - k0 < kb ? main_end : k0 + kb, k0 == 0, part, pf);
  tile_finish<MB, RB>(x, ldx, w, ldw, K, part, out);
}

// The last T or fewer tokens of a token tile in passes: exactly `rest` (1..T) tokens, CP as large as
// 24 accumulators allow (fewer passes where fewer dot products share them).
template <int T, int RB>
inline void dot_rest_passes(int64_t rest, const uint16_t* x, int64_t ldx, int64_t K, int64_t kb, const uint16_t* w,
                            int64_t ldw, float* out, const uint16_t* pf) {
  if constexpr (T > 0) {
    constexpr int CP = T * RB * 4 <= 24 ? 4 : (T * RB * 2 <= 24 ? 2 : 1);
    if (rest == T)
      dot_tile_passes<T, RB, CP>(x, ldx, w, ldw, K, kb, out, pf);
    else
      dot_rest_passes<T - 1, RB>(rest, x, ldx, K, kb, w, ldw, out, pf);
  }
}

}  // namespace tandem
