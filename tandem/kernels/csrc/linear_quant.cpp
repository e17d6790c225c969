// Weight-only quantized linear layers for decode: y[M, N] = x[M, K] @ dequant(w)^T (+ bias), x bf16.
//
// Formats (tandem/models/quant.py writes them):
//   int8  qweight int8 [N, K], scale fp32 [N]: w = q * scale[n] (symmetric, per output channel).
//   int4  qweight uint8 [N, K / 2], scale fp16 [N, K / 32]: in group g of row n (32 weights, 16 bytes,
//         llama.cpp Q4_0's layout), byte j holds (q_j + 8) | (q_{j+16} + 8) << 4 and w = q * scale[n, g].
//   q8_0  qweight int8 [N, K], scale fp16 [N, K / 32]: w = q * scale[n, g] (llama.cpp Q8_0's blocks).
//   q4_1  qweight uint8 [N, K / 2] (int4's nibble layout, u = nibble in 0..15), scale fp16 [N, K / 32, 2]
//         holding (d, m) per group: w = u * d + m (llama.cpp Q4_1's blocks).
//   q8_0 and q4_1 rows may be strided: QuantizedLinear keeps a row's scales and then its codes in one
//   buffer, so a layer is one sequential stream (see check_q8_0).
// Source of the block formats: ggml-quants.c (dequantize_row_q8_0 / q4_0 / q4_1).
// q8_0 at one token also quantizes the activations, as llama.cpp does (run_q8_0_one_token_vnni).
// One token (decode at batch 1, memory-bound) reads one row at a time straight from the quantized
// bytes (int8_row_one_token, int4_row_one_token). Several tokens: each thread walks tiles of 4 rows,
// dequantizes them into an L1 buffer of bf16, kChunk columns at a time, and multiplies with the
// shared micro-kernel (gemm_tile.h), so dequantization is paid once per weight however many tokens
// there are. int8 values are exact in bf16 (the per-row scale is applied at the end, in fp32); int4
// values become bf16(q * scale) there, whose rounding (2^-9 relative) is far below the 4-bit step.
#include <ATen/Parallel.h>

#include "avx2/parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "gemm_tile.h"
#include "vec.h"

namespace tandem {
at::Tensor prepare_linear(at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                          at::Tensor& bias_c, const char* op);
Output output(at::Tensor& y, const float* scale, const at::Tensor& bias);
}  // namespace tandem

namespace {

using tandem::dot_rows;
using tandem::kRowTile;
using tandem::lane_mask;

constexpr int64_t kChunk = 1024;  // columns dequantized at a time: 4 rows x 2 KB stay in L1

// dst[0, 16) = float(src[0, n)) (n <= 16; lanes past n are 0): a scalar at::Half conversion is a
// software routine that costs about as much as dequantizing a group, so scales convert 16 at a time.
inline void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  _mm512_store_ps(dst, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(n), src)));
}

