// GGUF Q5_0 / Q4_K / Q6_K linears for every token count, AVX2: y[M, N] = x[M, K] @ dequant(w)^T (+ bias).
//
// Formats (tandem/models/gguf_blocks.py): each GGUF block split into its fp16 field(s) (`scale`) and its other
// bytes in file order (`qweight`); rows may be strided (QuantizedLinear keeps a row's scales before its codes):
//   q5_0  scale fp16 [N, K/32] (d), qweight [N, K/32 * 20]: qh (4 bytes, bit j = 5th bit of weight j), 16 bytes
//         of nibbles (byte j = weights j, j + 16): w = d * ((u | h << 4) - 16).
//   q4_k  scale fp16 [N, K/256, 2] (d, dmin), qweight [N, K/256 * 140]: 12 bytes of 6-bit (sc, m) for 8
//         sub-blocks of 32, 128 bytes (per 64 weights: sub-block 2i low nibbles, 2i + 1 high): w = d sc u - dmin m.
//   q6_k  scale fp16 [N, K/256] (d), qweight [N, K/256 * 208]: ql[128], qh[64], 16 int8 scales (one per 16):
//         w = d * sc * (q - 32), q = 4 low bits | 2 high bits << 4.
//
// What llama.cpp's AVX2 path does (ggml-cpu quants.c): activations are quantized per token,
//   q5_0 with q8_0 (blocks of 32: dx = max|x_b| / 127, gemm.h quantize_activations): per block the signed
//     codes (-16..15, ggml's bytes_from_bits_32 for the 5th bit) times xq by _mm256_maddubs_epi16(|w|, sign(xq, w)),
//     one fp32 FMA by d * dx (ggml_vec_dot_q5_0_q8_0); here maddubs of the unsigned codes minus a per-lane
//     offset (q5_0_activations): the same int32 lanes, two sign operations fewer per row and block;
//   q4_k / q6_k with q8_K (blocks of 256: iscale = 127 / max|x_B|, xq = round(iscale x), dy = 1 / iscale, and the
//     sums of xq per 16): per sub-block maddubs(u, xq) scaled by its integer scale (_mm256_madd_epi16), all in
//     int32 over the super-block, then one fp32 FMA by d * dy; q4_k's mins as dmin * dy * sum_j m_j S_j (S_j the
//     sum of xq over sub-block j), q6_k's -32 offset as 32 * sum_g sc_g S_g in the integer sum
//     (ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K).
// Error against x @ dequant(w)^T: rounding x_j to xq_j * dx moves it by at most dx / 2 ~ max|x_blk| / 254, so
// |y - x.w| <= sum_blk max|x_blk| / 254 * sum_{j in blk} |w_j| (blk: 32 values for q5_0, 256 for q4_k / q6_k),
// plus fp32 rounding of the per-block terms and the output's bf16 rounding.
// BATCH INVARIANCE (gemm.h): one 8-lane fp32 accumulator per (token, row), blocks in order, exact integer
// sums inside a block; tiles only share loads, so every M gives the same bits.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "ops.h"

