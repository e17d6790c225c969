// One C++ call for a whole bf16 pre-norm decoder layer at decode sizes (Llama / Mistral / Qwen2).
//
// At batch 1 a layer of a small model (Qwen2.5-0.5B: 24 layers, hidden 896) costs ~0.7 ms of
// weight reads, and calling its ~10 kernels from Python added ~50 us of interpreter and module
// overhead. This function runs the same kernels in the same order as the Python kernel path of
// tandem/models/llama.py (LlamaDecoderLayer.forward), so its results are bit for bit the same:
//   residual stream: h = x (first layer: the embeddings) or residual + x (fused with the norm)
//   qkv = linear(rms_norm(h)); rotary in place on the q and k columns; paged attention
//   a = linear_o(attn); residual += a, a = rms_norm(residual); out = down(silu_and_mul(gate_up(a)))
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <tuple>

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);

// x [T, hidden] bf16 and residual [T, hidden] or None -> (mlp_out, residual), as in the docstring of
// tandem.kernels.decoder_layer_bf16. Overwrites x and residual in place. Every row of the step must
// have at most max_query_len query tokens (all are attended here; there is no SDPA fallback).
std::tuple<at::Tensor, at::Tensor> decoder_layer_bf16(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    at::Tensor qkv_w, c10::optional<at::Tensor> qkv_b, at::Tensor o_w, c10::optional<at::Tensor> o_b,
    at::Tensor gate_up_w, c10::optional<at::Tensor> gate_up_b, at::Tensor down_w, c10::optional<at::Tensor> down_b,
    at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
    at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, double scale, int64_t max_query_len) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "decoder_layer_bf16: x must be contiguous [T, hidden] bf16");
  TORCH_CHECK(x.size(0) <= max_query_len, "decoder_layer_bf16: more tokens than max_query_len");
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
  at::Tensor qkv = linear_bf16(h, qkv_w, qkv_b);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KV) * D, "decoder_layer_bf16: qkv width != (H + 2 KV) head_dim");
  rotary_(qkv.narrow(1, 0, (H + KV) * D).view({T, H + KV, D}), cos, sin);
  at::Tensor out = at::empty({T, H, D}, qkv.options());
  paged_attention(out, qkv.narrow(1, 0, H * D).view({T, H, D}), qkv.narrow(1, H * D, KV * D).view({T, KV, D}),
                  qkv.narrow(1, (H + KV) * D, KV * D).view({T, KV, D}), k_cache, v_cache, slot_mapping,
                  block_tables, seq_lens, query_start_loc, scale, max_query_len);
  at::Tensor a = linear_bf16(out.view({T, H * D}), o_w, o_b);
  fused_add_rms_norm(a, res, post_norm, eps);
  at::Tensor y = linear_bf16(silu_and_mul(linear_bf16(a, gate_up_w, gate_up_b)), down_w, down_b);
  return {y, res};
}