// (d, m) fp16 pairs src[0, 2n) (n <= 16 pairs; lanes past n are 0) -> d and m as 16 floats each.
inline void pairs_to_floats(const at::Half* src, int64_t n, __m512* d, __m512* m) {
  const int64_t h = 2 * std::min<int64_t>(n, 16);
  const __m512i raw = _mm512_maskz_loadu_epi16(h >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1u << h) - 1), src);
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(raw)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  *d = _mm512_permutex2var_ps(lo, even, hi);
  *m = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
}

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
  bool q4_1 = false;  // scale holds (d, m) pairs and w = u * d + m; else (Q4_0) w = (u - 8) * d
  int64_t ldq = 0, lds = 0;  // row strides of q (bytes) and scale (halves); 0: contiguous rows
  // n and k0 are multiples of 32 (K % 32 == 0 is checked).
  void operator()(int64_t row, int64_t k0, int64_t n, uint16_t* dst, int64_t pf_row) const {
    const int64_t per = q4_1 ? 2 : 1;  // halves per group
    const int64_t lq = ldq ? ldq : K / 2, ls = lds ? lds : per * (K / 32);
    const uint8_t* src = q + row * lq + k0 / 2;
    const uint8_t* pf = pf_row >= 0 ? q + pf_row * lq + k0 / 2 : nullptr;
    const at::Half* s = scale + row * ls + per * (k0 / 32);
    const __m512i low4 = _mm512_set1_epi32(0xF);
    alignas(64) float ds[16], ms[16];
    for (int64_t g = 0; g < n / 32; ++g) {
      if (g % 16 == 0 && q4_1) {
        __m512 dv, mv;
        pairs_to_floats(s + 2 * g, n / 32 - g, &dv, &mv);
        _mm512_store_ps(ds, dv);
        _mm512_store_ps(ms, mv);
      } else if (g % 16 == 0) {
        halves_to_floats(s + g, n / 32 - g, ds);
      }
      if (pf != nullptr && (g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + 16 * g), _MM_HINT_T0);
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * g)));
      const float d = ds[g % 16];
      const __m512 dv = _mm512_set1_ps(d), off = _mm512_set1_ps(q4_1 ? ms[g % 16] : -8.0f * d);
      __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low4)), dv, off);
      __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), dv, off);
      _mm512_storeu_si512(dst + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

struct Q80Rows {
  const int8_t* q;
  const at::Half* scale;
  int64_t K, ldq, lds;  // row strides of q (bytes) and scale (halves)
  // n and k0 are multiples of 32 (K % 32 == 0 is checked): dst = bf16(q * d) group by group.
  void operator()(int64_t row, int64_t k0, int64_t n, uint16_t* dst, int64_t pf_row) const {
    const int8_t* src = q + row * ldq + k0;
    const int8_t* pf = pf_row >= 0 ? q + pf_row * ldq + k0 : nullptr;
    const at::Half* s = scale + row * lds + k0 / 32;
    alignas(64) float ds[16];
    for (int64_t g = 0; g < n / 32; ++g) {
      if (g % 16 == 0) halves_to_floats(s + g, n / 32 - g, ds);
      if (pf != nullptr && (g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + 32 * g), _MM_HINT_T0);
      const __m512 dv = _mm512_set1_ps(ds[g % 16]);
      const __m512 lo = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * g)))),
          dv);
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * g + 16)))),
                                      dv);
      _mm512_storeu_si512(dst + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

// One token, q8_0, one row: per group of 32, the fp32 dot product of the int8 bytes with x, then
// scaled by the group's d (two accumulators over alternating groups hide the FMA latency). Scales are
// converted from fp16 16 at a time (a scalar at::Half conversion per group costs as much as the group).
inline __m512 q8_0_group(const int8_t* b, const float* x) {  // sum of the 32 products, in 16 lanes
  const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
  const __m512 w1 =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16))));
  return _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(x)));
}

// NOTE: named accumulators, not an array indexed by g & 1, which GCC keeps on the stack (2x slower).
inline float q8_0_row_one_token(const int8_t* q, const at::Half* scale, int64_t K, const float* x32) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  const int64_t groups = K / 32;
  alignas(64) float d[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    halves_to_floats(scale + g0, groups - g0, d);
    const int64_t g_end = std::min<int64_t>(groups, g0 + 16);
    int64_t g = g0;
    for (; g + 2 <= g_end; g += 2) {
      acc0 = _mm512_fmadd_ps(q8_0_group(q + 32 * g, x32 + 32 * g), _mm512_set1_ps(d[g - g0]), acc0);
      acc1 = _mm512_fmadd_ps(q8_0_group(q + 32 * g + 32, x32 + 32 * g + 32), _mm512_set1_ps(d[g + 1 - g0]), acc1);
    }
    if (g < g_end) acc0 = _mm512_fmadd_ps(q8_0_group(q + 32 * g, x32 + 32 * g), _mm512_set1_ps(d[g - g0]), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void run_q8_0_one_token(const int8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                        int64_t N, int64_t K,
                        const at::Tensor& bias, at::Tensor& y) {
  std::vector<float> x32(K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t k = 0; k < K; ++k) x32[k] = static_cast<float>(xp[k]);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // one row at a time, as for int8
    for (int64_t row = begin; row < end; ++row) {
      const float acc = q8_0_row_one_token(q + row * ldq, scale + row * lds, K, x32.data());
      out.store(&acc, 1, 1, row);
    }
  });
}