namespace {

using tandem::avx2::hsum8;
using tandem::avx2::Output;
using tandem::avx2::QuantizedActivations;

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

void quantize_token_q8k(const c10::BFloat16* x, int64_t blocks, int8_t* q, float* d, int16_t* s16, int32_t* s32) {
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

Q8K quantize_q8k(const at::Tensor& x, int64_t blocks) {
  const int64_t M = x.size(0);
  Q8K a;
  a.blocks = blocks;
  a.q.resize(M * QK * blocks);
  a.d.resize(M * blocks);
  a.s16.resize(M * blocks * 16);
  a.s32.resize(M * blocks * 8);
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

template <int MB, int RB>
void tile_q4k(const Weights& w, const Q8K& a, int64_t m0, int64_t row0, const NextRows& pf, const Output& out) {
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

template <int MB, int RB>
void tile_q6k(const Weights& w, const Q8K& a, int64_t m0, int64_t row0, const NextRows& pf, const Output& out) {
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

// ---- q5_0 -------------------------------------------------------------------------------------------------

// The 32 unsigned codes u = nibble | 5th bit << 4 (0..31) of a Q5_0 block (qh, then 16 nibble bytes): w = d (u - 16).
inline __m256i q5_0_codes(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  // byte j = 0xFF where bit j of qh is set: byte j / 8 of qh broadcast to byte j, tested against 1 << (j % 8)
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

// Q5_0's activations: q8_0 codes (gemm.h) and per token and block the 8 int32 lanes of 16 * sum xq over each
// lane's 4 codes (the lanes of _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), 1)). A block's lanes of
// sum (u - 16) xq are those of sum u xq minus these: the same integers as ggml's signed codes with its sign
// trick (so the same fp32 results), two sign operations per row and block fewer. off: [M, blocks * 8].
struct Q5Activations {
  QuantizedActivations a;
  std::vector<int32_t> off;
};

Q5Activations q5_0_activations(const at::Tensor& x, int64_t blocks) {
  Q5Activations r{tandem::avx2::quantize_activations(x, blocks), {}};
  const QuantizedActivations& a = r.a;
  const int64_t M = x.size(0);
  std::vector<int32_t>& off = r.off;
  off.resize(M * a.blocks * 8);
  const __m256i sixteen = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[m * a.ldq + 32 * b]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&off[(m * a.blocks + b) * 8]),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(sixteen, xq), ones));
    }
  return r;
}

template <int MB, int RB>
void tile_q5_0(const Weights& w, const Q5Activations& x, int64_t m0, int64_t row0, const NextRows& pf,
               const Output& out) {
  const QuantizedActivations& a = x.a;
  const int32_t* off = x.off.data();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB * RB];
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.blocks; g += 8) {
    const int64_t n = std::min<int64_t>(8, w.blocks - g);
    alignas(32) float sc[MB * RB][8];  // d_w * dx of blocks g.., the same fp32 products as one per block
    for (int r = 0; r < RB; ++r) {
      alignas(32) float d[8];
      tandem::avx2::halves8(reinterpret_cast<const c10::Half*>(w.scale + (row0 + r) * w.lds + g), n, d);
      for (int m = 0; m < MB; ++m)
        _mm256_store_ps(sc[m * RB + r], _mm256_mul_ps(_mm256_load_ps(d), _mm256_loadu_ps(&a.d[(m0 + m) * a.ldb + g])));
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = g + j;
      pf(b);
      __m256i c[RB];
      for (int r = 0; r < RB; ++r) c[r] = q5_0_codes(w.q + (row0 + r) * w.ldq + 20 * b);
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[(m0 + m) * a.ldq + 32 * b]));
        const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&off[((m0 + m) * a.blocks + b) * 8]));
        for (int r = 0; r < RB; ++r) {
          const __m256i i32 = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(c[r], xq), ones), o);
          acc[m * RB + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_broadcast_ss(&sc[m * RB + r][j]),
                                            acc[m * RB + r]);
        }
      }
    }
  }
  float sums[MB * RB];
  for (int i = 0; i < MB * RB; ++i) sums[i] = hsum8(acc[i]);
  out.store(sums, RB, MB, m0, row0);
}

// ---- drivers ----------------------------------------------------------------------------------------------

enum class Kind { kQ5_0, kQ4_K, kQ6_K };

template <Kind F, int MB, int RB, typename A>
inline void tile(const Weights& w, const A& a, int64_t m0, int64_t row0, const NextRows& pf, const Output& out) {
  if constexpr (F == Kind::kQ5_0) tile_q5_0<MB, RB>(w, a, m0, row0, pf, out);
  else if constexpr (F == Kind::kQ4_K) tile_q4k<MB, RB>(w, a, m0, row0, pf, out);
  else tile_q6k<MB, RB>(w, a, m0, row0, pf, out);
}

