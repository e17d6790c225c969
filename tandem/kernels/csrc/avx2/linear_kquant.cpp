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
//     offset (q5_0_activations): exact integers, two sign operations fewer per row and block; and two blocks per
//     int32 vector (tile_q5_0): half the madd / conversion / FMA per block;
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
#include "kquant_tile.h"
#include "ops.h"
#include "quant_tile.h"

namespace {

using tandem::avx2::hsum8;
using tandem::avx2::Output;
using tandem::avx2::QuantizedActivations;
using namespace tandem::avx2::kquant;

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

// Q5_0's activations: q8_0 codes (gemm.h), the same codes in pair order (quant_tile.h's PairCodes: per pair of
// blocks (b, b + 1), x_b[0:16], x_b1[0:16], x_b[16:32], x_b1[16:32]) and, per token and even block b, the 8 int32
// offset lanes of 16 * sum xq that turn sum u xq into sum (u - 16) xq: for a pair, lane i < 4 covers block b's codes
// 4i..4i+3 and 16+4i..16+4i+3, lane 4 + i the same of block b + 1 (the lanes of pair_dot below); for a last,
// unpaired block (an odd block count), lane i covers its codes 4i..4i+3. off: [M, blocks * 8] (odd b unused).
// The integers are exact, so they are ggml's sum (u - 16) xq per block (its signed codes with the sign trick).
struct Q5Activations {
  QuantizedActivations a;
  tandem::avx2::quant::PairCodes xp;
  std::vector<int32_t> off;
};

Q5Activations q5_0_activations(const at::Tensor& x, int64_t blocks) {
  Q5Activations r{tandem::avx2::quantize_activations(x, blocks), {}, {}};
  const QuantizedActivations& a = r.a;
  const int64_t M = x.size(0);
  r.xp = tandem::avx2::quant::pair_codes(a, M);
  std::vector<int32_t>& off = r.off;
  off.assign(M * a.blocks * 8, 0);
  const __m256i sixteen = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.blocks; b += 2) {
      __m256i p;
      if (b + 1 < a.blocks) {
        const int8_t* xp = &r.xp.q[m * r.xp.ld + 32 * b];
        p = _mm256_add_epi16(_mm256_maddubs_epi16(sixteen, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
                             _mm256_maddubs_epi16(sixteen, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32))));
      } else {
        p = _mm256_maddubs_epi16(sixteen, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[m * a.ldq + 32 * b])));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&off[(m * a.blocks + b) * 8]), _mm256_madd_epi16(p, ones));
    }
  return r;
}

// The unsigned codes of blocks b and b + 1 of a row (p: block b's qh) in pair order: *lo = weights 0-15 of b (lanes
// 0-15) and of b + 1 (16-31), *hi = weights 16-31 of each. The 5th bits (ggml's bytes_from_bits_32, two blocks at
// once, one op fewer per half): each 128-bit lane holds a block's qh (bytes 0-3) and qh << 4 (bytes 4-7), so every
// weight's bit sits in the high nibble of one of those bytes (bit 4 + j % 4 of (qh << 4) byte j / 8 for j % 8 < 4,
// bit j % 8 of qh byte j / 8 otherwise); one in-lane shuffle brings that byte to byte j, an AND keeps the bit, and
// min(., 16) makes it 16 or 0.
inline void q5_0_pair_codes(const uint8_t* p, __m256i* lo, __m256i* hi) {
  uint32_t qh0, qh1;
  std::memcpy(&qh0, p, 4);
  std::memcpy(&qh1, p + 20, 4);
  const auto both = [](uint32_t qh) {
    return _mm_cvtsi64_si128(static_cast<long long>(qh | static_cast<uint64_t>(qh << 4) << 32));
  };
  const __m256i raw = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 24)), 1);
  const __m256i qh = _mm256_inserti128_si256(_mm256_castsi128_si256(both(qh0)), both(qh1), 1);
  const __m256i m4 = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201080402010ull));
  const __m256i pick_lo = _mm256_setr_epi8(4, 4, 4, 4, 0, 0, 0, 0, 5, 5, 5, 5, 1, 1, 1, 1,
                                           4, 4, 4, 4, 0, 0, 0, 0, 5, 5, 5, 5, 1, 1, 1, 1);
  const __m256i pick_hi = _mm256_setr_epi8(6, 6, 6, 6, 2, 2, 2, 2, 7, 7, 7, 7, 3, 3, 3, 3,
                                           6, 6, 6, 6, 2, 2, 2, 2, 7, 7, 7, 7, 3, 3, 3, 3);
  const __m256i h_lo = _mm256_min_epu8(_mm256_and_si256(_mm256_shuffle_epi8(qh, pick_lo), bit), b5);
  const __m256i h_hi = _mm256_min_epu8(_mm256_and_si256(_mm256_shuffle_epi8(qh, pick_hi), bit), b5);
  *lo = _mm256_or_si256(_mm256_and_si256(raw, m4), h_lo);
  *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), h_hi);
}

