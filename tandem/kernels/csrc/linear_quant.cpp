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
// Every format reads one row at a time straight from the quantized bytes (int8_row_tokens, int4_row_tokens,
// q8_0_row_vnni; q8_0 also quantizes the activations, as llama.cpp does, unless TANDEM_Q8_0_EXACT=1), for
// up to 4 tokens at once (the weights are loaded and decoded once for them). A token's value is computed by
// the same instructions in the same order whatever the number of tokens in the call (batch invariance,
// issue 11 item 5): several tokens cost about 1 + 0.6 (M - 1) one-token calls of compute, instead of a
// dequantized bf16 tile (the kernels before, whose reduction order differed from one token's).
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

using tandem::lane_mask;


constexpr int64_t kTokenBlock = 64;  // at most this many tokens per block (see for_token_tiles)

// The token kernels (batch invariance, issue 11 item 5): each computes, for 1 <= MB <= 4 tokens and one row,
// exactly what it computes for one token (the same instructions per token, in the same order), sharing the
// weight loads and their decoding between the tokens. A thread walks its rows for each block of tokens
// whose activations (token_bytes each, as the kernel reads them) fit in 32 KB of L1: re-reading them from
// L2 for every row measured 2-3x slower at 64 tokens of K = 4864. row_fn(row, m0, mb, acc) writes
// acc[0, mb) for tokens m0 .. m0 + mb - 1.
template <typename RowFn>
void for_token_tiles(int64_t M, int64_t N, int64_t token_bytes, const tandem::Output& out, const RowFn& row_fn) {
  if (M == 1) {  // decode at batch 1: rows of ~50 ns, so nothing but the row's kernel and its store
    tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        float acc;
        row_fn(row, 0, 1, &acc);
        out.store(&acc, 1, 1, row);
      }
    });
    return;
  }
  const int64_t block = std::max<int64_t>(4, std::min<int64_t>(kTokenBlock, (32768 / token_bytes) / 4 * 4));
  tandem::avx2::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float acc[kTokenBlock];
    for (int64_t b0 = 0; b0 < M; b0 += block) {
      const int64_t bm = std::min(block, M - b0);
      const tandem::Output block{out.y + b0 * out.N, out.N, out.scale, out.bias};
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t m = 0; m < bm; m += 4) row_fn(row, b0 + m, std::min<int64_t>(4, bm - m), acc + m);
        block.store(acc, 1, bm, row);
      }
    }
  });
}

// Calls f.template operator()<MB>() for MB = mb (1..4).
#define TANDEM_TOKENS_DISPATCH(mb, CALL) \
  switch (mb) {                          \
    case 4: CALL(4); break;              \
    case 3: CALL(3); break;              \
    case 2: CALL(2); break;              \
    default: CALL(1); break;             \
  }


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

// NOTE: named accumulators (acc0 / acc1 per token), not an array indexed by g & 1, which GCC keeps on the
// stack (2x slower). MB tokens, x32 [MB, K] fp32; per token the one-token computation.
template <int MB>
inline void q8_0_row_tokens(const int8_t* q, const at::Half* scale, int64_t K, const float* x32, float* out) {
  __m512 acc0[MB], acc1[MB];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  const int64_t groups = K / 32;
  alignas(64) float d[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    halves_to_floats(scale + g0, groups - g0, d);
    const int64_t g_end = std::min<int64_t>(groups, g0 + 16);
    int64_t g = g0;
    for (; g + 2 <= g_end; g += 2)
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) {
        acc0[m] = _mm512_fmadd_ps(q8_0_group(q + 32 * g, x32 + m * K + 32 * g), _mm512_set1_ps(d[g - g0]), acc0[m]);
        acc1[m] = _mm512_fmadd_ps(q8_0_group(q + 32 * g + 32, x32 + m * K + 32 * g + 32),
                                  _mm512_set1_ps(d[g + 1 - g0]), acc1[m]);
      }
    if (g < g_end)
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m)
        acc0[m] = _mm512_fmadd_ps(q8_0_group(q + 32 * g, x32 + m * K + 32 * g), _mm512_set1_ps(d[g - g0]), acc0[m]);
  }
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