// One token, q8_0, with the activations quantized as llama.cpp does (ggml-quants.c quantize_row_q8_0
// and ggml_vec_dot_q8_0_q8_0): x is split into blocks of 32 like the weights, block b gets
// dx_b = max|x_b| / 127 and xq = round(x / dx_b) in [-127, 127] (fp32, round half to even), once per
// token; then sum_j w_j x_j ~= sum_b d_b dx_b I_b with the exact integer I_b = sum_j q_j xq_j.
// VNNI's vpdpbusd multiplies unsigned by signed bytes, so the weight bytes are flipped to u = q + 128
// (XOR 0x80) and I_b = sum_j u_j xq_j - 128 S_b with S_b = sum_j xq_j, a per-token constant: the
// accumulator of block b starts at -16 S_b in each of its 8 int32 lanes. Blocks go in pairs (64
// bytes: lanes 0-7 block a, 8-15 block b), scaled by [d_a dx_a x 8, d_b dx_b x 8]. About 6
// instructions per 64 weights instead of 18 for the fp32 path above.
// Error against the exact sum: |x_j - xq_j dx_b| <= dx_b / 2, so |y - x.w| <= sum_b dx_b / 2 sum_j |w_j|
// (about 0.4% of |x| . |w| at worst), plus fp32 rounding of the per-block products.
struct Q8Activations {
  int64_t blocks = 0, pairs = 0;
  std::vector<int8_t> xq;      // [64 * pairs]: K codes, zero-padded to a whole pair
  std::vector<int32_t> init;   // [16 * pairs]: -16 S_b on the 8 lanes of block b
  std::vector<float> dx;       // [16 * ceil(blocks / 16)]: dx_b, zero-padded
};

inline Q8Activations quantize_activations(const at::BFloat16* x, int64_t K) {
  Q8Activations a;
  a.blocks = K / 32;
  a.pairs = (a.blocks + 1) / 2;
  a.xq.assign(64 * a.pairs, 0);
  a.init.assign(16 * a.pairs, 0);
  a.dx.assign(16 * ((a.blocks + 15) / 16), 0.0f);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < a.blocks; ++b) {
    const __m256i* src = reinterpret_cast<const __m256i*>(x + 32 * b);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, idv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, idv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xq.data() + 32 * b), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xq.data() + 32 * b + 16), _mm512_cvtsepi32_epi8(qhi));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    for (int j = 0; j < 8; ++j) a.init[8 * b + j] = -16 * s;
    a.dx[b] = d;
  }
  return a;
}

