// The Q4_K / Q6_K pieces of the avx2 kernels (linear_kquant.cpp: the linears; moe_kquant.cpp: the fused MoE):
// activations quantized per token and block of 256 (llama.cpp's q8_K), a layer's rows as Weights, and the
// MB tokens x RB rows tiles (formats, arithmetic and error bound in linear_kquant.cpp's header). Out is any type
// with Output::store's signature (gemm.h; noinline there). BATCH INVARIANCE: one 8-lane fp32 accumulator per
// (token, row), blocks in order, exact integer sums inside a block; tiles only share loads.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "parallel.h"

namespace tandem::avx2::kquant {

using tandem::avx2::hsum8;

constexpr int64_t QK = 256;  // values per K-quant super-block

// Activations quantized per token and block of 256 (ggml-quants.c quantize_row_q8_K): iscale = 127 / max|x_B|,
// xq = round(x * iscale) (half to even), dy = 1 / iscale (0 and xq = 0 where the block is 0); S16 / S32: the
// sums of xq over 16 / 32 values (int16 / int32: the int32 lanes feed _mm256_madd_epi16 with 16-bit values).
struct Q8K {
  int64_t blocks = 0;
  std::vector<int8_t> q;     // [M, 256 * blocks]
  std::vector<float> d;      // [M, blocks]
  std::vector<int16_t> s16;  // [M, blocks * 16]
  std::vector<int32_t> s32;  // [M, blocks * 8]
};

inline void quantize_token_q8k(const c10::BFloat16* x, int64_t blocks, int8_t* q, float* d, int16_t* s16, int32_t* s32) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < blocks; ++b) {
    const c10::BFloat16* xb = x + QK * b;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(tandem::avx2::load8(xb + 8 * i), abs_mask));
    const float m = tandem::avx2::hmax8(amax);
    const float iscale = m != 0.0f ? 127.0f / m : 0.0f;
    d[b] = m != 0.0f ? 1.0f / iscale : 0.0f;
    const __m256 iv = _mm256_set1_ps(iscale);
    for (int c = 0; c < 8; ++c) {  // 32 values per chunk
      __m256i i32[4];
      for (int i = 0; i < 4; ++i)
        i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(tandem::avx2::load8(xb + 32 * c + 8 * i), iv));
      const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
      const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + QK * b + 32 * c), p8);
      const int32_t lo = tandem::avx2::hsum8_epi32(_mm256_add_epi32(i32[0], i32[1]));
      const int32_t hi = tandem::avx2::hsum8_epi32(_mm256_add_epi32(i32[2], i32[3]));
      s16[16 * b + 2 * c] = static_cast<int16_t>(lo);
      s16[16 * b + 2 * c + 1] = static_cast<int16_t>(hi);
      s32[8 * b + c] = lo + hi;
    }
  }
}

// Buffers for M tokens' q8_K activations (filled token by token by quantize_token_q8k).
inline Q8K empty_q8k(int64_t M, int64_t blocks) {
  Q8K a;
  a.blocks = blocks;
  a.q.resize(M * QK * blocks);
  a.d.resize(M * blocks);
  a.s16.resize(M * blocks * 16);
  a.s32.resize(M * blocks * 8);
  return a;
}

inline Q8K quantize_q8k(const at::Tensor& x, int64_t blocks) {
  const int64_t M = x.size(0);
  Q8K a = empty_q8k(M, blocks);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  tandem::avx2::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_token_q8k(xp + m * QK * blocks, blocks, &a.q[m * QK * blocks], &a.d[m * blocks],
                         &a.s16[m * blocks * 16], &a.s32[m * blocks * 8]);
  });
  return a;
}

// One layer's code rows (ldq bytes apart) and fp16 scale rows (lds halves apart).
struct Weights {
  const uint8_t* q;
  const uint16_t* scale;
  int64_t K, blocks, ldq, lds;
};

inline float half_at(const uint16_t* p) { return _cvtsh_ss(*p); }

// The next tile's rows, prefetched one block at a time while this tile reads the same block of its own rows
// (quant_tile.h's Prefetch for the Q4 / Q8 formats: a tile reads RB short row streams that the hardware
// prefetcher does not catch in time). No effect on the results.
struct NextRows {
  const uint8_t* q;  // the next tile's first row
  int64_t ldq, rows, block_bytes;
  inline void operator()(int64_t b) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t off = 0; off < block_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + r * ldq + block_bytes * b + off), _MM_HINT_T0);
  }
};

// ---- q4_k -------------------------------------------------------------------------------------------------

// The 8 sub-block scales (int16, for broadcasts) and mins (int32 lanes with zero high halves) of a Q4_K block
// from its 12 packed bytes (ggml get_scale_min_k4, four bytes at a time).
inline void q4k_scales(const uint8_t* p, int16_t* sc, int32_t* mn) {
  uint32_t u[3];
  std::memcpy(u, p, 12);
  const uint32_t s_lo = u[0] & 0x3F3F3F3Fu, m_lo = u[1] & 0x3F3F3F3Fu;
  const uint32_t s_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4;
  const uint32_t m_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(sc), _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, s_hi, s_lo)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn), _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, m_hi, m_lo)));
}

