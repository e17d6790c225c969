// Weight-only quantized linear layers for decode: y[M, N] = x[M, K] @ dequant(w)^T (+ bias), x bf16.
//
// Formats (tandem/models/quant.py writes them):
//   int8  qweight int8 [N, K], scale fp32 [N]: w = q * scale[n] (symmetric, per output channel).
//   int4  qweight uint8 [N, K / 2], scale fp16 [N, K / 32]: in group g of row n (32 weights, 16 bytes,
//         llama.cpp Q4_0's layout), byte j holds (q_j + 8) | (q_{j+16} + 8) << 4 and w = q * scale[n, g].
// Each thread walks its tiles of 4 rows; per tile the weights are dequantized into an L1 buffer of
// bf16, kChunk columns at a time, and multiplied with the shared micro-kernel (gemm_tile.h), so the
// dequantization is paid once per weight however many tokens there are. int8 values are exact in bf16
// (the per-row scale is applied at the end, in fp32); int4 values become bf16(q * scale), whose
// rounding (2^-9 relative) is far below the 4-bit quantization step.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "gemm_tile.h"
#include "vec.h"

namespace tandem {
at::Tensor prepare_linear(at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                          at::Tensor& bias_c, const char* op);
void store_tile(const float* acc, int rows, int64_t M, int64_t row0, int64_t N, const float* scale,
                const at::Tensor& bias, at::Tensor& y);
}  // namespace tandem

namespace {

using tandem::dot_rows;
using tandem::kRowTile;
using tandem::lane_mask;

constexpr int64_t kChunk = 1024;  // columns dequantized at a time: 4 rows x 2 KB stay in L1

struct Int8Rows {
  const int8_t* q;
  int64_t K;
  // dst[0, n) = bf16(q[row, k0 + i]); prefetches the same bytes of row `pf_row` (or none if < 0).
  void operator()(int64_t row, int64_t k0, int64_t n, uint16_t* dst, int64_t pf_row) const {
    const int8_t* src = q + row * K + k0;
    const int8_t* pf = pf_row >= 0 ? q + pf_row * K + k0 : nullptr;
    for (int64_t i = 0; i < n; i += 32) {
      if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + i), _MM_HINT_T0);
      const int64_t left = n - i;
      const __mmask16 m0 = lane_mask(left), m1 = lane_mask(std::max<int64_t>(left - 16, 0));
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, src + i)));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, src + i + 16)));
      const __mmask32 m = left >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1ULL << left) - 1);
      _mm512_mask_storeu_epi16(dst + i, m, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

struct Int4Rows {
  const uint8_t* q;
  const at::Half* scale;
  int64_t K;
  // n and k0 are multiples of 32 (K % 32 == 0 is checked).
  void operator()(int64_t row, int64_t k0, int64_t n, uint16_t* dst, int64_t pf_row) const {
    const uint8_t* src = q + row * (K / 2) + k0 / 2;
    const uint8_t* pf = pf_row >= 0 ? q + pf_row * (K / 2) + k0 / 2 : nullptr;
    const at::Half* s = scale + row * (K / 32) + k0 / 32;
    const __m512i low4 = _mm512_set1_epi32(0xF);
    for (int64_t g = 0; g < n / 32; ++g) {
      if (pf != nullptr && (g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + 16 * g), _MM_HINT_T0);
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * g)));
      const float d = static_cast<float>(s[g]);
      const __m512 dv = _mm512_set1_ps(d), off = _mm512_set1_ps(-8.0f * d);
      __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low4)), dv, off);
      __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), dv, off);
      _mm512_storeu_si512(dst + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

// One token (decode at batch 1): dot products straight from the int8 bytes in fp32, no bf16 buffer
// (a quarter of the instructions per weight of the buffered path, which is compute-bound there).
// x32 is x in fp32; two accumulators per row hide the FMA latency.
template <int RB>
void int8_rows_one_token(const int8_t* q, int64_t K, const float* x32, float* out, const int8_t* pf) {
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf != nullptr && (k & 63) == 0)
      for (int r = 0; r < RB; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
    const __m512 x0 = _mm512_loadu_ps(x32 + k), x1 = _mm512_loadu_ps(x32 + k + 16);
    for (int r = 0; r < RB; ++r) {
      const int8_t* row = q + r * K + k;
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
      __m512 w1 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
      acc[r][0] = _mm512_fmadd_ps(w0, x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, x1, acc[r][1]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 m = lane_mask(K - k);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x32 + k);
    for (int r = 0; r < RB; ++r)
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + r * K + k))),
                                  xv, acc[r][0]);
  }
  for (int r = 0; r < RB; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

void run_int8_one_token(const int8_t* q, const at::Tensor& x, int64_t N, int64_t K, const float* row_scale,
                        const at::Tensor& bias, at::Tensor& y) {
  std::vector<float> x32(K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t k = 0; k < K; ++k) x32[k] = static_cast<float>(xp[k]);
  const int64_t tiles = N / kRowTile;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    float acc[kRowTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kRowTile;
      int8_rows_one_token<kRowTile>(q + row0 * K, K, x32.data(), acc, t + 1 < end ? q + (row0 + kRowTile) * K : nullptr);
      tandem::store_tile(acc, kRowTile, 1, row0, N, row_scale, bias, y);
    }
  });
  for (int64_t row = tiles * kRowTile; row < N; ++row) {
    float acc[1];
    int8_rows_one_token<1>(q + row * K, K, x32.data(), acc, nullptr);
    tandem::store_tile(acc, 1, 1, row, N, row_scale, bias, y);
  }
}

