// Shared steps of the fused MoE kernels (moe.cpp: bf16 experts; moe_quant.cpp: int8 / int4 experts):
// grouping a step's (token, slot) assignments by expert, and the final weighted sum per token.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace tandem::avx2::moe {

// Assignment a = t * K + j sends token t to expert ids[t, j]. After a counting sort by expert,
// sorted positions start[e] .. start[e + 1] are expert e's assignments in ascending a; order[s] is the
// assignment at sorted position s, tok[s] its token, sorted_pos its inverse; active lists the experts
// with at least one assignment, ascending.
struct Routing {
  int64_t T = 0, K = 0, A = 0;
  std::vector<int64_t> start, order, tok, sorted_pos, active;
};

inline Routing group_by_expert(const at::Tensor& ids_c, int64_t E, const char* op) {
  Routing r;
  r.T = ids_c.size(0);
  r.K = ids_c.size(1);
  r.A = r.T * r.K;
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t a = 0; a < r.A; ++a) TORCH_CHECK(id[a] >= 0 && id[a] < E, op, ": expert id ", id[a], " out of range");
  r.start.assign(E + 1, 0);
  r.order.resize(r.A);
  r.tok.resize(r.A);
  r.sorted_pos.resize(r.A);
  for (int64_t a = 0; a < r.A; ++a) ++r.start[id[a] + 1];
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t a = 0; a < r.A; ++a) r.order[fill[id[a]]++] = a;
  for (int64_t s = 0; s < r.A; ++s) {
    r.tok[s] = r.order[s] / r.K;
    r.sorted_pos[r.order[s]] = s;
  }
  for (int64_t e = 0; e < E; ++e)
    if (r.start[e + 1] > r.start[e]) r.active.push_back(e);
  return r;
}

// y[s, n] fp32 = acc * scale[n] (scale: an int8 expert's row scales, or none), rows of ld floats.
struct RowsOut {
  float* y;
  int64_t ld;
  const float* scale;

  __attribute__((noinline)) void store(const float* acc, int64_t rows, int64_t tokens, int64_t m0,
                                       int64_t row0) const {
    for (int64_t m = 0; m < tokens; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        __m128 v = _mm_set_ss(acc[m * rows + r]);
        if (scale != nullptr) v = _mm_mul_ss(v, _mm_set_ss(scale[row0 + r]));
        y[(m0 + m) * ld + row0 + r] = _mm_cvtss_f32(v);
      }
  }
};

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// The checks every fused MoE kernel makes of x [T, H] bf16, ids [T, k] int64 and weights [T, k] fp32.
inline void check_inputs(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [T, H] bf16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, op,
              ": ids must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, op,
              ": weights must be [T, k] float32 like ids");
}

// The check that per-expert w13 [n13, k13] and w2 [n2, k2] fit x [T, H]: k13 == H, n13 == 2 k2, n2 == H.
inline void check_shapes(const at::Tensor& x, int64_t n13, int64_t k13, int64_t n2, int64_t k2, const char* op) {
  TORCH_CHECK(k13 == x.size(1) && n13 == 2 * k2 && n2 == x.size(1), op, ": shapes of x ", x.sizes(), ", w13 [", n13,
              ", ", k13, "] and w2 [", n2, ", ", k2, "] per expert do not match");
}

// The rows of x [T, H] in sorted assignment order: [A, H] bf16 (row s is token r.tok[s]).
inline at::Tensor sorted_rows(const at::Tensor& x, const Routing& r) {
  const auto index = at::from_blob(const_cast<int64_t*>(r.tok.data()), {r.A}, x.options().dtype(at::kLong));
  return x.contiguous().index_select(0, index);
}

// act[s] = bf16(silu(gate) * up) of gu [A, 2I] fp32 (gate columns, then up): [A, I] bf16, one parallel loop.
inline at::Tensor swiglu_rows(const at::Tensor& gu, int64_t I) {
  const int64_t A = gu.size(0);
  auto act = at::empty({A, I}, gu.options().dtype(at::kBFloat16));
  c10::BFloat16* actp = reinterpret_cast<c10::BFloat16*>(act.data_ptr<at::BFloat16>());
  const float* gup = gu.data_ptr<float>();
  tandem::avx2::parallel_for(0, A, 8, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t i = 0; i < I; ++i) actp[s * I + i] = c10::BFloat16(silu(gup[s * 2 * I + i]) * gup[s * 2 * I + I + i]);
  });
  return act;
}

// out[t] = bf16(sum over slots j in top-k order of weights[t, j] * y[sorted position of (t, j)]),
// y [A, H] fp32 in sorted order, weights [T, K] fp32 contiguous; one parallel loop over tokens.
inline void combine(const Routing& r, const float* y, const float* weights, int64_t H, c10::BFloat16* out) {
  const int64_t K = r.K;
  tandem::avx2::parallel_for(0, r.T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < K; ++j) {
        const float w = weights[t * K + j];
        const float* row = y + r.sorted_pos[t * K + j] * H;
        if (j == 0)
          for (int64_t h = 0; h < H; ++h) acc[h] = w * row[h];
        else
          for (int64_t h = 0; h < H; ++h) acc[h] += w * row[h];
      }
      for (int64_t h = 0; h < H; ++h) out[t * H + h] = static_cast<c10::BFloat16>(acc[h]);
    }
  });
}

}  // namespace tandem::avx2::moe
