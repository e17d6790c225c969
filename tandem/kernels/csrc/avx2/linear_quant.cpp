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
//   Here the Q4 formats (int4, q4_1) take two blocks per 32-byte load (pair_dot): on Zen 1 a 256-bit
//   maddubs, madd or int -> float conversion costs 2 cycles, and pairing halves them per block.
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
#include <cstring>
#include <vector>

#include "gemm.h"
#include "ops.h"
#include "quant_blocks.h"
#include "quant_tile.h"

namespace {

using tandem::avx2::hsum8;
using tandem::avx2::Output;
using tandem::avx2::QuantizedActivations;
using namespace tandem::avx2::quant;

// Tiles of MB tokens x RB rows (the last ones smaller); threads split the rows.
template <Kind F, int MB, int RB>
void run_tiles(const Weights& w, const QuantizedActivations& a, int64_t M, int64_t N, const Output& out) {
  const int64_t tiles = (N + RB - 1) / RB;
  const PairCodes xp = F == Kind::kQ4_0 || F == Kind::kQ4_1 ? pair_codes(a, M) : PairCodes{};
  // NOTE: a grain of ~64 rows keeps small layers on one thread, where a fork costs more than the work.
  tandem::avx2::parallel_for(0, tiles, std::max<int64_t>(1, 64 / RB), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile_rows<F, MB, RB>(w, a, xp, 0, M, t * RB, N, out);
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
  const Weights w = q8_0_weights(qweight, scale);
  return run<Kind::kQ8_0>(w, x, qweight.size(0), nullptr, bias, "linear_q8_0");
}

at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const Weights w = q4_1_weights(qweight, scale);
  return run<Kind::kQ4_1>(w, x, qweight.size(0), nullptr, bias, "linear_q4_1");
}