template <int RB, typename Rows>
void tile(const Rows& rows, const uint16_t* x, int64_t M, int64_t K, int64_t row0, int64_t pf_row0,
          uint16_t* buf, float* acc, float* part) {
  std::fill(acc, acc + M * RB, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t n = std::min(kChunk, K - k0);
    for (int r = 0; r < RB; ++r) rows(row0 + r, k0, n, buf + r * kChunk, pf_row0 >= 0 ? pf_row0 + r : -1);
    dot_rows<RB>(x + k0, K, M, n, buf, kChunk, part, nullptr);
    for (int64_t i = 0; i < M * RB; ++i) acc[i] += part[i];
  }
}

template <typename Rows>
void run(const Rows& rows, const at::Tensor& x, int64_t N, int64_t K, const float* row_scale,
         const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), tiles = N / kRowTile;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf(kRowTile * kChunk);
    std::vector<float> acc(M * kRowTile), part(M * kRowTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kRowTile;
      tile<kRowTile>(rows, xp, M, K, row0, t + 1 < end ? row0 + kRowTile : -1, buf.data(), acc.data(),
                     part.data());
      tandem::store_tile(acc.data(), kRowTile, M, row0, N, row_scale, bias, y);
    }
  });
  std::vector<uint16_t> buf(kChunk);
  std::vector<float> acc(M), part(M);
  for (int64_t row = tiles * kRowTile; row < N; ++row) {
    tile<1>(rows, xp, M, K, row, -1, buf.data(), acc.data(), part.data());
    tandem::store_tile(acc.data(), 1, M, row, N, row_scale, bias, y);
  }
}

}  // namespace

// x [M, K] bf16, qweight int8 [N, K], scale fp32 [N], bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "linear_int8: qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "linear_int8: scale must be contiguous fp32 [N]");
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_int8");
  if (x.size(0) == 1) {
    run_int8_one_token(qweight.data_ptr<int8_t>(), x, N, K, scale.data_ptr<float>(), b, y);
    return y;
  }
  run(Int8Rows{qweight.data_ptr<int8_t>(), K}, x, N, K, scale.data_ptr<float>(), b, y);
  return y;
}

// x [M, K] bf16, qweight uint8 [N, K / 2], scale fp16 [N, K / 32], bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "linear_int4: qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "linear_int4: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == K / 32 && scale.is_contiguous(),
              "linear_int4: scale must be contiguous fp16 [N, K / 32]");
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_int4");
  run(Int4Rows{qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K}, x, N, K, nullptr, b, y);
  return y;
}
