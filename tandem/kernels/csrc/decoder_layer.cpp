// One C++ call for a whole pre-norm decoder layer at decode sizes (Llama / Mistral / Qwen2), with bf16
// or weight-only quantized linears (int8, int4, GGUF q8_0 / q4_1, and in the avx2 build GGUF q5_0 / q4_k /
// q6_k; each projection its own format, or several parts of different formats whose outputs are
// concatenated, as ConcatLinear holds a Q4_K_M file's q/k in Q5_0 beside v in Q8_0).
//
// At batch 1 a layer of a small model (Qwen2.5-0.5B: 24 layers, hidden 896) costs ~0.7 ms of
// weight reads, and calling its ~10 kernels from Python added ~50 us of interpreter and module
// overhead (SmolLM2-135M: 30 layers of ~0.3 ms). This function runs the same kernels in the same order
// as the Python kernel path of tandem/models/llama.py (LlamaDecoderLayer.forward), so its results are
// bit for bit the same:
//   residual stream: h = x (first layer: the embeddings) or residual + x (fused with the norm)
//   qkv = linear(rms_norm(h)); rotary in place on the q and k columns; paged attention
//   a = linear_o(attn); residual += a, a = rms_norm(residual); out = down(silu_and_mul(gate_up(a)))
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <tuple>
#include <vector>

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
// linear_bf16_packed.cpp in the avx512_bf16 build, avx2/linear_bf16_packed.cpp in the avx2 one
at::Tensor linear_bf16_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
#ifndef __AVX512BF16__  // the GGUF K-quant kernels exist in the avx2 build only (csrc/avx2/linear_kquant.cpp)
#define TANDEM_KQUANT_LINEARS 1
at::Tensor linear_q5_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q6_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
#endif
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);

namespace {

// kinds[i]: the format of linear part i (tandem.kernels.LINEAR_KINDS): 0 bf16 (weights[i] is the bf16
// weight, scales[i] None), 1 int8, 2 int4, 3 q8_0, 4 q4_1, 5 q5_0, 6 q4_k, 7 q6_k (weights[i] the
// qweight, scales[i] its scale), 8 bf16_packed (weights[i] the packed weight of pack_bf16, scales[i] None).
at::Tensor part_linear(const at::Tensor& x, int64_t kind, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == 0 || kind == 8 || (scale.has_value() && scale->defined()), "decoder_layer: a quantized linear needs its scale");
  switch (kind) {
    case 0: return linear_bf16(x, w, bias);
    case 1: return linear_int8(x, w, *scale, bias);
    case 2: return linear_int4(x, w, *scale, bias);
    case 3: return linear_q8_0(x, w, *scale, bias);
    case 4: return linear_q4_1(x, w, *scale, bias);
#ifdef TANDEM_KQUANT_LINEARS
    case 5: return linear_q5_0(x, w, *scale, bias);
    case 6: return linear_q4_k(x, w, *scale, bias);
    case 7: return linear_q6_k(x, w, *scale, bias);
#endif
    case 8: return linear_bf16_packed(x, w, bias);
    default: TORCH_CHECK(false, "decoder_layer: linear kind ", kind, " is unknown or not in this build");
  }
}

// The parts [first, first + count) of one projection, their outputs concatenated along N (torch.cat in
// ConcatLinear.forward: the same bits).
at::Tensor layer_linear(const at::Tensor& x, int64_t first, int64_t count, const std::vector<int64_t>& kinds,
                        const std::vector<at::Tensor>& weights, const std::vector<c10::optional<at::Tensor>>& scales,
                        const std::vector<c10::optional<at::Tensor>>& biases) {
  if (count == 1) return part_linear(x, kinds[first], weights[first], scales[first], biases[first]);
  std::vector<at::Tensor> outs;
  for (int64_t i = first; i < first + count; ++i) outs.push_back(part_linear(x, kinds[i], weights[i], scales[i], biases[i]));
  return at::cat(outs, 1);
}

}  // namespace

// x [T, hidden] bf16 and residual [T, hidden] or None -> (mlp_out, residual), as in the docstring of
// tandem.kernels.decoder_layer. The four linears (qkv, o, gate_up, down) are given as parallel lists
// kinds / weights / scales / biases of their parts, parts[j] of them for linear j. Overwrites x and
// residual in place. Every row of the step must have at most max_query_len query tokens (all are
// attended here; there is no SDPA fallback).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> scales,
    std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> parts, at::Tensor cos, at::Tensor sin,
    at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    at::Tensor query_start_loc, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t max_query_len) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "decoder_layer: x must be contiguous [T, hidden] bf16");
  TORCH_CHECK(x.size(0) <= max_query_len, "decoder_layer: more tokens than max_query_len");
  TORCH_CHECK(parts.size() == 4, "decoder_layer: expected 4 linears (qkv, o, gate_up, down)");
  int64_t first[4], total = 0;
  for (int j = 0; j < 4; ++j) {
    TORCH_CHECK(parts[j] >= 1, "decoder_layer: every linear needs a part");
    first[j] = total;
    total += parts[j];
  }
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == total && weights.size() == kinds.size() &&
                  scales.size() == kinds.size() && biases.size() == kinds.size(),
              "decoder_layer: kinds, weights, scales and biases must have sum(parts) entries");
  auto linear = [&](int j, const at::Tensor& in) {
    return layer_linear(in, first[j], parts[j], kinds, weights, scales, biases);
  };
  const int64_t T = x.size(0), D = k_cache.size(-1), H = num_heads, KV = num_kv_heads;
  at::Tensor res, h;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    fused_add_rms_norm(x, res, input_norm, eps);
    h = x;
  } else {
    res = x;
    h = rms_norm(x, input_norm, eps);
  }
  at::Tensor qkv = linear(0, h);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KV) * D, "decoder_layer: qkv width != (H + 2 KV) head_dim");
  rotary_(qkv.narrow(1, 0, (H + KV) * D).view({T, H + KV, D}), cos, sin);
  at::Tensor out = at::empty({T, H, D}, qkv.options());
  paged_attention(out, qkv.narrow(1, 0, H * D).view({T, H, D}), qkv.narrow(1, H * D, KV * D).view({T, KV, D}),
                  qkv.narrow(1, (H + KV) * D, KV * D).view({T, KV, D}), k_cache, v_cache, slot_mapping,
                  block_tables, seq_lens, query_start_loc, scale, max_query_len);
  at::Tensor a = linear(1, out.view({T, H * D}));
  fused_add_rms_norm(a, res, post_norm, eps);
  at::Tensor y = linear(3, silu_and_mul(linear(2, a)));
  return {y, res};
}
