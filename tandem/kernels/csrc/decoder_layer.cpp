// One C++ call for a whole pre-norm decoder layer at decode sizes (Llama / Mistral / Qwen2), with bf16
// or weight-only quantized linears (int8, int4, GGUF q8_0 / q4_1; each projection its own format).
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
#include <ATen/ops/empty.h>

#include <tuple>
#include <vector>

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);

namespace {

// kinds[i]: the format of linear i (tandem.kernels.LINEAR_KINDS): 0 bf16 (weights[i] is the bf16 weight,
// scales[i] None), 1 int8, 2 int4, 3 q8_0, 4 q4_1 (weights[i] the qweight, scales[i] its scale).
at::Tensor layer_linear(const at::Tensor& x, int64_t kind, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == 0 || (scale.has_value() && scale->defined()), "decoder_layer: a quantized linear needs its scale");
  switch (kind) {
    case 0: return linear_bf16(x, w, bias);
    case 1: return linear_int8(x, w, *scale, bias);
    case 2: return linear_int4(x, w, *scale, bias);
    case 3: return linear_q8_0(x, w, *scale, bias);
    case 4: return linear_q4_1(x, w, *scale, bias);
    default: TORCH_CHECK(false, "decoder_layer: unknown linear kind ", kind);
  }
}

}  // namespace

// x [T, hidden] bf16 and residual [T, hidden] or None -> (mlp_out, residual), as in the docstring of
// tandem.kernels.decoder_layer. The four linears (qkv, o, gate_up, down) are given as parallel lists
// kinds / weights / scales / biases. Overwrites x and residual in place. Every row of the step must
// have at most max_query_len query tokens (all are attended here; there is no SDPA fallback).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> scales,
    std::vector<c10::optional<at::Tensor>> biases, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
    at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    at::Tensor query_start_loc, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t max_query_len) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "decoder_layer: x must be contiguous [T, hidden] bf16");
  TORCH_CHECK(x.size(0) <= max_query_len, "decoder_layer: more tokens than max_query_len");
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && scales.size() == 4 && biases.size() == 4,
              "decoder_layer: expected 4 linears (qkv, o, gate_up, down)");
  auto linear = [&](int i, const at::Tensor& in) { return layer_linear(in, kinds[i], weights[i], scales[i], biases[i]); };
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
