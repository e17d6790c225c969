// AVX2 + FMA + F16C helpers shared by the avx2 kernels: 8-lane fp32 loads/stores of bf16, fp16 or
// fp32 data (full and partial), round-to-nearest-even bf16 stores, horizontal sums, exp.
// The avx2 variant is compiled with -mavx2 -mfma -mf16c only, so it runs on every x86-64 server
// since Haswell / Zen 1 (and on AVX-512 CPUs too).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tandem::avx2 {

// The lane mask of _mm256_maskload_ps / _mm256_maskstore_ps for the first n (<= 8) lanes.
inline __m256i lane_mask8(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)), idx);
}

// 8 bf16 -> 8 fp32, exact (the 16 bits become the high half of the fp32 word).
inline __m256 bf16x8_to_ps(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The first n (0..8) elements; lanes past n are 0. Never reads past p + n.
inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask8(n));
}
inline __m256 load8(const c10::BFloat16* p, int64_t n) {
  if (n >= 8) return load8(p);
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (n > 0) std::memcpy(tmp, p, n * sizeof(uint16_t));
  return bf16x8_to_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

// fp32 -> bf16 bits in the low 16 bits of each 32-bit lane: round to nearest even, NaN -> 0x7FC0
// (c10::BFloat16's own rule, c10/util/BFloat16.h round_to_nearest_even).
inline __m256i ps_to_bf16_bits32(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 fp32 -> 8 bf16 (16 bytes), rounding as above.
inline __m128i ps_to_bf16x8(__m256 v) {
  const __m256i r = ps_to_bf16_bits32(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 16 fp32 (lo, hi) -> 16 bf16 (32 bytes) in order.
inline __m256i ps_to_bf16x16(__m256 lo, __m256 hi) {
  const __m256i p = _mm256_packus_epi32(ps_to_bf16_bits32(lo), ps_to_bf16_bits32(hi));  // per 128-bit lane
  return _mm256_permute4x64_epi64(p, 0xD8);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ps_to_bf16x8(v)); }

// The first n (0..8) lanes of v; writes nothing past p + n.
inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lane_mask8(n), v);
}
inline void store8(c10::BFloat16* p, __m256 v, int64_t n) {
  if (n >= 8) return store8(p, v);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), ps_to_bf16x8(v));
  if (n > 0) std::memcpy(p, tmp, n * sizeof(uint16_t));
}

// The sum of the 8 lanes, in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sum of the 8 int32 lanes.
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// e^x for 8 lanes: the Cephes expf scheme of the AVX-512 exp16 (x = n ln2 + r, degree-6 polynomial
// in r, scale by 2^n built in the exponent bits). Relative error < 2e-7 over [-87, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n for n in [-127, 128): (n + 127) << 23; x >= -87 keeps n >= -126, x <= 88 keeps n <= 127.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace tandem::avx2
