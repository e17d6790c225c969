// Shared steps of the fused MoE kernels (moe.cpp: bf16 experts; moe_quant.cpp: int8 / int4 / q8_0 experts;
// moe_kquant.cpp: Q4_K / Q6_K experts): grouping a step's (token, slot) assignments by expert, the one
// parallel region that runs every selected expert's gate/up and down rows (expert_region), and the final
// weighted sum per token.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <sched.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
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

// act[0:I] = bf16(silu(gate) * up) of one assignment's gu[0:2I] fp32 (gate columns, then up).
inline void swiglu_row(const float* gu, int64_t I, c10::BFloat16* act) {
  for (int64_t i = 0; i < I; ++i) act[i] = c10::BFloat16(silu(gu[i]) * gu[I + i]);
}

// Every selected expert's feed-forward in ONE parallel region of the worker team (parallel.h), not one per
// projection: the work items are (expert, gate/up row tile) for every active expert, then (expert, down row
// tile), expert by expert, split over the team in claim order. gate_up(e, tile) writes expert e's gate/up
// rows of the tile for all its assignments; the item that completes expert e's last gate/up tile runs
// act(e) (the activation of e's assignments, and whatever quantization down needs); a down item
// down(e, tile) first waits for expert e's act, not for the whole gate/up phase. Items are claimed in
// increasing order, so a waited-on expert's gate/up items are all held by running threads: no deadlock,
// and on one thread (or inline) the order is simply every gate/up item, then every down item.
// BIT-IDENTICAL FOR ANY THREAD COUNT: each output value is computed by exactly one call whose arithmetic
// does not depend on which thread runs it or on the items around it.
template <class GateUp, class Act, class Down>
void expert_region(const Routing& r, int64_t tiles13, int64_t tiles2, const GateUp& gate_up, const Act& act,
                   const Down& down) {
  const int64_t n_active = static_cast<int64_t>(r.active.size()), items13 = n_active * tiles13;
  if (n_active == 0) return;
  // NOTE: per active expert, in the order of r.active: gate/up tiles left to finish, then act done.
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[n_active]);
  std::unique_ptr<std::atomic<bool>[]> ready(new std::atomic<bool>[n_active]);
  for (int64_t i = 0; i < n_active; ++i) {
    left[i].store(tiles13, std::memory_order_relaxed);
    ready[i].store(false, std::memory_order_relaxed);
  }
  // NOTE: an exception is kept, not thrown through the team, so that every counter still reaches 0 and no
  // down item waits forever; the first one is rethrown once the region is over.
  std::mutex error_mu;
  std::exception_ptr error;
  const auto guarded = [&](const auto& fn) {
    try {
      fn();
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
    }
  };
  tandem::avx2::parallel_for(0, items13 + n_active * tiles2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      if (item < items13) {
        const int64_t i = item / tiles13;
        guarded([&] { gate_up(r.active[i], item % tiles13); });
        if (left[i].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          guarded([&] { act(r.active[i]); });
          ready[i].store(true, std::memory_order_release);
        }
        continue;
      }
      const int64_t i = (item - items13) / tiles2;
      for (int spins = 0; !ready[i].load(std::memory_order_acquire); ++spins) {
        if (spins < 4096) _mm_pause();
        else sched_yield();  // NOTE: the thread finishing this expert's gate/up may need this core
      }
      guarded([&] { down(r.active[i], (item - items13) % tiles2); });
    }
  });
  if (error) std::rethrow_exception(error);
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
