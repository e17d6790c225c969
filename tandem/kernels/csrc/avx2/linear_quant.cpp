// Weight-only quantized linears for every token count, AVX2: y[M, N] = x[M, K] @ dequant(w)^T (+ bias).
//
// Formats (tandem/models/quant.py; the same tensors as the avx512_bf16 variant):
//   int8  qweight int8 [N, K], scale fp32 [N]: w = q * scale[n]; any K.
//   int4  qweight uint8 [N, K / 2], scale fp16 [N, K / 32]: llama.cpp Q4_0 (byte j of a group holds
//         weights j and j + 16 as nibbles u, w = (u - 8) * d).
//   q8_0  qweight int8 [N, K], scale fp16 [N, K / 32]: w = q * d (llama.cpp Q8_0).
//   q4_1  qweight uint8 [N, K / 2] (int4's nibbles), scale fp16 [N, K / 32, 2] = (d, m): w = u * d + m.
//   q8_0 / q4_1 rows may be strided (QuantizedLinear keeps a row's scales before its codes in one buffer).
//
// What llama.cpp's AVX2 path does (ggml-quants.c): the activations are quantized per token and block
// of 32 (quantize_row_q8_0 / _q8_1, gemm.h), then per block an exact integer dot product of the codes
// with the activation codes, and one fp32 FMA by d_w * dx:
//   int8, q8_0 (signed codes): mul_sum_i8_pairs (ggml_vec_dot_q8_0_q8_0): _mm256_maddubs_epi16 of
//     |w| (_mm256_sign_epi8(w, w), unsigned) with sign(xq, w), pairs summed by _mm256_madd_epi16.
//     No saturation: |w| <= 128 and |xq| <= 127, so a 16-bit pair is at most 2 * 128 * 127 = 32512.
//   int4 (Q4_0): bytes_from_nibbles_32, then maddubs(u, xq) directly (u in 0..15 is unsigned) and
//     the offset as -8 S_b (S_b = sum xq): 8 int32 lanes each get -S_b. Same integer as ggml's
//     (u - 8) sign trick (ggml_vec_dot_q4_0_q8_0).
//   q4_1: maddubs(u, xq) scaled by d * dx, plus the min term m * dx * S_b (ggml_vec_dot_q4_1_q8_1's
//     summs), accumulated 8 blocks per 8-lane FMA in a second accumulator.
//   int8 per channel: blocks of 32 along K for the activations only (a zero-padded last block), each
//     block's integer scaled by dx, the row's scale applied once at the end.
// Error against x @ dequant(w)^T in exact arithmetic: rounding x_j to xq_j dx_b moves it by at most
// dx_b / 2 = max|x_b| / 254, so |y - x.w| <= sum_b max|x_b| / 254 * sum_{j in b} |w_j|, plus fp32
// rounding of the per-block terms and the output's bf16 rounding.
// BATCH INVARIANCE (see gemm.h): one 8-lane accumulator per (token, row) over the blocks in order, the
// activations quantized per token; tiles only share loads, so every M gives the same bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "gemm.h"
#include "ops.h"

namespace {

using tandem::avx2::hsum8;
using tandem::avx2::Output;
using tandem::avx2::QuantizedActivations;

enum class Kind { kInt8, kQ8_0, kQ4_0, kQ4_1 };

// One layer's codes and scales: qweight rows of ldq bytes, fp16 scale rows of lds halves.
struct Weights {
  Kind kind;
  const uint8_t* q;
  const c10::Half* scale;  // nullptr for int8
  int64_t K, blocks, ldq, lds;
};

// The 32 codes of block b of a row: int8 (signed) or nibbles u in 0..15 as bytes 0-15 = low nibbles,
// 16-31 = high nibbles (ggml's bytes_from_nibbles_32). The int8 format's partial last block is
// zero-padded (its activations are zero there too).
template <Kind F>
inline __m256i block_codes(const uint8_t* row, int64_t b, int64_t K) {
  if constexpr (F == Kind::kQ4_0 || F == Kind::kQ4_1) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  } else {
    if (F == Kind::kInt8 && 32 * b + 32 > K) {
      alignas(32) uint8_t tmp[32] = {};
      std::memcpy(tmp, row + 32 * b, K - 32 * b);
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
    }
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
  }
}

