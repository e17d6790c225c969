// bf16 linear on a packed weight, AVX2 + FMA: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), lanes over N.
//
// The weight layout is the avx512_bf16 kernel's (csrc/linear_bf16_packed.cpp, tandem.kernels.pack_bf16):
// panels of 64 rows, panel p = rows 64p .. 64p + 63 as [K / 2][64][2], zero-padded to 64 rows. A 32-byte
// load at (pair j, rows 8g .. 8g + 7) holds those 8 rows' K pair j, one row per 32-bit word; the low
// half of a word is the even element, the high half the odd one, so an AND and a shift widen them to
// fp32 exactly (gemm.h bf16_even / bf16_odd) and two FMAs with the token's x[2j] and x[2j + 1]
// broadcast to every lane add them. Each (token, row) value is thus one fp32 chain over K in K order,
// acc = fma(w[2j], x[2j], acc); acc = fma(w[2j + 1], x[2j + 1], acc), from 0, then + bias, rounded to
// bf16 (nearest even): no lane sums, no split of K, the same order for every number of tokens and every
// register tile, so a token's output is bit-identical alone or in any batch (issue 11, item 5). On CPUs
// without bf16 dot products the row-major kernel (linear_bf16.cpp) widens rows into an fp32 block and
// must sum 8 lanes per value; this one reuses each widened weight vector for several tokens in registers.
//
// Register tiles (16 ymm registers), per panel: token 0 alone over all 64 rows (8 row groups, 8 independent
// chains, the two broadcasts in registers), which reads the panel in memory order and so brings it into L2 at
// the streaming rate; then tiles of 5 (and one of 4) tokens x 2 row groups, the groups widened into 4 registers
// that every token of the tile uses, its broadcasts loaded per use (10 accumulators); the last 1-3 tokens one
// at a time as token 0. The 2-group tiles read 64 of every 256 bytes of the panel, a stride the hardware
// prefetchers follow poorly: from memory they ran at a third of their rate from L2.
// Measured (Zen 4 core, 1 thread, the AVX2 code, 9728 x 896, 2026-12-03): 5 tokens 73 GFLOP/s, 16 tokens 88,
// 512 tokens 91 (the row-major kernel: 18, 36, 77).
// Threads split the panels (tandem::avx2::parallel_for).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gemm.h"
#include "ops.h"
#include "../packed_bf16.h"

namespace {

#define TANDEM_UNROLL_ALL _Pragma("GCC unroll 32")

using tandem::avx2::bf16_even;
using tandem::avx2::bf16_odd;

using tandem::packed::kPanel;
constexpr int kReuse = 5;  // tokens of the main register tile (4 ran 20% slower, 6 spilled)

// x [M, K] bf16 -> fp32 [M, K] in K order (exact; the broadcast operands).
std::vector<float> activations_in_order(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M * K);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  float* op = out.data();
  tandem::avx2::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t k = 0; k < K; k += 8) {
        const int64_t n = K - k < 8 ? K - k : 8;
        tandem::avx2::store8(op + m * K + k, tandem::avx2::load8(xp + m * K + k, n), n);
      }
  });
  return out;
}

inline __m256i load_group(const uint16_t* w, int64_t j, int g) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 2 * kPanel + 16 * g));
}

template <int T, int G>
__attribute__((always_inline)) inline void zero_tile(__m256 (&acc)[T][G]) {
  TANDEM_UNROLL_ALL
  for (int t = 0; t < T; ++t)
    TANDEM_UNROLL_ALL
    for (int g = 0; g < G; ++g) acc[t][g] = _mm256_setzero_ps();
}

// acc[t][g] + bias for rows 8 (g0 + g) .., stored as bf16 for the first `cols` rows of the panel.
template <int T, int G>
__attribute__((always_inline)) inline void store_tile(const __m256 (&acc)[T][G], c10::BFloat16* y, int64_t N,
                                                      int64_t row0, int g0, int cols, const c10::BFloat16* bias) {
  TANDEM_UNROLL_ALL
  for (int g = 0; g < G; ++g) {
    const int c0 = 8 * (g0 + g);
    if (c0 >= cols) break;
    const int n = cols - c0 < 8 ? cols - c0 : 8;
    const __m256 bv = bias != nullptr ? tandem::avx2::load8(bias + row0 + c0, n) : _mm256_setzero_ps();
    TANDEM_UNROLL_ALL
    for (int t = 0; t < T; ++t) {
      const __m256 r = bias != nullptr ? _mm256_add_ps(acc[t][g], bv) : acc[t][g];
      tandem::avx2::store8(y + t * N + row0 + c0, r, n);
    }
  }
}