// NOTE: two 256-bit loads, not one 512-bit load: measured 47 vs 41 tok/s on the Qwen2.5-0.5B Q8_0 decode
// (weights streamed from DRAM, one Zen 4 core), with the rows 64-byte aligned or not.
__attribute__((target("avx512vnni"))) inline __m512i load64(const int8_t* p) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
}
__attribute__((target("avx512vnni"))) inline float q8_0_row_vnni(const int8_t* q, const at::Half* scale,
                                                                 const Q8Activations& a, const __m512i* pair_idx) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto* xq = reinterpret_cast<const __m512i*>(a.xq.data());
  const auto* init = reinterpret_cast<const __m512i*>(a.init.data());
  const int64_t full = a.blocks / 2;  // whole pairs
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < a.blocks; g0 += 16) {  // 16 blocks = 8 pairs share one scale conversion
    const __m512 s16 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(a.blocks - g0), scale + g0)),
                                     _mm512_loadu_ps(a.dx.data() + g0));
    const int64_t p0 = g0 / 2, p_end = std::min<int64_t>(full, p0 + 8);
    int64_t p = p0;
    for (; p + 2 <= p_end; p += 2) {
      const __m512i u0 = _mm512_xor_si512(load64(q + 64 * p), flip);
      const __m512i u1 = _mm512_xor_si512(load64(q + 64 * p + 64), flip);
      const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(init + p), u0, _mm512_loadu_si512(xq + p));
      const __m512i i1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(init + p + 1), u1, _mm512_loadu_si512(xq + p + 1));
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(pair_idx[p - p0], s16), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(pair_idx[p + 1 - p0], s16), acc1);
    }
    if (p < p_end) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * p), flip);
      const __m512i i = _mm512_dpbusd_epi32(_mm512_loadu_si512(init + p), u, _mm512_loadu_si512(xq + p));
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(pair_idx[p - p0], s16), acc0);
    }
  }
  if (a.blocks % 2) {  // the last block alone: its pair's lanes 8-15 would read past the row
    const int64_t p = full;
    const __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(0xFFFFFFFFULL, q + 64 * p), flip);
    const __m512i i = _mm512_maskz_dpbusd_epi32(0xFF, _mm512_loadu_si512(init + p), u, _mm512_loadu_si512(xq + p));
    const float s = static_cast<float>(scale[2 * p]) * a.dx[2 * p];
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(s), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Rows [begin, end) of the one-token VNNI kernel (a function of its own: a lambda would not inherit
// the target attribute, and q8_0_row_vnni would not be inlined into it).
__attribute__((target("avx512vnni"))) void q8_0_rows_vnni(const int8_t* q, const at::Half* scale, int64_t ldq,
                                                          int64_t lds, const Q8Activations& a,
                                                          const tandem::Output& out, int64_t begin, int64_t end) {
  __m512i pair_idx[8];  // lanes 0-7 pick scale 2j (block a), lanes 8-15 scale 2j + 1 (block b)
  for (int j = 0; j < 8; ++j) pair_idx[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * j), 0xFF00, 2 * j + 1);
  for (int64_t row = begin; row < end; ++row) {
    const float acc = q8_0_row_vnni(q + row * ldq, scale + row * lds, a, pair_idx);
    out.store(&acc, 1, 1, row);
  }
}

void run_q8_0_one_token_vnni(const int8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                             int64_t N, int64_t K, const at::Tensor& bias, at::Tensor& y) {
  const Q8Activations a = quantize_activations(x.data_ptr<at::BFloat16>(), K);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // one row at a time, as for int8
    q8_0_rows_vnni(q, scale, ldq, lds, a, out, begin, end);
  });
}

// One token (decode at batch 1), one row: dot products straight from the int8 bytes in fp32, no
// bf16 buffer (a quarter of the instructions per weight of the buffered path, which is compute-bound
// there). x32 is x in fp32; two accumulators hide the FMA latency.
inline float int8_row_one_token(const int8_t* q, int64_t K, const float* x32) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    const __m512 w1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
    acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x32 + k), acc0);
    acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x32 + k + 16), acc1);
  }
  for (; k < K; k += 16) {
    const __mmask16 m = lane_mask(K - k);
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + k)));
    acc0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x32 + k), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void run_int8_one_token(const int8_t* q, const at::Tensor& x, int64_t N, int64_t K, const float* row_scale,
                        const at::Tensor& bias, at::Tensor& y) {
  std::vector<float> x32(K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t k = 0; k < K; ++k) x32[k] = static_cast<float>(xp[k]);
  const tandem::Output out = tandem::output(y, row_scale, bias);
  // NOTE: one row at a time: a single sequential stream per thread is what the hardware prefetcher
  // serves best (see dot_row in gemm_tile.h).
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float acc = int8_row_one_token(q + row * K, K, x32.data());
      out.store(&acc, 1, 1, row);
    }
  });
}