template <int MB, int RB, class Out>
void tile_q4k(const Weights& w, const Q8K& a, int64_t m0, int64_t row0, const NextRows& pf, const Out& out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MB * RB];
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    pf(b);
    const uint8_t* blk[RB];
    alignas(32) int16_t sc[RB][8];
    alignas(32) int32_t mn[RB][8];
    for (int r = 0; r < RB; ++r) {
      blk[r] = w.q + (row0 + r) * w.ldq + 140 * b;
      q4k_scales(blk[r], sc[r], mn[r]);
    }
    __m256i sumi[MB * RB];
    for (int i = 0; i < MB * RB; ++i) sumi[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      __m256i c[RB];
      for (int r = 0; r < RB; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + 12 + 32 * (s / 2)));
        c[r] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[((m0 + m) * w.blocks + b) * QK + 32 * s]));
        for (int r = 0; r < RB; ++r) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c[r], y), _mm256_set1_epi16(sc[r][s]));
          sumi[m * RB + r] = _mm256_add_epi32(sumi[m * RB + r], p);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const uint16_t* ds = w.scale + (row0 + r) * w.lds + 2 * b;
      const float d = half_at(ds), dmin = half_at(ds + 1);
      const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(mn[r]));
      for (int m = 0; m < MB; ++m) {
        const int64_t t = (m0 + m) * w.blocks + b;
        const float dy = a.d[t];
        const __m256i s32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.s32[8 * t]));
        const __m256i mp = _mm256_madd_epi16(mins, s32);  // m_j * S_j (both fit 16 bits; high halves of mins are 0)
        __m256& v = acc[m * RB + r];
        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m * RB + r]), _mm256_set1_ps(d * dy), v);
        v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mp), _mm256_set1_ps(dmin * dy), v);
      }
    }
  }
  float sums[MB * RB];
  for (int i = 0; i < MB * RB; ++i) sums[i] = hsum8(acc[i]);
  out.store(sums, RB, MB, m0, row0);
}

// ---- q6_k -------------------------------------------------------------------------------------------------

// Sub-block S (32 values, 0..7) of a Q6_K block as unsigned 6-bit codes: half h = S / 4 and part k = S % 4 take
// nibble k / 2 of ql[64 h + 32 (k % 2) + l] and bits 2k..2k+1 of qh[32 h + l] (ggml dequantize_row_q6_K).
template <int S>
inline __m256i q6k_codes(const uint8_t* blk) {
  constexpr int h = S / 4, k = S % 4;
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k % 2)));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
  const __m256i lo = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0F));
  const __m256i hi = k == 0 ? _mm256_slli_epi16(hb, 4) : k == 1 ? _mm256_slli_epi16(hb, 2)
                   : k == 2 ? hb : _mm256_srli_epi16(hb, 2);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

template <int S, int MB, int RB>
inline void q6k_sub(const uint8_t* const* blk, const __m256i (*sv)[8], const Q8K& a, int64_t m0, int64_t b,
                    __m256i* sumi) {
  __m256i c[RB];
  for (int r = 0; r < RB; ++r) c[r] = q6k_codes<S>(blk[r]);
  for (int m = 0; m < MB; ++m) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[((m0 + m) * a.blocks + b) * QK + 32 * S]));
    for (int r = 0; r < RB; ++r)
      sumi[m * RB + r] = _mm256_add_epi32(sumi[m * RB + r], _mm256_madd_epi16(_mm256_maddubs_epi16(c[r], y), sv[r][S]));
  }
}

// sv[S] = the int16 scales of sub-block S's two halves: 8 x sc[2S] (low 128 bits), 8 x sc[2S + 1] (high), from
// the 16 scales widened to int16 (sc16): one in-lane byte shuffle each of sc[0..7] or sc[8..15] in both halves.
inline void q6k_scale_pairs(__m256i sc16, __m256i* sv) {
  const __m256i lo = _mm256_permute2x128_si256(sc16, sc16, 0x00), hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const char a = static_cast<char>(4 * k), b = static_cast<char>(4 * k + 2);
    const __m256i pick = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                          b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
    sv[k] = _mm256_shuffle_epi8(lo, pick);
    sv[k + 4] = _mm256_shuffle_epi8(hi, pick);
  }
}

template <int MB, int RB, class Out>
void tile_q6k(const Weights& w, const Q8K& a, int64_t m0, int64_t row0, const NextRows& pf, const Out& out) {
  __m256 acc[MB * RB];
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    pf(b);
    const uint8_t* blk[RB];
    __m256i sv[RB][8];  // per sub-block: 8 x scale of its first 16 values, 8 x of its second 16
    __m256i sc16[RB];
    for (int r = 0; r < RB; ++r) {
      blk[r] = w.q + (row0 + r) * w.ldq + 208 * b;
      sc16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + 192)));
      q6k_scale_pairs(sc16[r], sv[r]);
    }
    __m256i sumi[MB * RB];
    for (int i = 0; i < MB * RB; ++i) sumi[i] = _mm256_setzero_si256();
    q6k_sub<0, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<1, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<2, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<3, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<4, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<5, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<6, MB, RB>(blk, sv, a, m0, b, sumi);
    q6k_sub<7, MB, RB>(blk, sv, a, m0, b, sumi);
    for (int r = 0; r < RB; ++r) {
      const float d = half_at(w.scale + (row0 + r) * w.lds + b);
      for (int m = 0; m < MB; ++m) {
        const int64_t t = (m0 + m) * w.blocks + b;
        const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.s16[16 * t]));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16[r], s16), 5);  // 32 * sum_g sc_g S_g
        const __m256i total = _mm256_sub_epi32(sumi[m * RB + r], offset);
        acc[m * RB + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * a.d[t]), acc[m * RB + r]);
      }
    }
  }
  float sums[MB * RB];
  for (int i = 0; i < MB * RB; ++i) sums[i] = hsum8(acc[i]);
  out.store(sums, RB, MB, m0, row0);
}

}  // namespace tandem::avx2::kquant
