// Shared steps of the fused MoE kernels (moe.cpp: bf16 experts; moe_quant.cpp: int8 / int4 experts):
// grouping a step's (token, slot) assignments by expert, and the final weighted sum per token.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

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

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

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