// One token, int4: no dequantization to q * d. Each nibble u = q + 8 becomes the bf16 value 128 + u
// by OR-ing the exponent of 128 (0x4300) above it (exact, u < 128), so vdpbf16ps gives
// T_g = sum_j x_j (128 + u_j) for group g, and sum_j x_j q_j = T_g - 136 X_g with X_g = sum_j x_j:
// y = sum_g d_g T_g - 136 sum_g d_g X_g. Groups go in pairs: 32 bytes widen to 32 16-bit lanes
// (group a's bytes, then group b's); low nibbles hold weights 0-15 of a and of b, high nibbles 16-31,
// so x is pre-permuted to match (xp: per pair [x_a 0-15, x_b 0-15], [x_a 16-31, x_b 16-31]); the dot
// lanes 0-7 then belong to a, 8-15 to b, scaled by [d_a x 8, d_b x 8], permuted out of 16 scales
// converted from fp16 per block of 8 pairs. About 10 instructions per 64 weights.
// q4_1 (scale holds (d, m) pairs): w = u d + m, so sum_j x_j w_j = d_g (T_g - 128 X_g) + m_g X_g and
// y = sum_g d_g T_g - 128 sum_g d_g X_g + sum_g m_g X_g.
template <bool Q41>
inline float int4_row_one_token(const uint8_t* q, const at::Half* scale, int64_t K, const uint16_t* xp,
                                const uint16_t* x, const float* xsum, const __m512i* pair_idx) {
  const int64_t groups = K / 32, pairs = groups / 2;
  const __m512i low4 = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
  __m512 acc = _mm512_setzero_ps(), corr = _mm512_setzero_ps(), corr_min = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {  // blocks of 16 groups = 8 pairs
    const __mmask16 gm = lane_mask(groups - g0);
    __m512 d16, m16;
    if (Q41)
      pairs_to_floats(scale + 2 * g0, groups - g0, &d16, &m16);
    else
      d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, scale + g0));
    const __m512 xs16 = _mm512_maskz_loadu_ps(gm, xsum + g0);
    corr = _mm512_fmadd_ps(d16, xs16, corr);
    if (Q41) corr_min = _mm512_fmadd_ps(m16, xs16, corr_min);
    const int64_t p_end = std::min<int64_t>(pairs, g0 / 2 + 8);
    for (int64_t p = g0 / 2; p < p_end; ++p) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p)));
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), magic);
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), magic);
      __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), tandem::load_bf16(xp + 64 * p), (__m512bh)lo);
      t = _mm512_dpbf16_ps(t, tandem::load_bf16(xp + 64 * p + 32), (__m512bh)hi);
      acc = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(pair_idx[p - g0 / 2], d16), acc);
    }
  }
  if (groups % 2) {  // the last group alone: lanes 16-31 of its widened bytes are zero
    const int64_t g = groups - 1;
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(0xFFFF, q + 16 * g));
    const __m512i lo = _mm512_maskz_or_epi32(0xFF, _mm512_and_si512(v, low4), magic);
    const __m512i hi = _mm512_maskz_or_epi32(0xFF, _mm512_srli_epi16(v, 4), magic);
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, x + 32 * g),
                                (__m512bh)lo);
    t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, x + 32 * g + 16), (__m512bh)hi);
    acc = _mm512_fmadd_ps(t, _mm512_set1_ps(static_cast<float>(scale[Q41 ? 2 * g : g])), acc);
  }
  // NOTE: one horizontal sum per row (each costs about as much as a pair of groups on short rows).
  if (Q41)
    return _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(-128.0f), corr, _mm512_add_ps(acc, corr_min)));
  return _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(-136.0f), corr, acc));
}