void run_q8_0_exact(const int8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                    int64_t N, int64_t K, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0);
  std::vector<float> x32(M * K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xp[i]);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  for_token_tiles(M, N, 4 * K, out, [&](int64_t row, int64_t m0, int64_t mb, float* acc) {
#define TANDEM_Q8X_CALL(MB) q8_0_row_tokens<MB>(q + row * ldq, scale + row * lds, K, x32.data() + m0 * K, acc)
    TANDEM_TOKENS_DISPATCH(mb, TANDEM_Q8X_CALL)
#undef TANDEM_Q8X_CALL
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
// MB tokens (a[0, MB): their quantized activations), one row; per token the one-token computation.
template <int MB>
__attribute__((target("avx512vnni"))) inline void q8_0_row_vnni(const int8_t* q, const at::Half* scale,
                                                                const Q8Activations* a, const __m512i* pair_idx,
                                                                float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t blocks = a[0].blocks, full = blocks / 2;  // whole pairs
  const __m512i* xq[MB];
  const __m512i* init[MB];
  __m512 acc0[MB], acc1[MB];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) {
    xq[m] = reinterpret_cast<const __m512i*>(a[m].xq.data());
    init[m] = reinterpret_cast<const __m512i*>(a[m].init.data());
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  for (int64_t g0 = 0; g0 < blocks; g0 += 16) {  // 16 blocks = 8 pairs share one scale conversion
    const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(blocks - g0), scale + g0));
    __m512 s16[MB];
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) s16[m] = _mm512_mul_ps(d16, _mm512_loadu_ps(a[m].dx.data() + g0));
    const int64_t p0 = g0 / 2, p_end = std::min<int64_t>(full, p0 + 8);
    int64_t p = p0;
    for (; p + 2 <= p_end; p += 2) {
      const __m512i u0 = _mm512_xor_si512(load64(q + 64 * p), flip);
      const __m512i u1 = _mm512_xor_si512(load64(q + 64 * p + 64), flip);
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(init[m] + p), u0, _mm512_loadu_si512(xq[m] + p));
        const __m512i i1 =
            _mm512_dpbusd_epi32(_mm512_loadu_si512(init[m] + p + 1), u1, _mm512_loadu_si512(xq[m] + p + 1));
        acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(pair_idx[p - p0], s16[m]), acc0[m]);
        acc1[m] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(pair_idx[p + 1 - p0], s16[m]), acc1[m]);
      }
    }
    if (p < p_end) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * p), flip);
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m512i i = _mm512_dpbusd_epi32(_mm512_loadu_si512(init[m] + p), u, _mm512_loadu_si512(xq[m] + p));
        acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(pair_idx[p - p0], s16[m]), acc0[m]);
      }
    }
  }
  if (blocks % 2) {  // the last block alone: its pair's lanes 8-15 would read past the row
    const int64_t p = full;
    const __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(0xFFFFFFFFULL, q + 64 * p), flip);
    const float d = static_cast<float>(scale[2 * p]);
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512i i = _mm512_maskz_dpbusd_epi32(0xFF, _mm512_loadu_si512(init[m] + p), u, _mm512_loadu_si512(xq[m] + p));
      acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(d * a[m].dx[2 * p]), acc0[m]);
    }
  }
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

// One row, mb (1..4) tokens from a (a function of its own: a lambda would not inherit the target
// attribute, and q8_0_row_vnni would not be inlined into it).
__attribute__((target("avx512vnni"))) void q8_0_row_vnni_tokens(const int8_t* q, const at::Half* scale,
                                                                const Q8Activations* a, int64_t mb, float* out) {
  __m512i pair_idx[8];  // lanes 0-7 pick scale 2j (block a), lanes 8-15 scale 2j + 1 (block b)
  for (int j = 0; j < 8; ++j) pair_idx[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * j), 0xFF00, 2 * j + 1);
#define TANDEM_Q8_CALL(MB) q8_0_row_vnni<MB>(q, scale, a, pair_idx, out)
  TANDEM_TOKENS_DISPATCH(mb, TANDEM_Q8_CALL)
#undef TANDEM_Q8_CALL
}

