// Fused mixture-of-experts feed-forward for weight-only int8 / int4 / q8_0 experts (AVX2 + FMA + F16C):
// semantics in tandem/kernels/__init__.py (moe_int8, moe_int4, moe_q8_0) and tandem/models/moe_quant.py.
// int4 is llama.cpp's Q4_0 and q8_0 its Q8_0 (group-32 int8, fp16 scales), so a GGUF's experts run as stored.
//
// The quantized linears' arithmetic (linear_quant.cpp, quant_tile.h) on assignments grouped by expert
// (moe_common.h), all in one parallel region (moe_common.h expert_region):
//   1. the routed tokens' rows in sorted order, quantized to int8 per block of 32 (llama.cpp's q8_0
//      activations); for each selected expert and tile of 4 gate/up rows, the tile's codes are read once
//      for all the expert's assignments: gu[s] fp32 (int8: times the row's scale);
//   2. once an expert's gate/up tiles are done: act[s] = bf16(silu(gate) * up), quantized the same way;
//      then for each of its tiles of 4 hidden rows: y[s] = act[s] . w2 rows (fp32);
//   3. out[t] = bf16(sum_j weights[t, j] * y[t, j]), j in top-k order (after the region).
// Experts no token selected are never read.
// BATCH INVARIANCE: a (assignment, row) value is one quant_tile.h tile computation, whose bits do not depend
// on the tile it falls in, and a token's activations are quantized alone, so a token's output does not
// depend on the rest of the batch or the grouping.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "gemm.h"
#include "moe_common.h"
#include "ops.h"
#include "quant_blocks.h"
#include "quant_tile.h"

namespace {

using namespace tandem::avx2::quant;
using tandem::avx2::QuantizedActivations;
using tandem::avx2::moe::Routing;
using tandem::avx2::moe::RowsOut;

constexpr int kRB = 4;  // weight rows per tile (as linear_quant.cpp)
constexpr int kMB = 2;  // assignments per tile

// One [E, N, K] expert stack: codes and (int4) fp16 group scales or (int8) fp32 row scales.
struct Experts {
  Kind kind;
  const uint8_t* q;
  const void* scale;
  int64_t N, K;

  Weights of(int64_t e) const {
    if (kind == Kind::kInt8)
      return {kind, q + e * N * K, nullptr, K, (K + 31) / 32, K, 0};
    const c10::Half* s = static_cast<const c10::Half*>(scale) + e * N * (K / 32);
    const int64_t ldq = kind == Kind::kQ8_0 ? K : K / 2;  // q8_0: int8 codes; int4: nibbles
    return {kind, q + e * N * ldq, s, K, K / 32, ldq, K / 32};
  }
  const float* row_scale(int64_t e) const {
    return kind == Kind::kInt8 ? static_cast<const float*>(scale) + e * N : nullptr;
  }
};

Experts experts(const at::Tensor& q, const at::Tensor& s, Kind kind, const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && s.is_contiguous(), name, ": codes and scales must be contiguous");
  const int64_t E = q.size(0), N = q.size(1);
  if (kind == Kind::kInt8) {
    TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat && s.dim() == 2 && s.size(0) == E &&
                    s.size(1) == N,
                name, ": int8 experts need int8 codes [E, N, K] and fp32 scales [E, N]");
    return {kind, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), s.data_ptr<float>(), N, q.size(2)};
  }
  if (kind == Kind::kQ8_0) {
    const int64_t K = q.size(2);
    TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kHalf && s.dim() == 3 && s.size(0) == E &&
                    s.size(1) == N && K % 32 == 0 && s.size(2) == K / 32,
                name, ": q8_0 experts need int8 codes [E, N, K] and fp16 scales [E, N, K / 32], K % 32 == 0");
    return {kind, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), s.data_ptr<at::Half>(), N, K};
  }
  const int64_t K = 2 * q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kByte && s.scalar_type() == at::kHalf && s.dim() == 3 && s.size(0) == E &&
                  s.size(1) == N && K % 32 == 0 && s.size(2) == K / 32,
              name, ": int4 experts need uint8 codes [E, N, K / 2] and fp16 scales [E, N, K / 32], K % 32 == 0");
  return {kind, q.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), N, K};
}

// Activation buffers for M rows of K values in blocks of 32, zero (filled row by row by quantize_token).
QuantizedActivations empty_activations(int64_t M, int64_t blocks) {
  QuantizedActivations a;
  a.blocks = blocks;
  a.ldq = 32 * blocks;
  a.ldb = tandem::avx2::round_up(blocks, 8);
  a.q.assign(M * a.ldq, 0);
  a.d.assign(M * a.ldb, 0.0f);
  a.s.assign(M * a.ldb, 0);
  a.ds.assign(M * a.ldb, 0.0f);
  return a;
}