template <bool Q41>
void run_int4_one_token(const uint8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                        int64_t N, int64_t K, const at::Tensor& bias, at::Tensor& y) {
  const int64_t groups = K / 32, pairs = groups / 2;
  const auto* x16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  std::vector<float> xsum(groups);
  std::vector<uint16_t> xperm(64 * pairs);
  for (int64_t g = 0; g < groups; ++g) {
    float s = 0.0f;
    for (int64_t j = 0; j < 32; ++j) s += static_cast<float>(xb[32 * g + j]);
    xsum[g] = s;
  }
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t j = 0; j < 16; ++j) {
      xperm[64 * p + j] = x16[64 * p + j];            // a, weights 0-15
      xperm[64 * p + 16 + j] = x16[64 * p + 32 + j];  // b, weights 0-15
      xperm[64 * p + 32 + j] = x16[64 * p + 16 + j];  // a, weights 16-31
      xperm[64 * p + 48 + j] = x16[64 * p + 48 + j];  // b, weights 16-31
    }
  __m512i pair_idx[8];  // lanes 0-7 pick scale 2j (group a), lanes 8-15 scale 2j + 1 (group b)
  for (int j = 0; j < 8; ++j)
    pair_idx[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * j), 0xFF00, 2 * j + 1);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // one row at a time, as for int8
    for (int64_t row = begin; row < end; ++row) {
      const float acc =
          int4_row_one_token<Q41>(q + row * ldq, scale + row * lds, K, xperm.data(), x16, xsum.data(), pair_idx);
      out.store(&acc, 1, 1, row);
    }
  });
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
  const tandem::Output out = tandem::output(y, row_scale, bias);
  tandem::avx2::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf(kRowTile * kChunk);
    std::vector<float> acc(M * kRowTile), part(M * kRowTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kRowTile;
      tile<kRowTile>(rows, xp, M, K, row0, t + 1 < end ? row0 + kRowTile : -1, buf.data(), acc.data(),
                     part.data());
      out.store(acc.data(), kRowTile, M, row0);
    }
  });
  std::vector<uint16_t> buf(kChunk);
  std::vector<float> acc(M), part(M);
  for (int64_t row = tiles * kRowTile; row < N; ++row) {
    tile<1>(rows, xp, M, K, row, -1, buf.data(), acc.data(), part.data());
    out.store(acc.data(), 1, M, row);
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
  if (x.size(0) == 1) {
    run_int4_one_token<false>(qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K / 2, K / 32, x, N, K, b, y);
    return y;
  }
  run(Int4Rows{qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K}, x, N, K, nullptr, b, y);
  return y;
}

// The bf16 weight [N, K] of an int8 (qweight [N, K], scale fp32 [N]) or int4 (qweight [N, K / 2],
// scale fp16 [N, K / 32]) layer: bf16(q * scale), for large batches that use a dense GEMM.
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && scale.is_contiguous(), "dequantize: bad layout");
  const int64_t N = qweight.size(0);
  if (qweight.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "dequantize: int8 needs fp32 [N] scales");
    const int64_t K = qweight.size(1);
    auto w = at::empty({N, K}, qweight.options().dtype(at::kBFloat16));
    const int8_t* q = qweight.data_ptr<int8_t>();
    const float* s = scale.data_ptr<float>();
    at::BFloat16* out = w.data_ptr<at::BFloat16>();
    tandem::avx2::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        for (int64_t k = 0; k < K; k += 16) {
          const __mmask16 m = lane_mask(K - k);
          __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + n * K + k)));
          tandem::store16(out + n * K + k, _mm512_mul_ps(v, _mm512_set1_ps(s[n])), m);
        }
    });
    return w;
  }
  TORCH_CHECK(qweight.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf, "dequantize: int4 format");
  const int64_t K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0 && scale.numel() == N * (K / 32), "dequantize: int4 needs fp16 [N, K / 32] scales");
  auto w = at::empty({N, K}, qweight.options().dtype(at::kBFloat16));
  const Int4Rows rows{qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K};
  auto* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  tandem::avx2::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) rows(n, 0, K, out + n * K, -1);
  });
  return w;
}

