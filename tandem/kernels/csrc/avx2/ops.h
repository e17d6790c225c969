// Declarations of the functions the avx2 variant binds (defined in csrc/avx2/*.cpp and in the
// ISA-independent csrc/threads.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
std::vector<int64_t> omp_thread_ids(int64_t n);

// linear_bf16.cpp, linear_quant.cpp
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q8_0(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor linear_q4_1(at::Tensor x, at::Tensor qweight, at::Tensor scale, c10::optional<at::Tensor> bias);
at::Tensor dequantize(at::Tensor qweight, at::Tensor scale);
at::Tensor dequantize_q8_0(at::Tensor qweight, at::Tensor scale);
at::Tensor dequantize_q4_1(at::Tensor qweight, at::Tensor scale);
