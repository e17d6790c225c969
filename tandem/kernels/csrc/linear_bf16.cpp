// bf16 GEMV / small-batch GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX-512 BF16.
//
// Decode reads every weight once per step, so the kernel streams the rows of w in their checkpoint
// layout (no packing) through the dot_tile micro-kernel (gemm_tile.h): a tile of 4 rows x 4 tokens
// keeps 16 fp32 accumulators. Products of two bf16 values are exact in fp32, so the only rounding
// is fp32 accumulation and the final round-to-nearest-even to bf16 (as oneDNN does). Threads split
// the rows (at::parallel_for, torch's OpenMP pool): each reads a contiguous slice, prefetching one
// tile ahead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "gemm_tile.h"

using tandem::dot_rows;
using tandem::kRowTile;

namespace {

void store_rows(const float* acc, int rows, int64_t M, int64_t row0, int64_t N, const float* scale,
                const at::BFloat16* bias, at::BFloat16* y) {
  for (int64_t m = 0; m < M; ++m) {
    for (int r = 0; r < rows; ++r) {
      float v = acc[m * rows + r];
      if (scale != nullptr) v *= scale[row0 + r];
      if (bias != nullptr) v += static_cast<float>(bias[row0 + r]);
      y[m * N + row0 + r] = at::BFloat16(v);
    }
  }
}

}  // namespace

namespace tandem {

// Shared by the quantized kernels: checks x/bias and allocates y [M, N] bf16.
at::Tensor prepare_linear(at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                          at::Tensor& bias_c, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be 2-D bf16");
  TORCH_CHECK(x.size(1) == K, op, ": x and the weight disagree on K");
  x = x.contiguous();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kBFloat16, op, ": bias must be bf16 [N]");
    bias_c = bias->contiguous();
  }
  return at::empty({x.size(0), N}, x.options());
}

void store_tile(const float* acc, int rows, int64_t M, int64_t row0, int64_t N, const float* scale,
                const at::Tensor& bias, at::Tensor& y) {
  store_rows(acc, rows, M, row0, N, scale, bias.defined() ? bias.data_ptr<at::BFloat16>() : nullptr,
             y.data_ptr<at::BFloat16>());
}

}  // namespace tandem

// x [M, K] bf16, w [N, K] bf16 (contiguous), bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_bf16: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(w.is_contiguous(), "linear_bf16: w must be contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_bf16");
  const int64_t M = x.size(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (M <= 2) {  // memory-bound: one sequential row stream at a time (see dot_row)
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      float acc[2];
      for (int64_t n = begin; n < end; ++n) {
        if (M == 1)
          tandem::dot_row<1, 4>(xp, K, wp + n * K, K, acc);
        else
          tandem::dot_row<2, 2>(xp, K, wp + n * K, K, acc);
        tandem::store_tile(acc, 1, M, n, N, nullptr, b, y);
      }
    });
    return y;
  }
  const int64_t tiles = N / kRowTile;
  // NOTE: a grain of 16 tiles (64 rows) keeps tiny matrices on one thread, where a fork costs more.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kRowTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kRowTile;
      const uint16_t* next = t + 1 < end ? wp + (row0 + kRowTile) * K : nullptr;
      dot_rows<kRowTile>(xp, K, M, K, wp + row0 * K, K, acc.data(), next);
      tandem::store_tile(acc.data(), kRowTile, M, row0, N, nullptr, b, y);
    }
  });
  std::vector<float> acc(M);
  for (int64_t row = tiles * kRowTile; row < N; ++row) {
    dot_rows<1>(xp, K, M, K, wp + row * K, K, acc.data(), nullptr);
    tandem::store_tile(acc.data(), 1, M, row, N, nullptr, b, y);
  }
  return y;
}
