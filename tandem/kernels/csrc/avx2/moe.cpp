// Fused mixture-of-experts feed-forward for bf16 experts (AVX2 + FMA): semantics in
// tandem/kernels/__init__.py (moe_bf16) and tandem/models/moe.py.
//
// Every (token, slot) pair is an "assignment" of the token to expert ids[t, j]. Assignments are
// grouped by expert (a counting sort), then passes 1 and 2 in one parallel region of the worker team
// (moe_common.h expert_region; an expert's pass 2 starts once its pass 1 is done), pass 3 after it:
//   1. for each selected expert and block of intermediate rows: gate and up rows are read once and
//      dotted with every token routed to that expert; act = bf16(silu(gate) * up);
//   2. for each selected expert and block of hidden rows: y = act . w2 rows (fp32);
//   3. for each token: out = bf16(sum_j weights[t, j] * y[t, j]) with j in top-k order.
// Experts that no token selected are never read. Each dot product accumulates in one fixed order
// (8-lane chunks alternating over two accumulators, then a fixed horizontal sum, then the tail), the
// same for every token count and grouping, so a token's output does not depend on the batch.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "moe_common.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tandem::avx2::bf16x8_to_ps;
using tandem::avx2::hsum8;
using tandem::avx2::moe::silu;
using bf16 = c10::BFloat16;

constexpr int64_t kRowBlock = 16;  // weight rows per work item
constexpr int64_t kTokens = 4;     // assignments sharing each weight load

inline __m256 load_w(const bf16* p) { return bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[i] = dot(w[0:n], a[i][0:n]) for i < count (<= kTokens); a are fp32 rows, w one bf16 row.
// The per-token order is the same whatever `count` is.
inline void dot_rows(const bf16* w, const float* const* a, int64_t count, int64_t n, float* out) {
  __m256 acc0[kTokens], acc1[kTokens];
  for (int64_t i = 0; i < kTokens; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 w0 = load_w(w + k), w1 = load_w(w + k + 8);
    for (int64_t i = 0; i < count; ++i) {
      acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[i] + k), acc0[i]);
      acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[i] + k + 8), acc1[i]);
    }
  }
  if (k + 8 <= n) {
    const __m256 w0 = load_w(w + k);
    for (int64_t i = 0; i < count; ++i) acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[i] + k), acc0[i]);
    k += 8;
  }
  for (int64_t i = 0; i < count; ++i) {
    float s = hsum8(_mm256_add_ps(acc0[i], acc1[i]));
    for (int64_t r = k; r < n; ++r) s += static_cast<float>(w[r]) * a[i][r];
    out[i] = s;
  }
}

// For one weight row and the assignments [first, last) of one expert (rows of `act` via `index`).
inline void dot_group(const bf16* w, const float* base, int64_t stride, const int64_t* index, int64_t count,
                      int64_t n, float* out, int64_t out_stride) {
  for (int64_t g = 0; g < count; g += kTokens) {
    const int64_t m = count - g < kTokens ? count - g : kTokens;
    const float* rows[kTokens];
    for (int64_t i = 0; i < m; ++i) rows[i] = base + index[g + i] * stride;
    float res[kTokens];
    dot_rows(w, rows, m, n, res);
    for (int64_t i = 0; i < m; ++i) out[(g + i) * out_stride] = res[i];
  }
}

void check(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
           const at::Tensor& ids) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "moe_bf16: x must be [T, H] bf16");
  TORCH_CHECK(w13.dim() == 3 && w13.scalar_type() == at::kBFloat16 && w13.is_contiguous(),
              "moe_bf16: w13 must be a contiguous [E, 2I, H] bf16 tensor");
  TORCH_CHECK(w2.dim() == 3 && w2.scalar_type() == at::kBFloat16 && w2.is_contiguous(),
              "moe_bf16: w2 must be a contiguous [E, H, I] bf16 tensor");
  const int64_t E = w13.size(0), H = w13.size(2), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && x.size(1) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "moe_bf16: shapes of x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ", w2.sizes(), " do not match");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_bf16: ids must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_bf16: weights must be [T, k] float32 like ids");
}

}  // namespace

at::Tensor moe_bf16(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor weights, at::Tensor ids) {
  check(x, w13, w2, weights, ids);
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  auto out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const auto ids_c = ids.contiguous();
  const auto wts = weights.contiguous();
  const tandem::avx2::moe::Routing routing = tandem::avx2::moe::group_by_expert(ids_c, E, "moe_bf16");
  const int64_t A = routing.A;
  const std::vector<int64_t>& start = routing.start;
  const std::vector<int64_t>& tok = routing.tok;

  // fp32 copies: tokens (widened once), activations of each sorted assignment, expert outputs.
  auto xf = x.to(at::kFloat).contiguous();
  auto act = at::empty({A, I}, x.options().dtype(at::kFloat));
  auto y = at::empty({A, H}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bf16* w13p = reinterpret_cast<const bf16*>(w13.data_ptr<at::BFloat16>());
  const bf16* w2p = reinterpret_cast<const bf16*>(w2.data_ptr<at::BFloat16>());

  // One region (moe_common.h expert_region). Gate/up items: act[s, r] = bf16(silu(x . gate_r) * (x . up_r))
  // for sorted assignment s and the item's block of intermediate rows r (kept in fp32); down items:
  // y[s, h] = act[s] . w2[e, h] for the hidden rows h of the item's block, once all of e's act is done.
  const auto gate_up = [&](int64_t e, int64_t block) {
    const int64_t r0 = block * kRowBlock, r1 = r0 + kRowBlock < I ? r0 + kRowBlock : I;
    const int64_t s0 = start[e], count = start[e + 1] - s0;
    thread_local std::vector<float> gate, up;
    gate.resize(kRowBlock * count);
    up.resize(kRowBlock * count);
    const int64_t* index = tok.data() + s0;
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* wg = w13p + (e * 2 * I + r) * H;
      const bf16* wu = w13p + (e * 2 * I + I + r) * H;
      dot_group(wg, xp, H, index, count, H, gate.data() + (r - r0), kRowBlock);
      dot_group(wu, xp, H, index, count, H, up.data() + (r - r0), kRowBlock);
    }
    for (int64_t i = 0; i < count; ++i)
      for (int64_t r = r0; r < r1; ++r) {
        const float g = gate[i * kRowBlock + (r - r0)], u = up[i * kRowBlock + (r - r0)];
        actp[(s0 + i) * I + r] = static_cast<float>(static_cast<bf16>(silu(g) * u));
      }
  };
  const auto down = [&](int64_t e, int64_t block) {
    const int64_t h0 = block * kRowBlock, h1 = h0 + kRowBlock < H ? h0 + kRowBlock : H;
    const int64_t s0 = start[e], count = start[e + 1] - s0;
    thread_local std::vector<int64_t> self;
    self.resize(count);
    for (int64_t i = 0; i < count; ++i) self[i] = s0 + i;
    for (int64_t h = h0; h < h1; ++h) dot_group(w2p + (e * H + h) * I, actp, I, self.data(), count, I, yp + s0 * H + h, H);
  };
  tandem::avx2::moe::expert_region(routing, (I + kRowBlock - 1) / kRowBlock, (H + kRowBlock - 1) / kRowBlock,
                                   gate_up, [](int64_t) {}, down);

  // Pass 3: out[t] = sum over slots j in top-k order of weights[t, j] * y[slot (t, j)].
  tandem::avx2::moe::combine(routing, yp, wts.data_ptr<float>(), H,
                             reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()));
  return out;
}
