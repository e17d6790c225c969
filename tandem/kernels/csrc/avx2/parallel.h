// The one way the avx2 kernels split work over threads: tandem::avx2::parallel_for(begin, end,
// grain, fn) calls fn(b, e) on disjoint sub-ranges covering [begin, end), each at least `grain`
// long where possible, and returns when all are done. Results must not depend on the split (each
// output element is computed by exactly one call, in an order fixed by the kernel, not the split).
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace tandem::avx2 {

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  at::parallel_for(begin, end, grain, fn);
}

}  // namespace tandem::avx2
