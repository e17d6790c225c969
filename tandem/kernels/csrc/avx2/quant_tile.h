// The tile of the avx2 quantized linears (linear_quant.cpp; the fused MoE of moe_quant.cpp): MB tokens x RB
// weight rows, per block an exact integer dot product of the weight codes with the token's int8 activation
// codes, then one fp32 FMA by d_w * dx (formats, the llama.cpp arithmetic and the error bound in
// linear_quant.cpp's header). Out is any type with Output::store's signature (noinline there).
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "quant_blocks.h"

namespace tandem::avx2::quant {

using tandem::avx2::hsum8;
using tandem::avx2::QuantizedActivations;

// A token's activation codes in pair_dot's order: per pair of blocks (b, b + 1), x_b[0:16], x_b1[0:16],
// x_b[16:32], x_b1[16:32]; [M, 64 * (blocks / 2)] (an odd last block is read from a.q).
struct PairCodes {
  std::vector<int8_t> q;
  int64_t ld = 0;
};

// Token m's row of PairCodes (64 * (a.blocks / 2) bytes at dst).
inline void pair_codes_row(const QuantizedActivations& a, int64_t m, int8_t* dst) {
  for (int64_t i = 0; i < a.blocks / 2; ++i) {
    const int8_t* x = &a.q[m * a.ldq + 64 * i];
    int8_t* d = dst + 64 * i;
    std::memcpy(d, x, 16);
    std::memcpy(d + 16, x + 32, 16);
    std::memcpy(d + 32, x + 16, 16);
    std::memcpy(d + 48, x + 48, 16);
  }
}

inline PairCodes pair_codes(const QuantizedActivations& a, int64_t M) {
  PairCodes p;
  p.ld = 64 * (a.blocks / 2);
  p.q.resize(M * p.ld);
  for (int64_t m = 0; m < M; ++m) pair_codes_row(a, m, &p.q[m * p.ld]);
  return p;
}

// The int32 lanes of one block's dot product of 32 codes with the token's 32 activation codes:
// llama.cpp's mul_sum_i8_pairs (signed codes) or maddubs of the unsigned nibbles (Q4_0 offset applied).
template <Kind F>
inline __m256i block_dot(__m256i wq, __m256i xq, int32_t s_b) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p;
  if constexpr (F == Kind::kInt8 || F == Kind::kQ8_0)
    p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
  else
    p = _mm256_maddubs_epi16(wq, xq);
  __m256i i32 = _mm256_madd_epi16(p, ones);
  if constexpr (F == Kind::kQ4_0) i32 = _mm256_sub_epi32(i32, _mm256_set1_epi32(s_b));
  return i32;
}

// Q4 formats, blocks b and b + 1 at once: one 32-byte load holds both blocks' nibbles; the low nibbles
// are weights 0-15 of b (lanes 0-15) and of b + 1 (16-31), the high nibbles weights 16-31. The token's
// activation codes sit in that order (PairCodes), so two maddubs and an int16 add (|sum| <= 4 * 15 * 127)
// give int32 lanes 0-3 for block b and 4-7 for b + 1: half the maddubs/madd/cvt/FMA per block.
template <Kind F>
inline __m256i pair_dot(__m256i codes, const int8_t* xp, int32_t s_b, int32_t s_b1) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(codes, m4), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), m4);
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
                                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32))));
  __m256i i32 = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  if constexpr (F == Kind::kQ4_0)  // -8 S_b over block b's 4 lanes: -2 S_b each
    i32 = _mm256_sub_epi32(i32, _mm256_set_m128i(_mm_set1_epi32(2 * s_b1), _mm_set1_epi32(2 * s_b)));
  return i32;
}

// The next tile's bytes, prefetched a few cache lines per block while this tile runs: a tile reads RB
// rows at once, short streams (7-10 lines each for K = 576) that the hardware prefetcher does not
// catch in time; measured 1.3-1.4x on a Zen 1 core streaming from DRAM.
struct Prefetch {
  const char* next;
  int64_t lines_per_block;
  inline void operator()(int64_t b) const {
    for (int64_t i = 0; i < lines_per_block; ++i)
      _mm_prefetch(next + 64 * (b * lines_per_block + i), _MM_HINT_T0);
  }
};

template <int RB>
inline Prefetch next_tile(const Weights& w, int64_t row0, int64_t N) {
  const int64_t row = std::min<int64_t>(row0 + RB, N - 1);
  const int64_t lines = (RB * w.ldq + 63) / 64;
  return {reinterpret_cast<const char*>(w.q + row * w.ldq) - w.head, (lines + w.blocks - 1) / w.blocks};
}

