// Shared pieces of the avx2 quantized kernels (linear_quant.cpp, dequantize_quant.cpp): the formats'
// codes and scales as one layer's view (Weights, see linear_quant.cpp for the formats), their argument
// checks, a block's 32 codes, and the fp32 scales of a group of 8 blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "gemm.h"

namespace tandem::avx2::quant {

enum class Kind { kInt8, kQ8_0, kQ4_0, kQ4_1 };

// One layer's codes and scales: qweight rows of ldq bytes, fp16 scale rows of lds halves; head: the bytes
// of a row before its codes in the same buffer (QuantizedLinear's q8_0 / q4_1 rows: the scales), else 0.
struct Weights {
  Kind kind;
  const uint8_t* q;
  const c10::Half* scale;  // nullptr for int8
  int64_t K, blocks, ldq, lds, head = 0;
};

// The head of a q8_0 / q4_1 layer whose scale rows sit just before their code rows (see Weights).
inline int64_t row_head(const void* q, const void* scale, int64_t ldq) {
  const int64_t d = static_cast<const char*>(q) - static_cast<const char*>(scale);
  return d > 0 && d < ldq ? d : 0;
}


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


// q8_0 / q4_1 rows may be strided (row stride >= row length, elements contiguous).
inline int64_t check_q8_0(const at::Tensor& qweight, const at::Tensor& scale) {
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

inline int64_t check_q4_1(const at::Tensor& qweight, const at::Tensor& scale) {
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

inline Weights int8_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "linear_int8: qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "linear_int8: scale must be contiguous fp32 [N]");
  return {Kind::kInt8, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), nullptr, K, (K + 31) / 32, K, 0};
}

inline Weights int4_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "linear_int4: qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "linear_int4: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == K / 32 && scale.is_contiguous(),
              "linear_int4: scale must be contiguous fp16 [N, K / 32]");
  return {Kind::kQ4_0, qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / 32, K / 2, K / 32};
}


// A q8_0 / q4_1 layer's tensors as Weights (after check_q8_0 / check_q4_1).
inline Weights q8_0_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  const int64_t K = check_q8_0(qweight, scale);
  return {Kind::kQ8_0, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), scale.data_ptr<at::Half>(),
          K, K / 32, qweight.stride(0), scale.stride(0), row_head(qweight.data_ptr(), scale.data_ptr(), qweight.stride(0))};
}

inline Weights q4_1_weights(const at::Tensor& qweight, const at::Tensor& scale) {
  const int64_t K = check_q4_1(qweight, scale);
  return {Kind::kQ4_1, qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / 32, qweight.stride(0),
          scale.stride(0), row_head(qweight.data_ptr(), scale.data_ptr(), qweight.stride(0))};
}

}  // namespace tandem::avx2::quant