// dst_d[r][0, ldb) = fp32 d of rows row0.. (q4_1: dst_m the mins), zero-padded past the blocks.
template <Kind F, int RB>
inline void row_scales(const Weights& w, int64_t row0, int64_t ldb, float* dst_d, float* dst_m) {
  if constexpr (F == Kind::kInt8) return;
  for (int r = 0; r < RB; ++r) {
    const c10::Half* s = w.scale + (row0 + r) * w.lds;
    for (int64_t g = 0; g < ldb; g += 8) {
      if constexpr (F == Kind::kQ4_1) {  // (d, m) pairs: 16 halves for 8 blocks
        alignas(32) float pairs[16];
        tandem::avx2::halves8(s + 2 * g, std::max<int64_t>(0, 2 * (w.blocks - g)), pairs);
        tandem::avx2::halves8(s + 2 * g + 8, std::max<int64_t>(0, 2 * (w.blocks - g) - 8), pairs + 8);
        for (int j = 0; j < 8; ++j) {
          dst_d[r * ldb + g + j] = pairs[2 * j];
          dst_m[r * ldb + g + j] = pairs[2 * j + 1];
        }
      } else {
        tandem::avx2::halves8(s + g, w.blocks - g, dst_d + r * ldb + g);
      }
    }
  }
}

// The fp32 d of blocks g.. of one row (q4_1: *mins the m), n = min(8, blocks - g) values, zero past n
// (exact fp16 -> fp32, F16C); q4_1's (d, m) pairs are de-interleaved with shuffles before converting.
template <Kind F>
inline __m256 group_scales(const c10::Half* s, int64_t g, int64_t n, __m256* mins) {
  if constexpr (F == Kind::kQ4_1) {
    __m256i h;
    if (n >= 8) {
      h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * g));
    } else {
      alignas(32) uint16_t tmp[16] = {};
      std::memcpy(tmp, s + 2 * g, 4 * n);
      h = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
    }
    // per 128-bit lane: the 4 d halves, then the 4 m halves; then lane 0 d, lane 1 d, lane 0 m, lane 1 m
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, split), 0xD8);
    *mins = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  } else {
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g)));
    alignas(16) uint16_t tmp[8] = {};
    std::memcpy(tmp, s + g, 2 * n);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
}

// Tokens [m0, m0 + MB) x rows [row0, row0 + RB): the per-block integer dots and their fp32 FMAs.
// Blocks go by groups of 8: the group's d_w * dx products (8 at once, the same fp32 products as one
// per block) are staged on the stack; q4_1's min term m * (dx * S_b) takes one FMA per group into its
// own accumulator (in the group loop for one token, after it for more), the same bits either way.
template <Kind F, int MB, int RB>
void tile(const Weights& w, const QuantizedActivations& a, int64_t m0, int64_t row0, const Output& out) {
  constexpr bool kSigned = F == Kind::kInt8 || F == Kind::kQ8_0;
  const int64_t ldb = a.ldb;
  const __m256i ones = _mm256_set1_epi16(1);
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
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = g + j;
      __m256i wq[RB];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) wq[r] = block_codes<F>(rows[r], b, w.K);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[(m0 + m) * a.ldq + 32 * b]));
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          __m256i p;
          if constexpr (kSigned)
            p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq[r], wq[r]), _mm256_sign_epi8(xq, wq[r]));
          else
            p = _mm256_maddubs_epi16(wq[r], xq);
          __m256i i32 = _mm256_madd_epi16(p, ones);
          if constexpr (F == Kind::kQ4_0)
            i32 = _mm256_sub_epi32(i32, _mm256_set1_epi32(a.s[(m0 + m) * ldb + b]));
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

