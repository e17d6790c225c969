// bf16 GEMV / small-batch GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX-512 BF16.
//
// Decode reads every weight once per step, so the kernel streams the rows of w in their checkpoint
// layout (no packing). One or two tokens (memory-bound) read one row at a time (dot_row in
// gemm_tile.h: a single sequential stream); more tokens (compute-bound) use register tiles
// (dot_tile_sums: 8 tokens x 3 rows from 8 tokens on, 4 tokens x 6 rows below), prefetching the next
// tile. Measured on one Zen 4 core at 16 tokens (Qwen2.5-0.5B shapes), 8x3 tiles ran at 325-400
// GFLOP/s where 4x4 tiles with per-dot-product reductions ran at 250-330 (the LM head: 360 vs 215);
// at 4 tokens 4x6 tiles were best. Products of two bf16
// values are exact in fp32, so the only rounding is fp32 accumulation and the final
// round-to-nearest-even to bf16 (as oneDNN does). Threads split the rows (tandem::avx2::parallel_for: the
// worker team of avx2/parallel.cpp, shared by both variants): each reads a contiguous slice.
#include <ATen/Parallel.h>

#include "avx2/parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "gemm_tile.h"

using tandem::dot_rows;
using tandem::dot_rows_sums;

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

Output output(at::Tensor& y, const float* scale, const at::Tensor& bias) {
  return Output{y.data_ptr<at::BFloat16>(), y.size(1), scale, bias.defined() ? bias.data_ptr<at::BFloat16>() : nullptr};
}

}  // namespace tandem

// y = x . w^T for M >= 3 tokens: tiles of RB rows (split over threads) x MB tokens.
template <int MB, int RB>
static void tiled(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K,
                  const tandem::Output& out) {
  const int64_t tiles = N / RB;
  // NOTE: a grain of 64 / RB tiles (~64 rows) keeps tiny matrices on one thread, where a fork costs more.
  tandem::avx2::parallel_for(0, tiles, 64 / RB, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * RB);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * RB;
      const uint16_t* next = t + 1 < end ? wp + (row0 + RB) * K : nullptr;
      dot_rows_sums<MB, RB>(xp, K, M, K, wp + row0 * K, K, acc.data(), next);
      out.store_vec(acc.data(), RB, M, row0);
    }
  });
  std::vector<float> acc(M);
  for (int64_t row = tiles * RB; row < N; ++row) {
    dot_rows<1>(xp, K, M, K, wp + row * K, K, acc.data(), nullptr);
    out.store(acc.data(), 1, M, row);
  }
}

// x [M, K] bf16, w [N, K] bf16 (contiguous), bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_bf16: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(w.is_contiguous(), "linear_bf16: w must be contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_bf16");
  const int64_t M = x.size(0);
  const tandem::Output out = tandem::output(y, nullptr, b);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (M <= 2) {  // memory-bound: one sequential row stream at a time (see dot_row)
    tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      float acc[2];
      for (int64_t n = begin; n < end; ++n) {
        if (M == 1)
          tandem::dot_row<1, 4>(xp, K, wp + n * K, K, acc);
        else
          tandem::dot_row<2, 2>(xp, K, wp + n * K, K, acc);
        out.store(acc, 1, M, n);
      }
    });
    return y;
  }
  if (M >= 8)
    tiled<8, 3>(xp, wp, M, N, K, out);
  else
    tiled<4, 6>(xp, wp, M, N, K, out);
  return y;
}
