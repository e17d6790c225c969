// Declarations of the functions the avx2 variant binds (defined in csrc/avx2/*.cpp and in the
// ISA-independent csrc/threads.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
std::vector<int64_t> omp_thread_ids(int64_t n);