// Tokens [m0, m0 + MB) x rows [row0, row0 + RB): the per-block integer dots and their fp32 FMAs.
// Blocks go by groups of 8: the group's d_w * dx products (8 at once, the same fp32 products as one
// per block) are staged on the stack; q4_1's min term m * (dx * S_b) takes one FMA per group into its
// own accumulator (in the group loop for one token, after it for more), the same bits either way.
// Q4 formats take the blocks of a group in pairs (pair_dot; a group's odd last block alone).
template <Kind F, int MB, int RB, class Out>
void tile(const Weights& w, const QuantizedActivations& a, const PairCodes& xp, int64_t m0, int64_t row0,
          const Prefetch& pf, const Out& out) {
  constexpr bool kQ4 = F == Kind::kQ4_0 || F == Kind::kQ4_1;
  const int64_t ldb = a.ldb;
  __m256 acc[MB * RB], macc[MB * RB];
#pragma GCC unroll 16
  for (int i = 0; i < MB * RB; ++i) acc[i] = macc[i] = _mm256_setzero_ps();
  const uint8_t* rows[RB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) rows[r] = w.q + (row0 + r) * w.ldq;
  for (int64_t g = 0; g < w.blocks; g += 8) {
    const int64_t n = std::min<int64_t>(8, w.blocks - g);
    alignas(32) float sc[MB * RB][8];
    if constexpr (F != Kind::kInt8) {
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        __m256 mins;
        const __m256 d = group_scales<F>(w.scale + (row0 + r) * w.lds, g, n, &mins);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          _mm256_store_ps(sc[m * RB + r], _mm256_mul_ps(d, _mm256_loadu_ps(&a.d[(m0 + m) * ldb + g])));
          if constexpr (F == Kind::kQ4_1 && MB == 1)
            macc[m * RB + r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(&a.ds[(m0 + m) * ldb + g]), macc[m * RB + r]);
        }
      }
    }
    int64_t j = 0;
    if constexpr (kQ4) {
      for (; j + 2 <= n; j += 2) {
        const int64_t b = g + j;
        pf(b);
        pf(b + 1);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + 16 * b));
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) {
            const int32_t* s = &a.s[(m0 + m) * ldb];
            const __m256i i32 = pair_dot<F>(codes, &xp.q[(m0 + m) * xp.ld + 32 * b], s[b], s[b + 1]);
            const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(&sc[m * RB + r][j + 1]),
                                                 _mm_broadcast_ss(&sc[m * RB + r][j]));
            acc[m * RB + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc[m * RB + r]);
          }
        }
      }
    }
    for (; j < n; ++j) {
      const int64_t b = g + j;
      pf(b);
      __m256i wq[RB];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) wq[r] = block_codes<F>(rows[r], b, w.K);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[(m0 + m) * a.ldq + 32 * b]));
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const __m256i i32 = block_dot<F>(wq[r], xq, F == Kind::kQ4_0 ? a.s[(m0 + m) * ldb + b] : 0);
          const __m256 scale = F == Kind::kInt8 ? _mm256_broadcast_ss(&a.d[(m0 + m) * ldb + b])
                                                : _mm256_broadcast_ss(&sc[m * RB + r][j]);
          acc[m * RB + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc[m * RB + r]);
        }
      }
    }
  }
  if constexpr (F == Kind::kQ4_1 && MB > 1) {  // NOTE: a separate pass: 2 x 8 accumulators would spill
    for (int64_t g = 0; g < w.blocks; g += 8) {
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        __m256 mins;
        group_scales<F>(w.scale + (row0 + r) * w.lds, g, std::min<int64_t>(8, w.blocks - g), &mins);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m)
          macc[m * RB + r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(&a.ds[(m0 + m) * ldb + g]), macc[m * RB + r]);
      }
    }
  }
  float sums[MB * RB];
#pragma GCC unroll 16
  for (int i = 0; i < MB * RB; ++i) {
    sums[i] = hsum8(acc[i]);
    if constexpr (F == Kind::kQ4_1) sums[i] += hsum8(macc[i]);  // + sum_b m_b * dx_b * S_b
  }
  out.store(sums, RB, MB, m0, row0);
}

// Tokens [m_begin, m_end) x the RB-row tile at row0 of an N-row layer (a last, partial tile row by row):
// tiles of MB tokens, then single tokens; every token's bits are the same whichever tile it falls in.
template <Kind F, int MB, int RB, class Out>
inline void tile_rows(const Weights& w, const QuantizedActivations& a, const PairCodes& xp, int64_t m_begin,
                      int64_t m_end, int64_t row0, int64_t N, const Out& out) {
  const Prefetch pf = next_tile<RB>(w, row0, N);
  if (row0 + RB <= N) {
    int64_t m = m_begin;
    for (; m + MB <= m_end; m += MB) tile<F, MB, RB>(w, a, xp, m, row0, pf, out);
    for (; m < m_end; ++m) tile<F, 1, RB>(w, a, xp, m, row0, pf, out);
  } else {
    for (int64_t row = row0; row < N; ++row)
      for (int64_t m = m_begin; m < m_end; ++m) tile<F, 1, 1>(w, a, xp, m, row, pf, out);
  }
}

}  // namespace tandem::avx2::quant
