// The one way the avx2 kernels split work over threads: tandem::avx2::parallel_for(begin, end,
// grain, fn) calls fn(b, e) on disjoint sub-ranges covering [begin, end), each at least `grain`
// long where possible, and returns when all are done. Results must not depend on the split (each
// output element is computed by exactly one call, in an order fixed by the kernel, not the split).
//
// The calls run on Tandem's own worker team (parallel.cpp), not in an OpenMP parallel region: the
// range is cut into a few chunks per thread that the caller and the workers claim one at a time, the
// caller never waits for a worker that has not claimed a chunk (a descheduled worker costs at most
// the chunk it holds), and idle workers spin briefly, then sleep on a futex. See parallel.cpp.
#pragma once

#include <cstdint>

namespace tandem::avx2 {

using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs fn(ctx, b, e) over chunks of [begin, end) on the worker team (inline when the range is at most
// one chunk, on one thread, or when called from a worker or while another caller uses the team).
// Rethrows the first exception a chunk raised, after every claimed chunk has finished.
void run_parallel(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx);

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (begin >= end) return;
  run_parallel(begin, end, grain,
               [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &fn);
}

}  // namespace tandem::avx2
