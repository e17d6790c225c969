// Shared pieces of the avx2 linear kernels (linear_bf16.cpp, linear_quant.cpp): argument checks,
// the output epilogue, fp32 copies of the activations, and per-token int8 quantization of the
// activations (ggml-quants.c quantize_row_q8_0 / quantize_row_q8_1).
//
// BATCH INVARIANCE: every (token m, row n) output is computed by one fixed sequence of operations
// that depends on neither M nor the tile or thread split: one 8-lane fp32 accumulator over K in
// order (lane j holds k = j mod 8, or block b's 8 int32 partial sums for the quantized formats),
// then hsum8 (vec.h, a fixed order), then Output::store. Tiles only decide which (m, n) pairs share
// a weight or activation load; a pair's arithmetic is the same alone (M = 1) or inside any batch.
// NOTE: the float operations are explicit intrinsics (FMA included) or sit in one noinline function
// (Output::store), so GCC's default -ffp-contract=fast cannot fuse them differently per caller.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace tandem::avx2 {

// Checks x [M, K] bf16 and bias [N] bf16 (or None), makes x contiguous, allocates y [M, N] bf16.
inline at::Tensor prepare_linear(at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
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

// y [M, N] bf16 = bf16(acc * scale[n] + bias[n]) (scale, bias optional; one FMA when both).
struct Output {
  c10::BFloat16* y;
  int64_t N;
  const float* scale;
  const c10::BFloat16* bias;

  Output(at::Tensor& out, const float* row_scale, const at::Tensor& b)
      : y(out.data_ptr<c10::BFloat16>()), N(out.size(1)), scale(row_scale),
        bias(b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr) {}

  // acc [tokens, rows] (row stride `rows`) holds tokens m0.. and rows row0..; one code path for every
  // caller (noinline), so each value is rounded by the same instructions whatever the tile.
  __attribute__((noinline)) void store(const float* acc, int64_t rows, int64_t tokens, int64_t m0,
                                       int64_t row0) const {
    for (int64_t m = 0; m < tokens; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        __m128 v = _mm_set_ss(acc[m * rows + r]);
        const int64_t n = row0 + r;
        if (scale != nullptr && bias != nullptr)
          v = _mm_fmadd_ss(v, _mm_set_ss(scale[n]), _mm_set_ss(static_cast<float>(bias[n])));
        else if (scale != nullptr)
          v = _mm_mul_ss(v, _mm_set_ss(scale[n]));
        else if (bias != nullptr)
          v = _mm_add_ss(v, _mm_set_ss(static_cast<float>(bias[n])));
        y[(m0 + m) * N + n] = c10::BFloat16(_mm_cvtss_f32(v));
      }
  }
};

inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The even / odd split of 16 bf16 values held as 8 32-bit words: the high half of each word is the
// odd element, already an fp32 bit pattern once the low half is masked off (AND); the low half
// shifted up is the even one. One load and two ALU ops, no shuffle (vpmovzxwd is one).
inline __m256 bf16_even(__m256i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)); }
inline __m256 bf16_odd(__m256i raw) {
  return _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The first n (0..16) bf16 values at p as 32 bytes, zero past n; never reads past p + n.
inline __m256i load_bf16x16(const c10::BFloat16* p, int64_t n) {
  if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t tmp[16] = {};
  if (n > 0) std::memcpy(tmp, p, 2 * n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// dst[0, 16) = fp32 of src[0, n) in the split layout of the bf16 kernel: per group of 16 values, the
// 8 even ones then the 8 odd ones; zero past n.
inline void widen16(const c10::BFloat16* src, int64_t n, float* dst) {
  const __m256i raw = load_bf16x16(src, n);
  _mm256_storeu_ps(dst, bf16_even(raw));
  _mm256_storeu_ps(dst + 8, bf16_odd(raw));
}

// x [M, K] bf16 -> fp32 [M, round_up(K, 16)] in widen16's split layout, zero-padded (exact).
inline std::vector<float> activations_fp32(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ld = round_up(K, 16);
  std::vector<float> out(M * ld);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t k = 0; k < ld; k += 16) widen16(xp + m * K + k, K - k, &out[m * ld + k]);
  });
  return out;
}

// Activations quantized per token and block of 32, as ggml-quants.c quantize_row_q8_0 (AVX2 branch):
// dx = max|x_b| / 127, xq = round(x * (1 / dx)) (round half to even, vcvtps2dq), 0 where dx = 0;
// plus quantize_row_q8_1's block sum S_b = sum_j xq_j (kept exact, int32) and dx * S_b (fp32).
// A partial last block (K % 32, int8 weights only) is zero-padded. Arrays are [M, ld*]:
struct QuantizedActivations {
  int64_t blocks = 0, ldq = 0, ldb = 0;  // blocks per token; row strides of q (bytes), of d/s/ds
  std::vector<int8_t> q;    // [M, 32 * blocks]
  std::vector<float> d;     // [M, ldb] dx, zero-padded to ldb = round_up(blocks, 8)
  std::vector<int32_t> s;   // [M, ldb] S_b
  std::vector<float> ds;    // [M, ldb] dx * S_b
};

inline void quantize_token(const c10::BFloat16* x, int64_t K, int64_t blocks, int8_t* q, float* d, int32_t* s,
                           float* ds) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const int64_t k = 32 * b + 8 * i;
      v[i] = load8(x + k, K - k < 0 ? 0 : K - k);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    const float dx = hmax8(amax) / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
    // ggml's packing: packs within 128-bit lanes, then the lane order fixed by a permutation.
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), p8);
    const int32_t sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
    d[b] = dx;
    s[b] = sum;
    ds[b] = dx * static_cast<float>(sum);
  }
}

inline QuantizedActivations quantize_activations(const at::Tensor& x, int64_t blocks) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedActivations a;
  a.blocks = blocks;
  a.ldq = 32 * blocks;
  a.ldb = round_up(blocks, 8);
  a.q.assign(M * a.ldq, 0);
  a.d.assign(M * a.ldb, 0.0f);
  a.s.assign(M * a.ldb, 0);
  a.ds.assign(M * a.ldb, 0.0f);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  parallel_for(0, M, 8, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_token(xp + m * K, K, blocks, &a.q[m * a.ldq], &a.d[m * a.ldb], &a.s[m * a.ldb], &a.ds[m * a.ldb]);
  });
  return a;
}

// n (<= 8) fp16 values -> fp32 dst[0, 8), zero past n (F16C vcvtph2ps; never reads past src + n).
inline void halves8(const c10::Half* src, int64_t n, float* dst) {
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const __m128i h = n >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src))
                           : (std::memcpy(tmp, src, 2 * n), _mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(h));
}

}  // namespace tandem::avx2