// Tokens [m0, m0 + MB) x rows [row0, row0 + RB). Blocks go by pairs (quant_tile.h's pair_dot for the Q4 formats):
// two maddubs and an int16 add (|sum| <= 4 * 31 * 127) give int32 lanes 0-3 of block b and 4-7 of b + 1, so one
// madd, offset, conversion and FMA per two blocks; an odd last block alone (q5_0_codes). A group of 8 blocks starts
// at a multiple of 8, so pairs and the last block always start at an even b whatever M is (batch invariance).
template <int MB, int RB>
void tile_q5_0(const Weights& w, const Q5Activations& x, int64_t m0, int64_t row0, const NextRows& pf,
               const Output& out) {
  const QuantizedActivations& a = x.a;
  const int32_t* off = x.off.data();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB * RB];
#pragma GCC unroll 8
  for (int i = 0; i < MB * RB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.blocks; g += 8) {
    const int64_t n = std::min<int64_t>(8, w.blocks - g);
    alignas(32) float sc[MB * RB][8];  // d_w * dx of blocks g.., the same fp32 products as one per block
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      alignas(32) float d[8];
      tandem::avx2::halves8(reinterpret_cast<const c10::Half*>(w.scale + (row0 + r) * w.lds + g), n, d);
#pragma GCC unroll 2
      for (int m = 0; m < MB; ++m)
        _mm256_store_ps(sc[m * RB + r], _mm256_mul_ps(_mm256_load_ps(d), _mm256_loadu_ps(&a.d[(m0 + m) * a.ldb + g])));
    }
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const int64_t b = g + j;
      pf(b);
      pf(b + 1);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        __m256i lo, hi;
        q5_0_pair_codes(w.q + (row0 + r) * w.ldq + 20 * b, &lo, &hi);
#pragma GCC unroll 2
        for (int m = 0; m < MB; ++m) {
          const int8_t* xp = &x.xp.q[(m0 + m) * x.xp.ld + 32 * b];
          const __m256i p = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
              _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32))));
          const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&off[((m0 + m) * a.blocks + b) * 8]));
          const __m256i i32 = _mm256_sub_epi32(_mm256_madd_epi16(p, ones), o);
          const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(&sc[m * RB + r][j + 1]), _mm_broadcast_ss(&sc[m * RB + r][j]));
          acc[m * RB + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc[m * RB + r]);
        }
      }
    }
    if (j < n) {  // the layer's last block, when the block count is odd
      const int64_t b = g + j;
      pf(b);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const __m256i c = q5_0_codes(w.q + (row0 + r) * w.ldq + 20 * b);
#pragma GCC unroll 2
        for (int m = 0; m < MB; ++m) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[(m0 + m) * a.ldq + 32 * b]));
          const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&off[((m0 + m) * a.blocks + b) * 8]));
          const __m256i i32 = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(c, xq), ones), o);
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