namespace {

// The one-token q8_0 kernel quantizes the activations (run_q8_0_one_token_vnni) when the CPU has
// AVX512-VNNI, unless TANDEM_Q8_0_EXACT=1 (read on every call) asks for exact products in fp32.
bool q8_0_vnni() {
  static const bool has_vnni = __builtin_cpu_supports("avx512vnni");
  const char* exact = std::getenv("TANDEM_Q8_0_EXACT");
  return has_vnni && !(exact != nullptr && exact[0] == '1');
}

// q4_1 rows may be strided as q8_0's (QuantizedLinear: a row's (d, m) pairs, then its codes, one buffer).
int64_t check_q4_1(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.stride(1) == 1 &&
                  qweight.stride(0) >= qweight.size(1),
              "q4_1: qweight must be uint8 [N, K / 2] with contiguous rows");
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "q4_1: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  scale.size(2) == 2 && scale.stride(2) == 1 && scale.stride(1) == 2 && scale.stride(0) >= K / 16,
              "q4_1: scale must be fp16 [N, K / 32, 2] (d, m pairs) with contiguous rows");
  return K;
}

// q8_0 rows may be strided (row stride >= row length, elements contiguous): QuantizedLinear keeps each
// row's scales just before its codes in one buffer (codes and rows 64-byte aligned), so the weights are
// one sequential stream of about K * 34 / 32 bytes per row (like llama.cpp's 34-byte blocks); separate
// code and scale arrays are a second stream, which cost 15-20% on layers streamed from DRAM.
int64_t check_q8_0(const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.stride(1) == 1 &&
                  qweight.stride(0) >= qweight.size(1),
              "q8_0: qweight must be int8 [N, K] with contiguous rows");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "q8_0: K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  scale.stride(1) == 1 && scale.stride(0) >= K / 32,
              "q8_0: scale must be fp16 [N, K / 32] with contiguous rows");
  return K;
}

template <typename Rows>
at::Tensor dequantize_rows(const Rows& rows, const at::Tensor& qweight, int64_t K) {
  const int64_t N = qweight.size(0);
  auto w = at::empty({N, K}, qweight.options().dtype(at::kBFloat16));
  auto* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  tandem::avx2::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) rows(n, 0, K, out + n * K, -1);
  });
  return w;
}

}  // namespace

// x [M, K] bf16, qweight int8 [N, K], scale fp16 [N, K / 32], bias [N] bf16 or None -> y [M, N] bf16.
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const int64_t K = check_q8_0(qweight, scale), N = qweight.size(0), ldq = qweight.stride(0), lds = scale.stride(0);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_q8_0");
  if (x.size(0) == 1 && q8_0_vnni()) {
    run_q8_0_one_token_vnni(qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), ldq, lds, x, N, K, b, y);
    return y;
  }
  if (x.size(0) == 1) {
    run_q8_0_one_token(qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), ldq, lds, x, N, K, b, y);
    return y;
  }
  run(Q80Rows{qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), K, ldq, lds}, x, N, K, nullptr, b, y);
  return y;
}

// x [M, K] bf16, qweight uint8 [N, K / 2], scale fp16 [N, K / 32, 2] (d, m), bias [N] bf16 or None -> y [M, N].
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const int64_t K = check_q4_1(qweight, scale), N = qweight.size(0);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_q4_1");
  if (x.size(0) == 1) {
    run_int4_one_token<true>(qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), qweight.stride(0),
                             scale.stride(0), x, N, K, b, y);
    return y;
  }
  run(Int4Rows{qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, true, qweight.stride(0), scale.stride(0)},
      x, N, K, nullptr, b, y);
  return y;
}

// bf16(q * scale) [N, K] of a q8_0 layer (qweight int8 [N, K], scale fp16 [N, K / 32]).
at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale) {
  const int64_t K = check_q8_0(qweight, scale), ldq = qweight.stride(0), lds = scale.stride(0);
  return dequantize_rows(Q80Rows{qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), K, ldq, lds}, qweight, K);
}

// bf16(u * d + m) [N, K] of a q4_1 layer (qweight uint8 [N, K / 2], scale fp16 [N, K / 32, 2] (d, m)).
at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale) {
  const int64_t K = check_q4_1(qweight, scale);
  return dequantize_rows(
      Int4Rows{qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, true, qweight.stride(0), scale.stride(0)},
      qweight, K);
}
