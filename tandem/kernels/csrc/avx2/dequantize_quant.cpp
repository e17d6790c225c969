// Dequantization of the avx2 quantized formats to bf16 (linear_quant.cpp names the formats): the dense
// weight a caller multiplies with another GEMM, computed as quant.py's dequantize_* does in fp32.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "ops.h"
#include "quant_blocks.h"

namespace {

using namespace tandem::avx2::quant;

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

// bf16(q * scale) of an int8 layer or bf16((u - 8) * d) of an int4 layer (formats above).
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale) {
  if (qweight.scalar_type() == at::kChar)
    return dequantize_rows<Kind::kInt8>(int8_weights(qweight, scale), qweight.size(0), scale.data_ptr<float>());
  return dequantize_rows<Kind::kQ4_0>(int4_weights(qweight, scale), qweight.size(0), nullptr);
}

at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale) {
  const Weights w = q8_0_weights(qweight, scale);
  return dequantize_rows<Kind::kQ8_0>(w, qweight.size(0), nullptr);
}

at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale) {
  const Weights w = q4_1_weights(qweight, scale);
  return dequantize_rows<Kind::kQ4_1>(w, qweight.size(0), nullptr);
}
