// bf16 GEMV / small-batch GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX-512 BF16.
//
// Decode reads every weight once per step, so the kernel streams the rows of w in their checkpoint
// layout (no packing). One or two tokens (memory-bound) read one row at a time (dot_row in
// gemm_tile.h: a single sequential stream, kChains = 4 accumulators per dot product to hide the
// vdpbf16ps latency: one accumulator measured 25-35% slower at one token on Zen 5); more tokens use
// register tiles of 4 tokens x 4 rows (x 6 rows from 32 tokens on; tile_block), prefetching the next
// tile. Every path sums a dot product in dot_row<1, kChains>'s order, so a (token, row) value has the
// same bits whatever the number of tokens (batch invariance, issue 11 item 5): a tile runs the 4 chains
// as 4 passes over each 1024-element block of K with one accumulator per dot product, so it holds 16-24
// dot products where 4 chains in registers held 6 (2x3 tiles; README, Performance: measured costs).
// Products of two bf16 values are exact in fp32, so the only rounding is fp32 accumulation and the
// final round-to-nearest-even to bf16 (as oneDNN does). Threads split the rows (tandem::avx2::parallel_for: the
// worker team of avx2/parallel.cpp, shared by both variants): each reads a contiguous slice.
#include <ATen/Parallel.h>

#include "avx2/parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_tile.h"

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

// y = x . w^T for M >= 3 tokens: tiles of RB rows (split over threads) x MB tokens, the last token tile
// smaller, each dot product in dot_row<1, kChains>'s order (tile_block / tile_finish: one accumulator per
// dot product, 4 passes per block of kKBlock elements of K). Tokens go in blocks of about
// kTokenBlockBytes of x, so that a block stays in L2 while a thread's rows stream past it; within a row
// tile the K blocks are the outer loop, so a block of the rows stays in L1 while the token tiles pass.
constexpr int64_t kTokenBlockBytes = 384 << 10, kKBlock = 1024;

template <int MB, int RB>
static void tiled(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K,
                   const tandem::Output& out) {
  constexpr int64_t kPart = tandem::kChains * MB * RB * 16;  // floats of one token tile's chain sums
  const int64_t tiles = N / RB;
  const int64_t block = std::min(M, std::max<int64_t>(MB, kTokenBlockBytes / (2 * K) / MB * MB));
  const int64_t main_end = K / (32 * tandem::kChains) * (32 * tandem::kChains);
  tandem::avx2::parallel_for(0, tiles, 64 / RB, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(block * RB), parts((block / MB + 1) * kPart + 16);
    float* part = parts.data() + (-reinterpret_cast<uintptr_t>(parts.data()) / sizeof(float) & 15);  // 64-byte aligned
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t mt = std::min(block, M - m0), whole = mt / MB * MB;
      const tandem::Output o{out.y + m0 * out.N, out.N, out.scale, out.bias};
      const uint16_t* xb = xp + m0 * K;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t row0 = t * RB;
        const uint16_t* w = wp + row0 * K;
        const uint16_t* next = t + 1 < end ? w + RB * K : nullptr;
        for (int64_t k0 = 0; k0 < main_end; k0 += kKBlock) {
          const int64_t k1 = std::min(k0 + kKBlock, main_end);
          for (int64_t m = 0; m < whole; m += MB) {
            float* p = part + (main_end > kKBlock ? m / MB * kPart : 0);  // one slot (in L1) for one K block
            tandem::tile_block<MB, RB, 1>(xb + m * K, K, w, K, k0, k1, k0 == 0, p, m == 0 ? next : nullptr);
            if (k1 == main_end) tandem::tile_finish<MB, RB>(xb + m * K, K, w, K, K, p, acc.data() + m * RB);
          }
        }
        if (main_end == 0)
          for (int64_t m = 0; m < whole; m += MB)
            tandem::tile_finish<MB, RB>(xb + m * K, K, w, K, K, part, acc.data() + m * RB);
        if (whole < mt)
          tandem::dot_rest_passes<MB - 1, RB>(mt - whole, xb + whole * K, K, K, kKBlock, w, K, acc.data() + whole * RB,
                                              whole == 0 ? next : nullptr);
        o.store_vec(acc.data(), RB, mt, row0);
      }
    }
  });
  std::vector<float> acc(M);
  for (int64_t row = tiles * RB; row < N; ++row) {
    for (int64_t m = 0; m < M; ++m) tandem::dot_row<1, tandem::kChains>(xp + m * K, K, wp + row * K, K, acc.data() + m);
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
          tandem::dot_row<1, tandem::kChains>(xp, K, wp + n * K, K, acc);
        else
          tandem::dot_row<2, tandem::kChains>(xp, K, wp + n * K, K, acc);
        out.store(acc, 1, M, n);
      }
    });
    return y;
  }
  // NOTE: 4 x 6 tiles (24 accumulators) read the tokens' lines for more rows: 1.07-1.13x the 4 x 4 tiles'
  // speed at 48-512 tokens, the same at 24-32, 0.95-0.97x at 4-16 (1 thread, Qwen2.5-0.5B layers).
  if (M >= 32)
    tiled<4, 6>(xp, wp, M, N, K, out);
  else
    tiled<4, 4>(xp, wp, M, N, K, out);
  return y;
}
