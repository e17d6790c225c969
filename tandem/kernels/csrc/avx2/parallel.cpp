// Tandem's worker team for the avx2 kernels (parallel.h): persistent threads instead of one OpenMP
// parallel region per kernel call.
//
// Why: a decode step of the default model made ~150 OpenMP regions (4 linears and attention per
// layer). With OMP_WAIT_POLICY=passive (cpu_env.py: spinning collapses on shared cores) every region
// futex-wakes the team and its end barrier waits for the slowest thread; on a loaded machine a
// woken worker waits a scheduler slice for its core, and the caller waits with it: 9 tokens/s became
// 0.9 at load average 13 on 2 cores, while one thread kept 12.5.
// How (the dynamic split of llama.cpp's ggml threadpool and of OpenMP's schedule(dynamic), with its
// spin-then-sleep waiting, but a caller that never waits on a thread that has not started):
// - a call publishes one job (fn, range, chunk size) under a sequence number; the range is cut into
//   up to kChunksPerThread chunks per thread, which the caller and the workers claim with a
//   compare-and-swap on (sequence, next chunk), so a late worker can never claim a newer job's chunk;
// - the caller works through chunks too and then waits only for chunks other threads claimed: a
//   worker that is descheduled before it claims anything costs nothing, one descheduled inside a
//   chunk costs that chunk;
// - waiting threads spin (pause) for TANDEM_SPIN_US microseconds (default kDefaultSpinUs), then sleep
//   on a futex: consecutive kernels of a step reuse spinning workers, and a co-tenant gets the core
//   back after the spin;
// - a worker gives its core away only between chunks: before claiming one, a worker that has run
//   TANDEM_YIELD_US (default kDefaultYieldUs = 0: off) since it last slept or yielded calls sched_yield().
//   NOTE: off by default: measured with contention_bench --pairs (quiet and busy seconds apart, load
//   2.1-2.5), the team without yields already kept 0.49x of its quiet rate under one busy process per
//   core (the 0.28x before came from quiet and busy columns minutes apart), and 200 us yields gave
//   the same 0.49x at a quiet rate 9% lower (8.19 against 8.97 tokens/s, within the noise).
//   With a co-tenant on its core, the scheduler (EEVDF, Linux >= 6.6) switches tasks at a tick once
//   the running one has used its slice, mid-chunk; the caller then waited for that chunk until the
//   worker's next turn (a slice of the co-tenant's, 4 ms at HZ=250): decode fell to 0.28x of the
//   quiet rate with one busy process per core. A yield hands the core over where the worker holds
//   nothing (the caller takes the remaining chunks meanwhile), and each yield moves the worker's
//   deadline a slice later, so a tick rarely finds it past its deadline inside a chunk. On a core with
//   nothing else to run, sched_yield returns at once (about a microsecond per TANDEM_YIELD_US).
// Workers pin to the cores bind_omp_threads gave the OpenMP team (worker i to cpus[i]; the caller
// is OpenMP thread 0). The team follows at::get_num_threads() and is rebuilt when it or the binding
// changes; a forked child starts a new team. Results do not depend on the split (parallel.h).
#include "parallel.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace tandem {
// csrc/threads.cpp: the cores of the last bind_omp_threads call and a counter of such calls.
std::vector<int64_t> bound_cpus(uint64_t* epoch);
uint64_t bind_epoch();
}  // namespace tandem

namespace tandem::avx2 {
namespace {

constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kDefaultSpinUs = 50;
constexpr int64_t kDefaultYieldUs = 0;  // off: see the NOTE at the top of the file

// $name in microseconds (default `fallback`, negative = 0) as nanoseconds.
int64_t env_ns(const char* name, long fallback) {
  const char* v = std::getenv(name);
  const long us = v != nullptr ? std::strtol(v, nullptr, 10) : fallback;
  return static_cast<int64_t>(std::max(0L, us)) * 1000;
}

int64_t spin_ns() {
  static const int64_t ns = env_ns("TANDEM_SPIN_US", kDefaultSpinUs);
  return ns;
}

int64_t yield_ns() {
  static const int64_t ns = env_ns("TANDEM_YIELD_US", kDefaultYieldUs);
  return ns;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

// Spins until done() or spin_ns() elapsed; returns done()'s last value.
template <typename Pred>
bool spin_until(const Pred& done) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t budget = spin_ns();
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >= budget)
      return done();
  }
}

