// Python bindings of Tandem's AVX2 + FMA + F16C kernels (the "avx2" variant; see
// tandem/kernels/__init__.py for shapes and semantics). Each function has the name and signature of
// its AVX-512 BF16 counterpart, so tandem.kernels calls whichever variant is selected.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_omp_threads", &bind_omp_threads, "pin OpenMP thread i to cpus[i]; returns the thread ids",
        py::arg("cpus"));
  m.def("omp_thread_ids", &omp_thread_ids, "thread ids of an n-thread OpenMP team", py::arg("n"));
  m.def("paged_attention", &paged_attention, "write K/V into the paged cache, attend every row up to max_query_len");
  // avx2 only (tandem.kernels.supports_window_softcap): sliding window and score soft-capping
  m.def("paged_attention_ex", &paged_attention_ex, "paged_attention with a sliding window and soft-capping");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of [R, dim]");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = rms_norm(residual)");
  m.def("rotary", &rotary, "rotate-half rotary embedding of [T, H, D]");
  m.def("rotary_", &rotary_, "in-place rotate-half rotary embedding of [T, H, D] (any token stride)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("argmax", &argmax, "torch.max(x, -1).indices of x [R, V] bf16 / fp32 (first maximum, NaN first)");
  m.def("moe_bf16", &moe_bf16, "fused mixture-of-experts SwiGLU feed-forward, bf16 experts [E, 2I, H] / [E, H, I]",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("weights"), py::arg("ids"));
  m.def("moe_int8", &moe_int8, "fused MoE, int8 per-channel experts (codes [E, N, K], fp32 scales [E, N])",
        py::arg("x"), py::arg("w13_q"), py::arg("w13_s"), py::arg("w2_q"), py::arg("w2_s"), py::arg("weights"),
        py::arg("ids"));
  m.def("moe_q8_0", &moe_q8_0, "fused MoE, GGUF Q8_0 experts (codes [E, N, K], fp16 scales [E, N, K / 32])",
        py::arg("x"), py::arg("w13_q"), py::arg("w13_s"), py::arg("w2_q"), py::arg("w2_s"), py::arg("weights"),
        py::arg("ids"));
  m.def("moe_kquant", &moe_kquant, "fused MoE, GGUF Q4_K / Q6_K experts (block bytes [E, N, blocks * 140 / 208])",
        py::arg("x"), py::arg("w13_q"), py::arg("w13_s"), py::arg("w2_q"), py::arg("w2_s"), py::arg("weights"),
        py::arg("ids"), py::arg("w13_format"), py::arg("w2_format"));
  m.def("moe_int4", &moe_int4, "fused MoE, Q4_0 experts (codes [E, N, K / 2], fp16 scales [E, N, K / 32])",
        py::arg("x"), py::arg("w13_q"), py::arg("w13_s"), py::arg("w2_q"), py::arg("w2_s"), py::arg("weights"),
        py::arg("ids"));
  m.def("decoder_layer", &decoder_layer, "a whole pre-norm decoder layer (bf16 or quantized linears) at decode sizes");
  // Linear kernels (linear_bf16.cpp, linear_quant.cpp): any M, batch invariant; quantized formats
  // quantize the activations to int8 per block of 32 (llama.cpp's AVX2 path).
  m.def("linear_bf16", &linear_bf16, "y = x @ w.T (+ bias), bf16, fp32 FMA", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("linear_bf16_packed", &linear_bf16_packed, "y = x @ w.T (+ bias), bf16, w packed by pack_bf16, fp32 FMA",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_int8", &linear_int8, "y = x @ (q * scale).T (+ bias), int8 per-channel weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_int4", &linear_int4, "y = x @ (q * scale).T (+ bias), Q4_0 group-32 weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q8_0", &linear_q8_0, "y = x @ (q * scale).T (+ bias), GGUF Q8_0 weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q4_1", &linear_q4_1, "y = x @ (u * d + m).T (+ bias), GGUF Q4_1 weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  // linear_kquant.cpp: GGUF Q5_0 (q8_0 activations) and Q4_K / Q6_K (q8_K activations, blocks of 256)
  m.def("linear_q5_0", &linear_q5_0, "y = x @ dequant(w).T (+ bias), GGUF Q5_0 weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q4_k", &linear_q4_k, "y = x @ dequant(w).T (+ bias), GGUF Q4_K weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q6_k", &linear_q6_k, "y = x @ dequant(w).T (+ bias), GGUF Q6_K weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("dequantize", &dequantize, "bf16 weight of an int8 or int4 layer", py::arg("qweight"), py::arg("scale"));
  m.def("dequantize_q8_0", &dequantize_q8_0, "bf16 weight of a q8_0 layer", py::arg("qweight"), py::arg("scale"));
  m.def("dequantize_q4_1", &dequantize_q4_1, "bf16 weight of a q4_1 layer", py::arg("qweight"), py::arg("scale"));
}