// Any number of tokens, each with its activations quantized (quantize_activations) and reduced as one
// token alone is.
void run_q8_0_vnni(const int8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                   int64_t N, int64_t K, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0);
  std::vector<Q8Activations> a(M);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m) a[m] = quantize_activations(xp + m * K, K);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  for_token_tiles(M, N, 2 * K, out, [&](int64_t row, int64_t m0, int64_t mb, float* acc) {  // xq and init
    q8_0_row_vnni_tokens(q + row * ldq, scale + row * lds, a.data() + m0, mb, acc);
  });
}

// One token (decode at batch 1), one row: dot products straight from the int8 bytes in fp32, no
// bf16 buffer (a quarter of the instructions per weight of the buffered path, which is compute-bound
// there). x32 is x in fp32; two accumulators hide the FMA latency.
template <int MB>
inline void int8_row_tokens(const int8_t* q, int64_t K, const float* x32, float* out) {
  __m512 acc0[MB], acc1[MB];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    const __m512 w1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x32 + m * K + k), acc0[m]);
      acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x32 + m * K + k + 16), acc1[m]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = lane_mask(K - k);
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + k)));
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) acc0[m] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask, x32 + m * K + k), acc0[m]);
  }
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

// Any number of tokens, each computed as int8_row_tokens<1> computes one token (x widened to fp32).
void run_int8_tokens(const int8_t* q, const at::Tensor& x, int64_t N, int64_t K, const float* row_scale,
                     const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0);
  std::vector<float> x32(M * K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xp[i]);
  const tandem::Output out = tandem::output(y, row_scale, bias);
  // NOTE: one row at a time: a single sequential stream per thread is what the hardware prefetcher
  // serves best (see dot_row in gemm_tile.h).
  for_token_tiles(M, N, 4 * K, out, [&](int64_t row, int64_t m0, int64_t mb, float* acc) {
#define TANDEM_I8_CALL(MB) int8_row_tokens<MB>(q + row * K, K, x32.data() + m0 * K, acc)
    TANDEM_TOKENS_DISPATCH(mb, TANDEM_I8_CALL)
#undef TANDEM_I8_CALL
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
// Per-token inputs of the int4 / q4_1 token kernels, [M, ...] row-major, each token's as for one token.
struct Int4Tokens {
  int64_t groups, pairs;
  std::vector<float> xsum;      // [M, groups]: X_g
  std::vector<uint16_t> xperm;  // [M, 64 * pairs]: x permuted per pair
  const uint16_t* x;            // [M, K] bf16 bits
  int64_t K;
};

template <bool Q41, int MB>
inline void int4_row_tokens(const uint8_t* q, const at::Half* scale, const Int4Tokens& tk, int64_t m0,
                            const __m512i* pair_idx, float* out) {
  const int64_t groups = tk.groups, pairs = tk.pairs, lp = 64 * pairs, K = tk.K;
  const uint16_t* xp = tk.xperm.data() + m0 * lp;
  const uint16_t* x = tk.x + m0 * K;
  const float* xsum = tk.xsum.data() + m0 * groups;
  const __m512i low4 = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
  __m512 acc[MB], corr[MB], corr_min[MB];
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) acc[m] = corr[m] = corr_min[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {  // blocks of 16 groups = 8 pairs
    const __mmask16 gm = lane_mask(groups - g0);
    __m512 d16, m16;
    if (Q41)
      pairs_to_floats(scale + 2 * g0, groups - g0, &d16, &m16);
    else
      d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, scale + g0));
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      const __m512 xs16 = _mm512_maskz_loadu_ps(gm, xsum + m * groups + g0);
      corr[m] = _mm512_fmadd_ps(d16, xs16, corr[m]);
      if (Q41) corr_min[m] = _mm512_fmadd_ps(m16, xs16, corr_min[m]);
    }
    const int64_t p_end = std::min<int64_t>(pairs, g0 / 2 + 8);
    for (int64_t p = g0 / 2; p < p_end; ++p) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p)));
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), magic);
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), magic);
      const __m512 dp = _mm512_permutexvar_ps(pair_idx[p - g0 / 2], d16);
      TANDEM_UNROLL
      for (int m = 0; m < MB; ++m) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), tandem::load_bf16(xp + m * lp + 64 * p), (__m512bh)lo);
        t = _mm512_dpbf16_ps(t, tandem::load_bf16(xp + m * lp + 64 * p + 32), (__m512bh)hi);
        acc[m] = _mm512_fmadd_ps(t, dp, acc[m]);
      }
    }
  }
  if (groups % 2) {  // the last group alone: lanes 16-31 of its widened bytes are zero
    const int64_t g = groups - 1;
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(0xFFFF, q + 16 * g));
    const __m512i lo = _mm512_maskz_or_epi32(0xFF, _mm512_and_si512(v, low4), magic);
    const __m512i hi = _mm512_maskz_or_epi32(0xFF, _mm512_srli_epi16(v, 4), magic);
    const __m512 d = _mm512_set1_ps(static_cast<float>(scale[Q41 ? 2 * g : g]));
    TANDEM_UNROLL
    for (int m = 0; m < MB; ++m) {
      __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, x + m * K + 32 * g),
                                  (__m512bh)lo);
      t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, x + m * K + 32 * g + 16), (__m512bh)hi);
      acc[m] = _mm512_fmadd_ps(t, d, acc[m]);
    }
  }
  // NOTE: one horizontal sum per row (each costs about as much as a pair of groups on short rows).
  TANDEM_UNROLL
  for (int m = 0; m < MB; ++m) {
    if (Q41)
      out[m] = _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(-128.0f), corr[m], _mm512_add_ps(acc[m], corr_min[m])));
    else
      out[m] = _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(-136.0f), corr[m], acc[m]));
  }
}