thread_local bool tls_in_team = false;

struct Team {
  explicit Team(int n, uint64_t epoch_, const std::vector<int64_t>& cpus) : nthreads(n), epoch(epoch_) {
    for (int i = 1; i < n; ++i) {
      const int64_t cpu = static_cast<int64_t>(cpus.size()) == n ? cpus[i] : -1;
      workers.emplace_back([this, cpu] { worker(cpu); });
    }
  }

  ~Team() {
    stop.store(true, std::memory_order_seq_cst);
    seq.fetch_add(2, std::memory_order_seq_cst);
    futex_wake(&seq, INT_MAX);
    for (auto& t : workers) t.join();
  }

  // The caller's side of one job: publish, work, wait for the chunks others claimed.
  void run(int64_t begin, int64_t end, int64_t chunk, int64_t nchunks, RangeFn f, const void* c) {
    const uint32_t s = seq.load(std::memory_order_relaxed) + 2;
    seq.store(s - 1, std::memory_order_relaxed);  // odd: the job fields are being written
    std::atomic_thread_fence(std::memory_order_release);
    job_fn.store(f, std::memory_order_relaxed);
    job_ctx.store(c, std::memory_order_relaxed);
    job_begin.store(begin, std::memory_order_relaxed);
    job_end.store(end, std::memory_order_relaxed);
    job_chunk.store(chunk, std::memory_order_relaxed);
    job_nchunks.store(nchunks, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    claim.store(static_cast<uint64_t>(s) << 32, std::memory_order_relaxed);
    seq.store(s, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake(&seq, INT_MAX);
    work(s, begin, end, chunk, nchunks, f, c, nullptr);
    const auto all_done = [&] { return done.load(std::memory_order_acquire) == nchunks; };
    if (!spin_until(all_done)) {
      while (true) {
        caller_waiting.store(1, std::memory_order_seq_cst);
        const uint32_t d = done.load(std::memory_order_seq_cst);
        if (d == nchunks) break;
        futex_wait(&done, d);
      }
      caller_waiting.store(0, std::memory_order_relaxed);
    }
    if (error) {
      std::exception_ptr e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Claims and runs chunks of job s until none is left or a newer job replaced it. resumed (workers;
  // nullptr for the caller): when the thread last slept or yielded (now_ns), for the yield before a
  // claim (see the top of the file).
  void work(uint32_t s, int64_t begin, int64_t end, int64_t chunk, int64_t nchunks, RangeFn f, const void* c,
            int64_t* resumed) {
    uint64_t cur = claim.load(std::memory_order_acquire);
    while ((cur >> 32) == s && static_cast<int64_t>(cur & 0xffffffffu) < nchunks) {
      if (resumed != nullptr && yield_ns() > 0) {
        const int64_t t = now_ns();
        if (t - *resumed >= yield_ns()) {
          sched_yield();
          *resumed = now_ns();
          cur = claim.load(std::memory_order_acquire);
          continue;
        }
      }
      if (!claim.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t b = begin + static_cast<int64_t>(cur & 0xffffffffu) * chunk;
      try {
        f(c, b, std::min(end, b + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
      const uint32_t d = done.fetch_add(1, std::memory_order_seq_cst) + 1;
      if (d == nchunks && caller_waiting.load(std::memory_order_seq_cst)) futex_wake(&done, 1);
      cur = claim.load(std::memory_order_acquire);
    }
  }

  void worker(int64_t cpu) {
    tls_in_team = true;
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      sched_setaffinity(0, sizeof(set), &set);  // NOTE: best effort, as an unpinned team still works
    }
    // NOTE: 0, not seq's value now: a worker that starts late (the caller does not wait for it) must
    // still see every job published since the team was made, and the stop that ends it.
    uint32_t seen = 0;
    int64_t resumed = now_ns();
    while (!stop.load(std::memory_order_acquire)) {
      const auto fresh = [&] {
        const uint32_t v = seq.load(std::memory_order_acquire);
        return v != seen && (v & 1u) == 0;
      };
      if (!spin_until(fresh)) {
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint32_t v = seq.load(std::memory_order_seq_cst);
        if ((v == seen || (v & 1u)) && !stop.load(std::memory_order_seq_cst)) futex_wait(&seq, v);
        sleepers.fetch_sub(1, std::memory_order_seq_cst);
        resumed = now_ns();
        continue;
      }
      if (stop.load(std::memory_order_acquire)) break;
      const uint32_t s = seq.load(std::memory_order_acquire);
      if (s & 1u) continue;
      RangeFn f = job_fn.load(std::memory_order_relaxed);
      const void* c = job_ctx.load(std::memory_order_relaxed);
      const int64_t b = job_begin.load(std::memory_order_relaxed), e = job_end.load(std::memory_order_relaxed);
      const int64_t ch = job_chunk.load(std::memory_order_relaxed), n = job_nchunks.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq.load(std::memory_order_relaxed) != s) continue;  // a newer job is being written: read again
      seen = s;
      work(s, b, e, ch, n, f, c, &resumed);
    }
  }

  const int nthreads;
  const uint64_t epoch;
  std::vector<std::thread> workers;
  alignas(64) std::atomic<uint32_t> seq{0};  // even: the current job's number; futex word of idle workers
  std::atomic<int> sleepers{0};
  std::atomic<bool> stop{false};
  std::atomic<RangeFn> job_fn{nullptr};
  std::atomic<const void*> job_ctx{nullptr};
  std::atomic<int64_t> job_begin{0}, job_end{0}, job_chunk{0}, job_nchunks{0};
  alignas(64) std::atomic<uint64_t> claim{0};  // (job number << 32) | next unclaimed chunk
  alignas(64) std::atomic<uint32_t> done{0};   // chunks finished; futex word of the waiting caller
  std::atomic<int> caller_waiting{0};
  std::mutex error_mu;
  std::exception_ptr error;
};

std::mutex team_mu;  // held by the one caller using the team (others run inline)
Team* team = nullptr;

void forget_team_in_child() {
  // NOTE: the workers do not exist in a forked child; the old Team is leaked, not destroyed (its
  // destructor would join threads that are gone). The mutex may have been held by another thread.
  team = nullptr;
  new (&team_mu) std::mutex();
}

Team* current_team(int n) {
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_team_in_child) == 0; }();
  (void)registered;
  if (team == nullptr || team->nthreads != n || team->epoch != tandem::bind_epoch()) {
    delete team;
    team = nullptr;
    uint64_t epoch = 0;
    const std::vector<int64_t> cpus = tandem::bound_cpus(&epoch);
    team = new Team(n, epoch, cpus);
  }
  return team;
}

}  // namespace

void run_parallel(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int n = (tls_in_team || at::in_parallel_region()) ? 1 : at::get_num_threads();
  const int64_t max_chunks = std::min<int64_t>(n * kChunksPerThread, (range + std::max<int64_t>(grain, 1) - 1) /
                                                                         std::max<int64_t>(grain, 1));
  if (n <= 1 || range <= grain || max_chunks <= 1) {
    fn(ctx, begin, end);
    return;
  }
  std::unique_lock<std::mutex> lock(team_mu, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread's kernel holds the team: run on this thread
    fn(ctx, begin, end);
    return;
  }
  const int64_t chunk = (range + max_chunks - 1) / max_chunks;
  const int64_t nchunks = (range + chunk - 1) / chunk;
  Team* t = current_team(n);
  tls_in_team = true;
  try {
    t->run(begin, end, chunk, nchunks, fn, ctx);
  } catch (...) {
    tls_in_team = false;
    throw;
  }
  tls_in_team = false;
}

}  // namespace tandem::avx2
