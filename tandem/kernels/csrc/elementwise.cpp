// Fused elementwise layers (one call instead of 5-12 PyTorch ops each): RMSNorm, rotary embedding
// (rotate-half layout) and SiLU-and-mul. Each reproduces the roundings of the PyTorch code it
// replaces (tandem/models/layers.py): in bf16 every intermediate PyTorch op rounds to bf16, so the
// kernels round at the same points (round_bf16) and otherwise compute in fp32.
#include <ATen/Parallel.h>

#include "avx2/parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <type_traits>

#include "vec.h"

namespace {

using tandem::exp16;
using tandem::lane_mask;
using tandem::load16;
using tandem::store16;

// The fp32 value of v rounded to bf16 when T is bf16 (identity for fp32): models one PyTorch op
// whose bf16 output feeds the next op.
template <typename T>
inline __m512 round_t(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  tandem::avx2::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        __m512 v = load16(xr + d, lane_mask(dim - d));
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 m = lane_mask(dim - d);
        __m512 h = round_t<T>(_mm512_mul_ps(load16(xr + d, m), _mm512_set1_ps(inv)));
        store16(y + r * dim + d, _mm512_mul_ps(load16(w + d, m), h), m);
      }
    }
  });
}

// residual = round(residual + x), then x = weight * round(residual * rsqrt(mean(residual^2) + eps)), in
// place: the "x + attn(...)" of a pre-norm block followed by the next RMSNorm (vLLM's fused_add_rms_norm).
template <typename T>
void add_rms_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t dim, float eps) {
  tandem::avx2::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* rr = res + r * dim;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 m = lane_mask(dim - d);
        __m512 v = round_t<T>(_mm512_add_ps(load16(rr + d, m), load16(xr + d, m)));
        store16(rr + d, v, m);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 m = lane_mask(dim - d);
        __m512 h = round_t<T>(_mm512_mul_ps(load16(rr + d, m), _mm512_set1_ps(inv)));
        store16(xr + d, _mm512_mul_ps(load16(w + d, m), h), m);
      }
    }
  });
}

// y may alias x (in place): each 16-lane step loads both halves before it stores either.
template <typename T>
void rotary_rows(const T* x, int64_t tokens, int64_t heads, int64_t tok_stride, const T* cos, const T* sin,
                 T* y, int64_t y_tok_stride, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * D;
    const T* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * tok_stride + h * D;
      T* yr = y + t * y_tok_stride + h * D;
      for (int64_t d = 0; d < half; d += 16) {
        const __mmask16 m = lane_mask(half - d);
        __m512 x1 = load16(xr + d, m), x2 = load16(xr + half + d, m);
        // out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin; each product rounds, then the sum.
        __m512 a = round_t<T>(_mm512_mul_ps(x1, load16(c + d, m)));
        __m512 b = round_t<T>(_mm512_mul_ps(x2, load16(s + d, m)));
        store16(yr + d, _mm512_sub_ps(a, b), m);
        a = round_t<T>(_mm512_mul_ps(x2, load16(c + half + d, m)));
        b = round_t<T>(_mm512_mul_ps(x1, load16(s + half + d, m)));
        store16(yr + half + d, _mm512_add_ps(a, b), m);
      }
    }
  }
}

template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t d) {
  tandem::avx2::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = lane_mask(d - i);
        __m512 g = load16(x + r * 2 * d + i, m), u = load16(x + r * 2 * d + d + i, m);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = round_t<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store16(y + r * d + i, _mm512_mul_ps(silu, u), m);
      }
    }
  });
}

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": all tensors must have the same dtype (bf16 or fp32)");
}

}  // namespace

// x [R, dim], weight [dim] -> weight * bf16(x * rsqrt(mean(x^2) + eps)) (transformers' LlamaRMSNorm).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [R, dim], w [dim]");
  check_dtype(weight, x.scalar_type(), "rms_norm");
  x = x.contiguous();
  auto w = weight.contiguous();
  auto y = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                  x.size(0), x.size(1), static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  return y;
}

// x [T, H, D] (heads contiguous, any token stride), cos/sin [T, D] -> new contiguous [T, H, D].
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x [T, H, D], heads contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: head_dim must be even");
  cos = cos.reshape({x.size(0), x.size(2)}).contiguous();
  sin = sin.reshape({x.size(0), x.size(2)}).contiguous();
  check_dtype(cos, x.scalar_type(), "rotary");
  check_dtype(sin, x.scalar_type(), "rotary");
  auto y = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rotary_rows(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), x.stride(0), cos.data_ptr<c10::BFloat16>(),
                sin.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), y.stride(0), x.size(2));
  else
    rotary_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), cos.data_ptr<float>(),
                sin.data_ptr<float>(), y.data_ptr<float>(), y.stride(0), x.size(2));
  return y;
}

// In-place rotary of x [T, H, D] (heads contiguous, any token stride): one call rotates q and k
// when x views the q and k columns of the fused qkv output.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x [T, H, D], heads contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_: head_dim must be even");
  cos = cos.reshape({x.size(0), x.size(2)}).contiguous();
  sin = sin.reshape({x.size(0), x.size(2)}).contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rotary_: bf16 or fp32 only");
  check_dtype(cos, x.scalar_type(), "rotary_");
  check_dtype(sin, x.scalar_type(), "rotary_");
  if (x.scalar_type() == at::kBFloat16) {
    auto* p = x.data_ptr<c10::BFloat16>();
    rotary_rows(p, x.size(0), x.size(1), x.stride(0), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                p, x.stride(0), x.size(2));
  } else {
    auto* p = x.data_ptr<float>();
    rotary_rows(p, x.size(0), x.size(1), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), p, x.stride(0),
                x.size(2));
  }
}

// In place: residual += x (rounded to the dtype), then x = rms_norm(residual) * weight; both [R, dim]
// contiguous. Same roundings as "residual + x" followed by rms_norm (transformers' decoder layer).
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "fused_add_rms_norm: x, residual [R, dim], w [dim]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm: tensors must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "fused_add_rms_norm: bf16 or fp32 only");
  check_dtype(residual, x.scalar_type(), "fused_add_rms_norm");
  check_dtype(weight, x.scalar_type(), "fused_add_rms_norm");
  if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                      x.size(0), x.size(1), static_cast<float>(eps));
  else
    add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                      static_cast<float>(eps));
}

// x [R, 2d] (gate first) -> silu(gate) * up [R, d].
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [R, 2d]");
  x = x.contiguous();
  const int64_t d = x.size(1) / 2;
  auto y = at::empty({x.size(0), d}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), x.size(0), d);
  else if (x.scalar_type() == at::kFloat)
    silu_mul_rows(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), d);
  else
    TORCH_CHECK(false, "silu_and_mul: bf16 or fp32 only");
  return y;
}