template <bool Q41>
void run_int4_tokens(const uint8_t* q, const at::Half* scale, int64_t ldq, int64_t lds, const at::Tensor& x,
                     int64_t N, int64_t K, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), groups = K / 32, pairs = groups / 2;
  Int4Tokens tk{groups, pairs, std::vector<float>(M * groups), std::vector<uint16_t>(M * 64 * pairs),
                reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), K};
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < M; ++t) {
    const uint16_t* x16 = tk.x + t * K;
    uint16_t* xperm = tk.xperm.data() + t * 64 * pairs;
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t j = 0; j < 32; ++j) s += static_cast<float>(xb[t * K + 32 * g + j]);
      tk.xsum[t * groups + g] = s;
    }
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < 16; ++j) {
        xperm[64 * p + j] = x16[64 * p + j];            // a, weights 0-15
        xperm[64 * p + 16 + j] = x16[64 * p + 32 + j];  // b, weights 0-15
        xperm[64 * p + 32 + j] = x16[64 * p + 16 + j];  // a, weights 16-31
        xperm[64 * p + 48 + j] = x16[64 * p + 48 + j];  // b, weights 16-31
      }
  }
  __m512i pair_idx[8];  // lanes 0-7 pick scale 2j (group a), lanes 8-15 scale 2j + 1 (group b)
  for (int j = 0; j < 8; ++j)
    pair_idx[j] = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * j), 0xFF00, 2 * j + 1);
  const tandem::Output out = tandem::output(y, nullptr, bias);
  for_token_tiles(M, N, 2 * K, out, [&](int64_t row, int64_t m0, int64_t mb, float* acc) {  // xperm
#define TANDEM_I4_CALL(MB) int4_row_tokens<Q41, MB>(q + row * ldq, scale + row * lds, tk, m0, pair_idx, acc)
    TANDEM_TOKENS_DISPATCH(mb, TANDEM_I4_CALL)
#undef TANDEM_I4_CALL
  });
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
  run_int8_tokens(qweight.data_ptr<int8_t>(), x, N, K, scale.data_ptr<float>(), b, y);
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
  run_int4_tokens<false>(qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K / 2, K / 32, x, N, K, b, y);
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
  if (q8_0_vnni())
    run_q8_0_vnni(qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), ldq, lds, x, N, K, b, y);
  else
    run_q8_0_exact(qweight.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), ldq, lds, x, N, K, b, y);
  return y;
}

// x [M, K] bf16, qweight uint8 [N, K / 2], scale fp16 [N, K / 32, 2] (d, m), bias [N] bf16 or None -> y [M, N].
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias) {
  const int64_t K = check_q4_1(qweight, scale), N = qweight.size(0);
  at::Tensor b;
  at::Tensor y = tandem::prepare_linear(x, N, K, bias, b, "linear_q4_1");
  run_int4_tokens<true>(qweight.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), qweight.stride(0), scale.stride(0), x,
                        N, K, b, y);
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
