// Declarations of the functions the avx2 variant binds (defined in csrc/avx2/*.cpp and in the
// ISA-independent csrc/threads.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
std::vector<int64_t> omp_thread_ids(int64_t n);

// paged_attention.cpp, elementwise.cpp (semantics: tandem/kernels/__init__.py)
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len);
void paged_attention_ex(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                        at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                        at::Tensor query_start_loc, double scale, int64_t max_query_len, int64_t window,
                        double softcap);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
// argmax.cpp: torch.max(x, -1).indices of x [R, V]
at::Tensor argmax(at::Tensor x);

// linear_bf16.cpp, linear_quant.cpp
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
// linear_bf16_packed.cpp: w packed by tandem.kernels.pack_bf16
at::Tensor linear_bf16_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale);
at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale);
at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale);

// linear_kquant.cpp: GGUF Q5_0 / Q4_K / Q6_K blocks (tandem/models/gguf_blocks.py)
at::Tensor linear_q5_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q6_k(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);

// moe.cpp
at::Tensor moe_bf16(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor weights, at::Tensor ids);
// moe_quant.cpp: int8 (per-channel) / int4 (Q4_0) experts, codes [E, N, K] / [E, N, K / 2]
at::Tensor moe_int8(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids);
at::Tensor moe_int4(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids);
at::Tensor moe_q8_0(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                    at::Tensor weights, at::Tensor ids);
// moe_kquant.cpp: GGUF Q4_K / Q6_K experts (w13 and w2 each in "q4_k" or "q6_k")
at::Tensor moe_kquant(at::Tensor x, at::Tensor w13_q, at::Tensor w13_s, at::Tensor w2_q, at::Tensor w2_s,
                      at::Tensor weights, at::Tensor ids, std::string w13_format, std::string w2_format);

// ../decoder_layer.cpp (ISA-independent: calls the functions above)
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> scales,
    std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> parts, at::Tensor cos, at::Tensor sin,
    at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    at::Tensor query_start_loc, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t max_query_len);