// Tiles of MB tokens x RB rows (the last ones smaller); threads split the rows.
template <Kind F, int MB, int RB>
void run_tiles(const Weights& w, const QuantizedActivations& a, int64_t M, int64_t N, const Output& out) {
  const int64_t tiles = (N + RB - 1) / RB;
  // NOTE: a grain of ~64 rows keeps small layers on one thread, where a fork costs more than the work.
  tandem::avx2::parallel_for(0, tiles, std::max<int64_t>(1, 64 / RB), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * RB;
      if (row0 + RB <= N) {
        int64_t m = 0;
        for (; m + MB <= M; m += MB) tile<F, MB, RB>(w, a, m, row0, out);
        for (; m < M; ++m) tile<F, 1, RB>(w, a, m, row0, out);
      } else {
        for (int64_t row = row0; row < N; ++row)
          for (int64_t m = 0; m < M; ++m) tile<F, 1, 1>(w, a, m, row, out);
      }
    }
  });
}

template <Kind F>
at::Tensor run(const Weights& w, at::Tensor x, int64_t N, const float* row_scale,
               const c10::optional<at::Tensor>& bias, const char* op) {
  at::Tensor b;
  at::Tensor y = tandem::avx2::prepare_linear(x, N, w.K, bias, b, op);
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return y;
  const QuantizedActivations a = tandem::avx2::quantize_activations(x, w.blocks);
  const Output out(y, row_scale, b);
  if (M == 1)
    run_tiles<F, 1, 4>(w, a, M, N, out);  // decode: 4 row streams, 4 independent FMA chains
  else
    run_tiles<F, 2, 4>(w, a, M, N, out);
  return y;
}

// q8_0 / q4_1 rows may be strided (row stride >= row length, elements contiguous).
int64_t check_q8_0(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.stride(1) == 1 &&
                  qweight.stride(0) >= qweight.size(1),
              "q8_0: qweight must be int8 [N, K] with contiguous rows");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "q8_0: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  scale.stride(1) == 1 && scale.stride(0) >= K / 32,
              "q8_0: scale must be fp16 [N, K / 32] with contiguous rows");
  return K;
}

int64_t check_q4_1(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.stride(1) == 1 &&
                  qweight.stride(0) >= qweight.size(1),
              "q4_1: qweight must be uint8 [N, K / 2] with contiguous rows");
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "q4_1: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  scale.size(2) == 2 && scale.stride(2) == 1 && scale.stride(1) == 2 && scale.stride(0) >= K / 16,
              "q4_1: scale must be fp16 [N, K / 32, 2] (d, m pairs) with contiguous rows");
  return K;
}

Weights int8_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "linear_int8: qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "linear_int8: scale must be contiguous fp32 [N]");
  return {Kind::kInt8, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), nullptr, K, (K + 31) / 32, K, 0};
}

Weights int4_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "linear_int4: qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "linear_int4: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == K / 32 && scale.is_contiguous(),
              "linear_int4: scale must be contiguous fp16 [N, K / 32]");
  return {Kind::kQ4_0, qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / 32, K / 2, K / 32};
}

