// Fused mixture-of-experts feed-forward for GGUF Q4_K / Q6_K experts (AVX2 + FMA + F16C): semantics in
// tandem/kernels/__init__.py (moe_kquant) and tandem/models/moe_quant.py. llama.cpp's Q4_K_M files store
// ffn_{gate,up}_exps as Q4_K and ffn_down_exps as Q4_K or Q6_K, so w13 and w2 each take either format.
//
// moe_quant.cpp's plan (one parallel region, moe_common.h expert_region) with linear_kquant.cpp's arithmetic
// (kquant_tile.h): assignments grouped by expert (moe_common.h), then
//   1. the routed tokens' rows in sorted order, quantized per block of 256 (llama.cpp's q8_K); for each
//      selected expert and tile of 4 gate/up rows, the tile's blocks are read once for all the expert's
//      assignments (2 x 2 tiles for pairs of them, 1 x 4 for a single one): gu[s] fp32;
//   2. once an expert's gate/up tiles are done: act[s] = bf16(silu(gate) * up), quantized the same way;
//      y[s] = act[s] . w2 rows (fp32);
//   3. out[t] = bf16(sum_j weights[t, j] * y[t, j]), j in top-k order.
// Experts no token selected are never read. BATCH INVARIANCE: a (assignment, row) value is one tile
// computation whose bits do not depend on the tile's shape (kquant_tile.h), and a token's activations are
// quantized alone, so a token's output does not depend on the rest of the batch or the grouping.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kquant_tile.h"
#include "moe_common.h"
#include "ops.h"

namespace {

using namespace tandem::avx2::kquant;
using tandem::avx2::moe::Routing;
using tandem::avx2::moe::RowsOut;

enum class Fmt { kQ4_K, kQ6_K };
constexpr int kRB = 4;  // weight rows per parallel item

// One [E, N, K] expert stack: per row `blocks` super-blocks of code bytes (140 / 208) and fp16 fields (2 / 1).
struct Experts {
  Fmt fmt;
  const uint8_t* q;
  const uint16_t* scale;
  int64_t N, K, blocks, ldq, lds;

  Weights of(int64_t e) const { return {q + e * N * ldq, scale + e * N * lds, K, blocks, ldq, lds}; }
  int64_t block_bytes() const { return fmt == Fmt::kQ4_K ? 140 : 208; }
};

Experts experts(const at::Tensor& q, const at::Tensor& s, const std::string& format, const char* name) {
  TORCH_CHECK(format == "q4_k" || format == "q6_k", name, ": format must be q4_k or q6_k, got ", format);
  const Fmt fmt = format == "q4_k" ? Fmt::kQ4_K : Fmt::kQ6_K;
  const int64_t code_bytes = fmt == Fmt::kQ4_K ? 140 : 208, halves = fmt == Fmt::kQ4_K ? 2 : 1;
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(2) % code_bytes == 0, name,
              ": ", format, " experts need contiguous uint8 codes [E, N, blocks * ", code_bytes, "]");
  const int64_t E = q.size(0), N = q.size(1), blocks = q.size(2) / code_bytes;
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == (halves == 2 ? 4 : 3) && s.size(0) == E &&
                  s.size(1) == N && s.size(2) == blocks && (halves == 1 || s.size(3) == 2),
              name, ": ", format, " experts need contiguous fp16 scales [E, N, blocks", halves == 2 ? ", 2]" : "]");
  return {fmt, q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()), N, blocks * QK,
          blocks, q.size(2), blocks * halves};
}

template <Fmt F, int MB, int RB>
inline void tile(const Weights& w, const Q8K& a, int64_t m0, int64_t row0, const NextRows& pf, const RowsOut& o) {
  if constexpr (F == Fmt::kQ4_K) tile_q4k<MB, RB>(w, a, m0, row0, pf, o);
  else tile_q6k<MB, RB>(w, a, m0, row0, pf, o);
}

