// bf16 linear on a packed weight: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX-512 BF16, lanes over N.
//
// The weight is re-laid out once at load (tandem.kernels.pack_bf16) in panels of 64 rows: panel p holds
// rows 64p .. 64p + 63 as [K / 2][64][2] (for each pair of K elements, the pair of every row, row-major),
// the last panel zero-padded to 64 rows. One `vdpbf16ps` (_mm512_dpbf16_ps, Intel SDM "VDPBF16PS") then
// takes 16 rows x one K pair from one 64-byte load and a token's K pair broadcast to every lane, so a
// (token, row) value is a single fp32 chain over the K pairs in K order: acc = dpbf16(acc, x pair, w pair),
// from 0, then + bias, rounded to bf16 (round to nearest even, as c10::BFloat16). No lane sums, no split
// of K: the order is the same whatever the number of tokens in the call and whichever register tile
// (1..6 tokens x 64 rows) computes the value, so greedy output does not depend on the batch (issue 11,
// item 5). This is the layout of oneDNN's and PACE's bf16 GEMMs (lanes over N, a broadcast operand); the
// unpacked kernel (linear_bf16.cpp) reduces along K in lanes instead and must sum lanes per value.
//
// Measured on one Zen 4 core (family 25 model 17, 2026-12-02, standalone loop over a Qwen2.5-0.5B
// gate_up 9728 x 896): 211 GFLOP/s at 16 tokens where the unpacked 4x4 tiles reach ~80; one token reads
// the 272 MB LM head at 26-28 GB/s (the unpacked rows: 23).
// Threads split the panels (tandem::avx2::parallel_for); each thread runs every token tile of a panel
// while the panel (K * 128 bytes) stays in L2.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "avx2/parallel.h"
#include "gemm_tile.h"
#include "packed_bf16.h"

namespace tandem {
at::Tensor prepare_linear(at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                          at::Tensor& bias_c, const char* op);  // linear_bf16.cpp
}  // namespace tandem

namespace {

using tandem::packed::kPanel;

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Rows [64 p, 64 p + 64) of y for MB tokens: panel `w` ([K / 2][64][2]), tokens x (row stride ldx),
// output y (row stride N) for the first `cols` (1..64) rows of the panel, bias from row0 or nullptr.
template <int MB>
__attribute__((always_inline)) inline void panel_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2,
                                                      c10::BFloat16* y, int64_t N, int64_t row0, int cols,
                                                      const c10::BFloat16* bias) {
  __m512 acc[MB][4];
  TANDEM_UNROLL_ALL
  for (int m = 0; m < MB; ++m)
    TANDEM_UNROLL
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    const uint16_t* wp = w + j * 2 * kPanel;
    __m512bh wv[4];
    TANDEM_UNROLL
    for (int v = 0; v < 4; ++v) wv[v] = tandem::load_bf16(wp + 32 * v);
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(x + m * ldx + 2 * j)));
      TANDEM_UNROLL
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], b, wv[v]);
    }
  }
  TANDEM_UNROLL
  for (int v = 0; v < 4; ++v) {
    const int c0 = 16 * v;
    if (c0 >= cols) break;
    const __mmask16 mask = cols - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - c0)) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i h = _mm256_maskz_loadu_epi16(mask, bias + row0 + c0);
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16 -> fp32, exact
    }
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512 r = bias != nullptr ? _mm512_add_ps(acc[m][v], bv) : acc[m][v];
      _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + m * N + row0 + c0), mask, tandem::Output::to_bf16(r));
    }
  }
}

// The last 1..5 tokens of a panel.
inline void panel_rest(int64_t rest, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, c10::BFloat16* y,
                       int64_t N, int64_t row0, int cols, const c10::BFloat16* bias) {
  switch (rest) {
    case 1: panel_tile<1>(x, ldx, w, K2, y, N, row0, cols, bias); break;
    case 2: panel_tile<2>(x, ldx, w, K2, y, N, row0, cols, bias); break;
    case 3: panel_tile<3>(x, ldx, w, K2, y, N, row0, cols, bias); break;
    case 4: panel_tile<4>(x, ldx, w, K2, y, N, row0, cols, bias); break;
    case 5: panel_tile<5>(x, ldx, w, K2, y, N, row0, cols, bias); break;
    default: break;
  }
}

}  // namespace

// x [M, K] bf16; w the packed weight of pack_bf16: a bf16 tensor of shape [N, K] (K even) whose storage
// holds ceil(N / 64) panels of 64 x K from its data pointer; bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_bf16_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  const int64_t panels = tandem::packed::check_args(x, w), N = w.size(0), K = w.size(1);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_bf16_packed");
  const int64_t M = x.size(0), K2 = K / 2;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  c10::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const c10::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  constexpr int MB = 6;  // 24 accumulators, 4 weight vectors: 28 of the 32 registers
  tandem::avx2::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * kPanel * K;
      const int64_t row0 = p * kPanel;
      const int cols = static_cast<int>(N - row0 < kPanel ? N - row0 : kPanel);
      int64_t m = 0;
      for (; m + MB <= M; m += MB) panel_tile<MB>(xp + m * K, K, panel, K2, yp + m * N, N, row0, cols, bp);
      if (m < M) panel_rest(M - m, xp + m * K, K, panel, K2, yp + m * N, N, row0, cols, bp);
    }
  });
  return y;
}