// T tokens x G row groups from group g0 (used as 1 x 8): per K pair, each token's two broadcasts are loaded
// once, each row group is widened once and used by every token.
template <int T, int G>
__attribute__((always_inline)) inline void stream_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K2,
                                                       c10::BFloat16* y, int64_t N, int64_t row0, int g0, int cols,
                                                       const c10::BFloat16* bias) {
  __m256 acc[T][G];
  zero_tile<T, G>(acc);
  for (int64_t j = 0; j < K2; ++j) {
    __m256 x0[T], x1[T];
    TANDEM_UNROLL_ALL
    for (int t = 0; t < T; ++t) {
      x0[t] = _mm256_broadcast_ss(x + t * ldx + 2 * j);
      x1[t] = _mm256_broadcast_ss(x + t * ldx + 2 * j + 1);
    }
    TANDEM_UNROLL_ALL
    for (int g = 0; g < G; ++g) {
      const __m256i raw = load_group(w, j, g0 + g);
      const __m256 we = bf16_even(raw), wo = bf16_odd(raw);
      TANDEM_UNROLL_ALL
      for (int t = 0; t < T; ++t) {
        acc[t][g] = _mm256_fmadd_ps(we, x0[t], acc[t][g]);
        acc[t][g] = _mm256_fmadd_ps(wo, x1[t], acc[t][g]);
      }
    }
  }
  store_tile<T, G>(acc, y, N, row0, g0, cols, bias);
}

// T tokens x 2 row groups from group g0: per K pair the 2 groups are widened into 4 registers, and each
// token's broadcasts are loaded where they are used.
template <int T>
__attribute__((always_inline)) inline void reuse_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K2,
                                                      c10::BFloat16* y, int64_t N, int64_t row0, int g0, int cols,
                                                      const c10::BFloat16* bias) {
  constexpr int G = 2;
  __m256 acc[T][G];
  zero_tile<T, G>(acc);
  for (int64_t j = 0; j < K2; ++j) {
    __m256 we[G], wo[G];
    TANDEM_UNROLL_ALL
    for (int g = 0; g < G; ++g) {
      const __m256i raw = load_group(w, j, g0 + g);
      we[g] = bf16_even(raw);
      wo[g] = bf16_odd(raw);
    }
    TANDEM_UNROLL_ALL
    for (int t = 0; t < T; ++t) {
      const __m256 b0 = _mm256_broadcast_ss(x + t * ldx + 2 * j);
      const __m256 b1 = _mm256_broadcast_ss(x + t * ldx + 2 * j + 1);
      TANDEM_UNROLL_ALL
      for (int g = 0; g < G; ++g) {
        acc[t][g] = _mm256_fmadd_ps(we[g], b0, acc[t][g]);
        acc[t][g] = _mm256_fmadd_ps(wo[g], b1, acc[t][g]);
      }
    }
  }
  store_tile<T, G>(acc, y, N, row0, g0, cols, bias);
}

}  // namespace

// x [M, K] bf16; w the packed weight of pack_bf16 (a bf16 tensor of shape [N, K], K even, whose storage
// holds ceil(N / 64) panels of 64 x K from its data pointer); bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_bf16_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  const int64_t panels = tandem::packed::check_args(x, w), N = w.size(0), K = w.size(1);
  at::Tensor b;
  at::Tensor y = tandem::avx2::prepare_linear(x, N, K, bias, b, "linear_bf16_packed");
  const int64_t M = x.size(0), K2 = K / 2;
  if (M == 0 || N == 0) return y;
  const std::vector<float> x32 = activations_in_order(x);
  const int64_t ldx = K;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr;
  const float* xp = x32.data();
  tandem::avx2::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * kPanel * K;
      const int64_t row0 = p * kPanel;
      const int cols = static_cast<int>(N - row0 < kPanel ? N - row0 : kPanel);
      const int groups = (cols + 7) / 8;
      // Token 0 reads the panel in order (every line of each K pair), which brings it into L2 at the memory's
      // streaming rate; the tiles of 4-5 tokens that follow read only their row groups' lines of each pair
      // (a stride the prefetchers follow poorly: from memory they ran at a third of their rate) from L2, and
      // the last 1-3 tokens take the panel in order again, one token each.
      stream_tile<1, 8>(xp, ldx, panel, K2, yp, N, row0, 0, cols, bp);
      int64_t m = 1;
      for (; m + kReuse <= M; m += kReuse)
        for (int g0 = 0; g0 < groups; g0 += 2)
          reuse_tile<kReuse>(xp + m * ldx, ldx, panel, K2, yp + m * N, N, row0, g0, cols, bp);
      if (M - m >= 4) {
        for (int g0 = 0; g0 < groups; g0 += 2)
          reuse_tile<4>(xp + m * ldx, ldx, panel, K2, yp + m * N, N, row0, g0, cols, bp);
        m += 4;
      }
      for (; m < M; ++m) stream_tile<1, 8>(xp + m * ldx, ldx, panel, K2, yp + m * N, N, row0, 0, cols, bp);
    }
  });
  return y;
}
