// OpenMP thread pinning for the engine (see tandem/worker/cpu_env.py): the same idea as vLLM's CPU
// backend (init_cpu_threads_env, VLLM_CPU_OMP_THREADS_BIND): inside one parallel region of n threads,
// thread i pins itself to core i. libgomp keeps its worker threads in a pool and gives team slot i to
// the same thread in every later region of the same master, so torch's parallel regions run on the
// pinned threads (this library links the libgomp.so.1 torch already loaded).
#include <errno.h>
#include <omp.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include <torch/extension.h>

namespace tandem {
namespace {
std::mutex bound_mu;
std::vector<int64_t> bound;  // the cores of the last successful bind_omp_threads
std::atomic<uint64_t> bind_count{0};
}  // namespace

uint64_t bind_epoch() { return bind_count.load(std::memory_order_acquire); }

// The cores of the last bind_omp_threads call (empty before one) and, in *epoch, how many calls
// succeeded: the avx2 worker team (csrc/avx2/parallel.cpp) pins worker i to cores[i] and rebuilds
// itself when the epoch (also bind_epoch()) changes.
std::vector<int64_t> bound_cpus(uint64_t* epoch) {
  std::lock_guard<std::mutex> lock(bound_mu);
  *epoch = bind_count.load();
  return bound;
}
}  // namespace tandem

// Pins OpenMP thread i of an n = len(cpus) thread team to cpus[i] and sets omp_set_num_threads(n).
// Returns the kernel thread ids (gettid) of the team, in thread-number order.
// Raises (RuntimeError): empty list, a negative id, fewer threads than asked, or sched_setaffinity failing.
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "bind_omp_threads: empty core list");
  for (int64_t c : cpus) {
    TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_omp_threads: bad core id ", c);
  }
  omp_set_dynamic(0);
  omp_set_num_threads(n);
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errs(n, 0);
  int team = 0;
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) errs[i] = errno;
    tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  TORCH_CHECK(team == n, "bind_omp_threads: OpenMP gave ", team, " threads, asked for ", n);
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK(errs[i] == 0, "bind_omp_threads: cannot pin thread ", i, " to core ", cpus[i], ": ",
                strerror(errs[i]));
  }
  {
    std::lock_guard<std::mutex> lock(tandem::bound_mu);
    tandem::bound = cpus;
    ++tandem::bind_count;
  }
  return tids;
}

// Kernel thread ids of the team of an n-thread parallel region (for checking the pinning).
std::vector<int64_t> omp_thread_ids(int64_t n) {
  TORCH_CHECK(n > 0, "omp_thread_ids: n must be > 0");
  std::vector<int64_t> tids(n, -1);
#pragma omp parallel num_threads(static_cast<int>(n))
  {
    const int i = omp_get_thread_num();
    if (i < n) tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  return tids;
}
