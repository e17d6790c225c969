// AVX2 + FMA fused elementwise layers: RMSNorm (and its fused residual add), rotate-half rotary
// embedding, SiLU-and-mul. 8-lane ports of csrc/elementwise.cpp with the same semantics: each
// reproduces the roundings of the PyTorch code it replaces (tandem/models/layers.py). In bf16 every
// intermediate PyTorch op rounds to bf16, so the kernels round at the same points (round_t) and
// otherwise compute in fp32. Every output row is computed by one thread from its own input row, so
// results do not depend on the number of rows (batch invariance).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <type_traits>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tandem::avx2::exp8;
using tandem::avx2::hsum8;
using tandem::avx2::load8;
using tandem::avx2::parallel_for;
using tandem::avx2::store8;

// The fp32 value of v rounded to bf16 when T is bf16 (identity for fp32): models one PyTorch op
// whose bf16 output feeds the next op. Round to nearest even; NaN kept as is.
template <typename T>
inline __m256 round_t(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
}

// 1 / sqrt(mean(x^2) + eps) of one row; x^2 summed in 8 lanes, then hsum8 (a fixed order).
template <typename T>
inline float inv_rms(const T* x, int64_t dim, float eps) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 v = load8(x + d, dim - d);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  return 1.0f / std::sqrt(hsum8(ss) / static_cast<float>(dim) + eps);
}

// y = w * round(x * inv): transformers' LlamaRMSNorm casts to the input dtype before the weight.
template <typename T>
inline void scale_row(const T* x, const T* w, T* y, int64_t dim, float inv) {
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < dim; d += 8) {
    const int64_t n = dim - d;
    const __m256 h = round_t<T>(_mm256_mul_ps(load8(x + d, n), s));
    store8(y + d, _mm256_mul_ps(load8(w + d, n), h), n);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) scale_row(x + r * dim, w, y + r * dim, dim, inv_rms(x + r * dim, dim, eps));
  });
}

// residual = round(residual + x), then x = w * round(residual * rsqrt(mean(residual^2) + eps)), in
// place: the "x + attn(...)" of a pre-norm block followed by the next RMSNorm (vLLM's fused_add_rms_norm).
template <typename T>
void add_rms_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t dim, float eps) {
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* rr = res + r * dim;
      for (int64_t d = 0; d < dim; d += 8) {
        const int64_t n = dim - d;
        store8(rr + d, round_t<T>(_mm256_add_ps(load8(rr + d, n), load8(xr + d, n))), n);
      }
      scale_row(rr, w, xr, dim, inv_rms(rr, dim, eps));
    }
  });
}

// y may alias x (in place): each 8-lane step loads both halves before it stores either.
template <typename T>
void rotary_rows(const T* x, int64_t tokens, int64_t heads, int64_t tok_stride, const T* cos, const T* sin, T* y,
                 int64_t y_tok_stride, int64_t D) {
  const int64_t half = D / 2;
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * tok_stride + h * D;
        T* yr = y + t * y_tok_stride + h * D;
        for (int64_t d = 0; d < half; d += 8) {
          const int64_t n = half - d;
          const __m256 x1 = load8(xr + d, n), x2 = load8(xr + half + d, n);
          // out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin; each product rounds, then the sum
          // (x * cos + rotate_half(x) * sin: rotate_half's negation is exact).
          __m256 a = round_t<T>(_mm256_mul_ps(x1, load8(c + d, n)));
          __m256 b = round_t<T>(_mm256_mul_ps(x2, load8(s + d, n)));
          store8(yr + d, _mm256_sub_ps(a, b), n);
          a = round_t<T>(_mm256_mul_ps(x2, load8(c + half + d, n)));
          b = round_t<T>(_mm256_mul_ps(x1, load8(s + half + d, n)));
          store8(yr + half + d, _mm256_add_ps(a, b), n);
        }
      }
    }
  });
}

// round(silu(g)) * u with silu(g) = g / (1 + e^-g), as F.silu(gate) * up.
template <typename T>
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(round_t<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e))), u);
}

template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t d) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * d;
      const T* up = gate + d;
      T* yr = y + r * d;
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) {  // two independent 8-lane chains per step (exp and div latency)
        const __m256 a = silu_mul8<T>(load8(gate + i), load8(up + i));
        const __m256 b = silu_mul8<T>(load8(gate + i + 8), load8(up + i + 8));
        store8(yr + i, a);
        store8(yr + i + 8, b);
      }
      for (; i < d; i += 8) store8(yr + i, silu_mul8<T>(load8(gate + i, d - i), load8(up + i, d - i)), d - i);
    }
  });
}

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": all tensors must have the same dtype (bf16 or fp32)");
}

void check_float(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, op, ": bf16 or fp32 only");
}

// Rotates x [T, H, D] (heads contiguous, any token stride) into y (may be x), cos/sin [T, 1, D].
void rotary_into(const at::Tensor& x, at::Tensor cos, at::Tensor sin, at::Tensor& y, const char* op) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), op, ": x [T, H, D], heads contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, op, ": head_dim must be even");
  check_float(x, op);
  cos = cos.reshape({x.size(0), x.size(2)}).contiguous();
  sin = sin.reshape({x.size(0), x.size(2)}).contiguous();
  check_dtype(cos, x.scalar_type(), op);
  check_dtype(sin, x.scalar_type(), op);
  if (x.scalar_type() == at::kBFloat16)
    rotary_rows(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), x.stride(0), cos.data_ptr<c10::BFloat16>(),
                sin.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), y.stride(0), x.size(2));
  else
    rotary_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                y.data_ptr<float>(), y.stride(0), x.size(2));
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [R, dim], w [dim]");
  check_float(x, "rms_norm");
  check_dtype(weight, x.scalar_type(), "rms_norm");
  x = x.contiguous();
  auto w = weight.contiguous();
  auto y = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), x.size(0),
                  x.size(1), static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  return y;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "fused_add_rms_norm: x, residual [R, dim], w [dim]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm: tensors must be contiguous");
  check_float(x, "fused_add_rms_norm");
  check_dtype(residual, x.scalar_type(), "fused_add_rms_norm");
  check_dtype(weight, x.scalar_type(), "fused_add_rms_norm");
  if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  else
    add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                      static_cast<float>(eps));
}

at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3, "rotary: x [T, H, D], heads contiguous");
  auto y = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  rotary_into(x, cos, sin, y, "rotary");
  return y;
}

void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) { rotary_into(x, cos, sin, x, "rotary_"); }

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [R, 2d]");
  check_float(x, "silu_and_mul");
  x = x.contiguous();
  const int64_t d = x.size(1) / 2;
  auto y = at::empty({x.size(0), d}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), x.size(0), d);
  else
    silu_mul_rows(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), d);
  return y;
}