// NOTE: an asm barrier keeps GCC from fusing p = u * d and p + m into one FMA (-ffp-contract=fast):
// the Python reference rounds the product, then the sum.
inline __m256 opaque(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

// dst[0, 32) = bf16 of block b of a row, as quant.py's dequantize_* computes it in fp32.
template <Kind F>
inline void dequantize_block(const uint8_t* row, int64_t b, int64_t K, float d, float m, float row_scale,
                             c10::BFloat16* dst) {
  const __m256i c = block_codes<F>(row, b, K);
  const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const int64_t n = F == Kind::kInt8 ? std::min<int64_t>(32, K - 32 * b) : 32;
  for (int i = 0; i < 4; ++i) {
    const __m256i v32 = (F == Kind::kQ4_0 || F == Kind::kQ4_1) ? _mm256_cvtepu8_epi32(parts[i])
                                                               : _mm256_cvtepi8_epi32(parts[i]);
    __m256 v = _mm256_cvtepi32_ps(v32);
    if constexpr (F == Kind::kInt8) v = _mm256_mul_ps(v, _mm256_set1_ps(row_scale));
    if constexpr (F == Kind::kQ8_0) v = _mm256_mul_ps(v, _mm256_set1_ps(d));
    if constexpr (F == Kind::kQ4_0) v = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(8.0f)), _mm256_set1_ps(d));
    if constexpr (F == Kind::kQ4_1) v = _mm256_add_ps(opaque(_mm256_mul_ps(v, _mm256_set1_ps(d))), _mm256_set1_ps(m));
    tandem::avx2::store8(dst + 8 * i, v, n - 8 * i);
  }
}

template <Kind F>
at::Tensor dequantize_rows(const Weights& w, int64_t N, const float* row_scale) {
  auto out = at::empty({N, w.K}, at::TensorOptions().dtype(at::kBFloat16));
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t ldb = tandem::avx2::round_up(w.blocks, 8);
  tandem::avx2::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> d(ldb), m(ldb);
    for (int64_t n = begin; n < end; ++n) {
      row_scales<F, 1>(w, n, ldb, d.data(), m.data());
      for (int64_t b = 0; b < w.blocks; ++b)
        dequantize_block<F>(w.q + n * w.ldq, b, w.K, d[b], m[b], row_scale ? row_scale[n] : 1.0f,
                            dst + n * w.K + 32 * b);
    }
  });
  return out;
}

}  // namespace

at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = int8_weights(qweight, scale);
  return run<Kind::kInt8>(w, x, qweight.size(0), scale.data_ptr<float>(), bias, "linear_int8");
}

at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = int4_weights(qweight, scale);
  return run<Kind::kQ4_0>(w, x, qweight.size(0), nullptr, bias, "linear_int4");
}

at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const int64_t K = check_q8_0(qweight, scale);
  const Weights w{Kind::kQ8_0, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                  scale.data_ptr<at::Half>(), K, K / 32, qweight.stride(0), scale.stride(0)};
  return run<Kind::kQ8_0>(w, x, qweight.size(0), nullptr, bias, "linear_q8_0");
}

at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const int64_t K = check_q4_1(qweight, scale);
  const Weights w{Kind::kQ4_1, qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / 32,
                  qweight.stride(0), scale.stride(0)};
  return run<Kind::kQ4_1>(w, x, qweight.size(0), nullptr, bias, "linear_q4_1");
}

// bf16(q * scale) of an int8 layer or bf16((u - 8) * d) of an int4 layer (formats above).
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale) {
  if (qweight.scalar_type() == at::kChar)
    return dequantize_rows<Kind::kInt8>(int8_weights(qweight, scale), qweight.size(0), scale.data_ptr<float>());
  return dequantize_rows<Kind::kQ4_0>(int4_weights(qweight, scale), qweight.size(0), nullptr);
}

at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale) {
  const int64_t K = check_q8_0(qweight, scale);
  const Weights w{Kind::kQ8_0, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                  scale.data_ptr<at::Half>(), K, K / 32, qweight.stride(0), scale.stride(0)};
  return dequantize_rows<Kind::kQ8_0>(w, qweight.size(0), nullptr);
}

at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale) {
  const int64_t K = check_q4_1(qweight, scale);
  const Weights w{Kind::kQ4_1, qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / 32,
                  qweight.stride(0), scale.stride(0)};
  return dequantize_rows<Kind::kQ4_1>(w, qweight.size(0), nullptr);
}