constexpr int64_t block_bytes(Kind F) { return F == Kind::kQ5_0 ? 20 : F == Kind::kQ4_K ? 140 : 208; }

// Tiles of MB tokens x RB rows (the last ones smaller); threads split the rows.
template <Kind F, int MB, int RB, typename A>
void run_tiles(const Weights& w, const A& a, int64_t M, int64_t N, const Output& out) {
  const int64_t tiles = (N + RB - 1) / RB;
  tandem::avx2::parallel_for(0, tiles, std::max<int64_t>(1, 64 / RB), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * RB;
      const NextRows pf{w.q + (row0 + RB) * w.ldq, w.ldq, std::clamp<int64_t>(N - row0 - RB, 0, RB), block_bytes(F)};
      if (row0 + RB <= N) {
        int64_t m = 0;
        for (; m + MB <= M; m += MB) tile<F, MB, RB>(w, a, m, row0, pf, out);
        for (; m < M; ++m) tile<F, 1, RB>(w, a, m, row0, pf, out);
      } else {
        const NextRows none{w.q, w.ldq, 0, block_bytes(F)};
        for (int64_t row = row0; row < N; ++row)
          for (int64_t m = 0; m < M; ++m) tile<F, 1, 1>(w, a, m, row, none, out);
      }
    }
  });
}

// Checks the tensors of a `name` layer (values per block, code bytes per block, fp16 fields per block).
Weights check(const at::Tensor& qweight, const at::Tensor& scale, int64_t values, int64_t code_bytes, int64_t halves,
              const char* name) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.stride(1) == 1 &&
                  qweight.stride(0) >= qweight.size(1) && qweight.size(1) % code_bytes == 0,
              name, ": qweight must be uint8 [N, blocks * ", code_bytes, "] with contiguous rows");
  const int64_t N = qweight.size(0), blocks = qweight.size(1) / code_bytes;
  const bool pairs = halves == 2;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == (pairs ? 3 : 2) && scale.size(0) == N &&
                  scale.size(1) == blocks && (!pairs || (scale.size(2) == 2 && scale.stride(2) == 1)) &&
                  scale.stride(1) == halves && scale.stride(0) >= blocks * halves,
              name, ": scale must be fp16 [N, blocks", pairs ? ", 2]" : "]", " with contiguous rows");
  return {qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
          blocks * values, blocks, qweight.stride(0), scale.stride(0)};
}

template <Kind F>
at::Tensor run(const Weights& w, at::Tensor x, int64_t N, const c10::optional<at::Tensor>& bias, const char* op) {
  at::Tensor b;
  at::Tensor y = tandem::avx2::prepare_linear(x, N, w.K, bias, b, op);
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return y;
  const Output out(y, nullptr, b);
  if constexpr (F == Kind::kQ5_0) {
    const Q5Activations a = q5_0_activations(x, w.blocks);
    if (M == 1)
      run_tiles<F, 1, 4>(w, a, M, N, out);
    else
      run_tiles<F, 2, 4>(w, a, M, N, out);
  } else {
    const Q8K a = quantize_q8k(x, w.blocks);
    if (M == 1)
      run_tiles<F, 1, 4>(w, a, M, N, out);  // decode: 4 row streams
    else
      run_tiles<F, 2, 2>(w, a, M, N, out);  // NOTE: 2 x 4 tiles spill the integer sums
  }
  return y;
}

}  // namespace

at::Tensor linear_q5_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = check(qweight, scale, 32, 20, 1, "linear_q5_0");
  return run<Kind::kQ5_0>(w, x, qweight.size(0), bias, "linear_q5_0");
}

at::Tensor linear_q4_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = check(qweight, scale, QK, 140, 2, "linear_q4_k");
  return run<Kind::kQ4_K>(w, x, qweight.size(0), bias, "linear_q4_k");
}

at::Tensor linear_q6_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = check(qweight, scale, QK, 208, 1, "linear_q6_k");
  return run<Kind::kQ6_K>(w, x, qweight.size(0), bias, "linear_q6_k");
}