// Assignments [first, last) of one expert x its rows [row0, row0 + kRB) (fewer at the end).
template <Fmt F>
void item(const Weights& w, const Q8K& a, int64_t first, int64_t last, int64_t row0, int64_t N, int64_t bb,
          const RowsOut& o) {
  const NextRows pf{w.q + (row0 + kRB) * w.ldq, w.ldq, std::clamp<int64_t>(N - row0 - kRB, 0, kRB), bb};
  if (row0 + kRB > N) {
    const NextRows none{w.q, w.ldq, 0, bb};
    for (int64_t row = row0; row < N; ++row)
      for (int64_t m = first; m < last; ++m) tile<F, 1, 1>(w, a, m, row, none, o);
  } else if (last - first == 1) {
    tile<F, 1, 4>(w, a, first, row0, pf, o);  // decode: 4 row streams
  } else {
    for (int64_t half = 0; half < 2; ++half) {  // NOTE: 2 x 4 tiles spill the integer sums (linear_kquant.cpp)
      int64_t m = first;
      for (; m + 2 <= last; m += 2) tile<F, 2, 2>(w, a, m, row0 + 2 * half, pf, o);
      for (; m < last; ++m) tile<F, 1, 2>(w, a, m, row0 + 2 * half, pf, o);
    }
  }
}

// Expert e's assignments x its rows [tile * kRB, tile * kRB + kRB) of the stack ex.
void rows(const Experts& ex, const Routing& r, const Q8K& a, int64_t e, int64_t tile, const RowsOut& o) {
  if (ex.fmt == Fmt::kQ4_K)
    item<Fmt::kQ4_K>(ex.of(e), a, r.start[e], r.start[e + 1], tile * kRB, ex.N, ex.block_bytes(), o);
  else
    item<Fmt::kQ6_K>(ex.of(e), a, r.start[e], r.start[e + 1], tile * kRB, ex.N, ex.block_bytes(), o);
}

}  // namespace

at::Tensor moe_kquant(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                      at::Tensor weights, at::Tensor ids, std::string w13_format, std::string w2_format) {
  const char* op = "moe_kquant";
  const Experts w13 = experts(w13_q, w13_s, w13_format, "moe_kquant w13");
  const Experts w2 = experts(w2_q, w2_s, w2_format, "moe_kquant w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), op, ": w13 and w2 have different expert counts");
  tandem::avx2::moe::check_inputs(x, weights, ids, op);
  const int64_t T = x.size(0), H = x.size(1), I = w2.K;
  tandem::avx2::moe::check_shapes(x, w13.N, w13.K, w2.N, w2.K, op);
  auto out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const auto wts = weights.contiguous();
  const Routing r = tandem::avx2::moe::group_by_expert(ids.contiguous(), w13_q.size(0), op);

  const Q8K xa = quantize_q8k(tandem::avx2::moe::sorted_rows(x, r), w13.blocks);
  Q8K aa = empty_q8k(r.A, w2.blocks);
  std::vector<float> gu(r.A * 2 * I), y(r.A * H);
  std::vector<c10::BFloat16> act(r.A * I);
  const RowsOut gu_out{gu.data(), w13.N, nullptr}, y_out{y.data(), w2.N, nullptr};
  const auto activate = [&](int64_t e) {
    for (int64_t s = r.start[e]; s < r.start[e + 1]; ++s) {
      tandem::avx2::moe::swiglu_row(&gu[s * 2 * I], I, &act[s * I]);
      quantize_token_q8k(&act[s * I], w2.blocks, &aa.q[s * QK * w2.blocks], &aa.d[s * w2.blocks],
                         &aa.s16[s * w2.blocks * 16], &aa.s32[s * w2.blocks * 8]);
    }
  };
  tandem::avx2::moe::expert_region(
      r, (w13.N + kRB - 1) / kRB, (w2.N + kRB - 1) / kRB,
      [&](int64_t e, int64_t tile) { rows(w13, r, xa, e, tile, gu_out); }, activate,
      [&](int64_t e, int64_t tile) { rows(w2, r, aa, e, tile, y_out); });
  tandem::avx2::moe::combine(r, y.data(), wts.data_ptr<float>(), H,
                             reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()));
  return out;
}