template <Kind F>
at::Tensor run(at::Tensor x, const Experts& w13, const Experts& w2, int64_t E, at::Tensor weights, at::Tensor ids,
               const char* op) {
  tandem::avx2::moe::check_inputs(x, weights, ids, op);
  const int64_t T = x.size(0), H = x.size(1), I = w2.K;
  tandem::avx2::moe::check_shapes(x, w13.N, w13.K, w2.N, w2.K, op);
  auto out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const auto wts = weights.contiguous();
  const Routing r = tandem::avx2::moe::group_by_expert(ids.contiguous(), E, op);
  constexpr bool kPairs = F == Kind::kQ4_0;

  // The tokens of the sorted assignments, quantized per block; the buffers the experts fill.
  const QuantizedActivations xa =
      tandem::avx2::quantize_activations(tandem::avx2::moe::sorted_rows(x, r), w13.of(0).blocks);
  const PairCodes xp = kPairs ? pair_codes(xa, r.A) : PairCodes{};
  QuantizedActivations aa = empty_activations(r.A, w2.of(0).blocks);
  PairCodes ap;
  if (kPairs) {
    ap.ld = 64 * (aa.blocks / 2);
    ap.q.resize(r.A * ap.ld);
  }
  std::vector<float> gu(r.A * 2 * I), y(r.A * H);
  std::vector<c10::BFloat16> act(r.A * I);

  // One region: gu = gate/up rows; act = bf16(silu(gate) * up) quantized per block; y = act . down rows.
  const auto gate_up = [&](int64_t e, int64_t tile) {
    const RowsOut o{gu.data(), w13.N, w13.row_scale(e)};
    tile_rows<F, kMB, kRB>(w13.of(e), xa, xp, r.start[e], r.start[e + 1], tile * kRB, w13.N, o);
  };
  const auto activate = [&](int64_t e) {
    for (int64_t s = r.start[e]; s < r.start[e + 1]; ++s) {
      tandem::avx2::moe::swiglu_row(&gu[s * 2 * I], I, &act[s * I]);
      tandem::avx2::quantize_token(&act[s * I], I, aa.blocks, &aa.q[s * aa.ldq], &aa.d[s * aa.ldb],
                                   &aa.s[s * aa.ldb], &aa.ds[s * aa.ldb]);
      if (kPairs) pair_codes_row(aa, s, &ap.q[s * ap.ld]);
    }
  };
  const auto down = [&](int64_t e, int64_t tile) {
    const RowsOut o{y.data(), w2.N, w2.row_scale(e)};
    tile_rows<F, kMB, kRB>(w2.of(e), aa, ap, r.start[e], r.start[e + 1], tile * kRB, w2.N, o);
  };
  tandem::avx2::moe::expert_region(r, (w13.N + kRB - 1) / kRB, (w2.N + kRB - 1) / kRB, gate_up, activate, down);
  tandem::avx2::moe::combine(r, y.data(), wts.data_ptr<float>(), H,
                             reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace

at::Tensor moe_int8(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids) {
  const Experts w13 = experts(w13_q, w13_s, Kind::kInt8, "moe_int8 w13"), w2 = experts(w2_q, w2_s, Kind::kInt8, "moe_int8 w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), "moe_int8: w13 and w2 have different expert counts");
  return run<Kind::kInt8>(x, w13, w2, w13_q.size(0), weights, ids, "moe_int8");
}

at::Tensor moe_q8_0(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids) {
  const Experts w13 = experts(w13_q, w13_s, Kind::kQ8_0, "moe_q8_0 w13"), w2 = experts(w2_q, w2_s, Kind::kQ8_0, "moe_q8_0 w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), "moe_q8_0: w13 and w2 have different expert counts");
  return run<Kind::kQ8_0>(x, w13, w2, w13_q.size(0), weights, ids, "moe_q8_0");
}

at::Tensor moe_int4(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids) {
  const Experts w13 = experts(w13_q, w13_s, Kind::kQ4_0, "moe_int4 w13"), w2 = experts(w2_q, w2_s, Kind::kQ4_0, "moe_int4 w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), "moe_int4: w13 and w2 have different expert counts");
  return run<Kind::kQ4_0>(x, w13, w2, w13_q.size(0), weights, ids, "moe_int4");
}
