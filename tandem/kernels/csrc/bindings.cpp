// Python bindings of Tandem's CPU kernels (see tandem/kernels/__init__.py for shapes and semantics).
#include <torch/extension.h>

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor linear_bf16_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len);
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
std::vector<int64_t> omp_thread_ids(int64_t n);
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale);
at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> scales,
    std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> parts, at::Tensor cos, at::Tensor sin,
    at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    at::Tensor query_start_loc, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t max_query_len);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "y = x @ w.T (+ bias), bf16, AVX-512 BF16", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("linear_bf16_packed", &linear_bf16_packed, "y = x @ w.T (+ bias), bf16, w packed by pack_bf16",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_int8", &linear_int8, "y = x @ (q * scale).T (+ bias), int8 per-channel weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_int4", &linear_int4, "y = x @ (q * scale).T (+ bias), int4 group-32 weights", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("dequantize", &dequantize, "bf16 weight of an int8 or int4 layer");
  m.def("paged_attention", &paged_attention, "write K/V into the paged cache, attend for short rows");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of [R, dim]");
  m.def("rotary", &rotary, "rotate-half rotary embedding of [T, H, D]");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("bind_omp_threads", &bind_omp_threads, "pin OpenMP thread i to cpus[i]; returns the thread ids",
        py::arg("cpus"));
  m.def("omp_thread_ids", &omp_thread_ids, "thread ids of an n-thread OpenMP team", py::arg("n"));
  m.def("linear_q8_0", &linear_q8_0, "y = x @ (q * scale).T (+ bias), GGUF Q8_0 group-32 int8 weights",
        py::arg("x"), py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q4_1", &linear_q4_1, "y = x @ (u * d + m).T (+ bias), GGUF Q4_1 group-32 weights",
        py::arg("x"), py::arg("qweight"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("dequantize_q8_0", &dequantize_q8_0, "bf16 weight of a q8_0 layer");
  m.def("dequantize_q4_1", &dequantize_q4_1, "bf16 weight of a q4_1 layer");
  m.def("rotary_", &rotary_, "in-place rotate-half rotary embedding of [T, H, D] (any token stride)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = rms_norm(residual)");
  m.def("decoder_layer", &decoder_layer, "a whole pre-norm decoder layer (bf16 or quantized linears) at decode sizes");
}
