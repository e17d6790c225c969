// The packed bf16 weight of tandem.kernels.pack_bf16, as both variants' linear_bf16_packed read it
// (linear_bf16_packed.cpp for avx512_bf16, avx2/linear_bf16_packed.cpp): panels of kPanel rows, panel p
// holding rows kPanel p .. kPanel p + kPanel - 1 as [K / 2][kPanel][2], the last one zero-padded.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tandem::packed {

constexpr int kPanel = 64;  // rows per panel (tandem.kernels.PACK_ROWS)

// Checks x [M, K] and the packed w (shape [N, K], bf16, contiguous, K even, its storage holding ceil(N / 64)
// panels from its data pointer); returns the number of panels. Raises (TORCH_CHECK) otherwise.
inline int64_t check_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_bf16_packed: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16_packed: bf16 only");
  TORCH_CHECK(w.is_contiguous(), "linear_bf16_packed: w must be the contiguous packed weight of pack_bf16");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % 2 == 0, "linear_bf16_packed: K must be even");
  const int64_t needed = (w.storage_offset() + panels * kPanel * K) * static_cast<int64_t>(sizeof(uint16_t));
  TORCH_CHECK(static_cast<int64_t>(w.storage().nbytes()) >= needed,
              "linear_bf16_packed: w's storage does not hold ceil(N / 64) panels (not a pack_bf16 weight)");
  return panels;
}

}  // namespace tandem::packed
