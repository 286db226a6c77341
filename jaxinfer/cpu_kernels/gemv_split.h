// The N-thread split shared by the native kernels: a call's output columns (or rows, or work
// items) are cut into `parts` contiguous ranges of whole units, one per thread. The caller runs
// the first range and offers the others to XLA's own intra-op thread pool (the FFI's ThreadPool
// context, which XLA sizes to the cores this process may run on).
//
// Each thread keeps one contiguous stretch of the output, so it streams its own stripe of the
// weight and writes its own columns: no two threads touch one cache line of the output except at
// the boundaries, and no boundary cuts a unit (a kernel's column block), so every output is
// computed by the same code path, in the same order, whatever the number of threads: the results
// are the same bits at 1, 2 or 32 threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer_native {

namespace ffi = xla::ffi;

struct Job {
  void (*fn)(const struct Job&);
  const void* x;
  const void* w;
  void* out;
  int64_t M, I, O, c0, c1;  // output columns [c0, c1) of out [M, O]
  int64_t parts = 1;        // how many ranges the call was cut into (paged_attention's item order)
};

inline void run(const Job& j) { j.fn(j); }

// A range needs at least this many units to be worth a thread of its own (a task handed to the
// pool costs a few microseconds); at 2 threads a call splits from 8 units on.
constexpr int64_t kMinUnitsPerPart = 4;

// How many ranges `width` columns in units of `unit` are cut into for `threads` threads.
inline int64_t split_parts(int64_t width, int64_t unit, int64_t threads) {
  const int64_t units = unit > 0 ? width / unit : 0;
  return std::max<int64_t>(1, std::min<int64_t>(threads, units / kMinUnitsPerPart));
}

// Range k of `parts`: [*c0, *c1) of [0, width). The whole units are shared out as evenly as they
// go, the first ranges one more where they do not divide; the last range also takes any columns
// past the last whole unit (a kernel's tail, which its scalar loop finishes).
inline void part_bounds(int64_t width, int64_t unit, int64_t parts, int64_t k, int64_t* c0, int64_t* c1) {
  const int64_t units = width / unit, base = units / parts, extra = units % parts;
  *c0 = unit * (k * base + std::min(k, extra));
  *c1 = k + 1 == parts ? width : *c0 + unit * (base + (k < extra ? 1 : 0));
}

// One offered range. Whoever claims it first runs it: a pool thread, or the caller once its own
// range is done (so a caller never waits on a queue that a busy pool may not drain: two kernels
// running at once, or more ranges than pool threads, cannot deadlock).
struct Offer {
  Job job;
  std::atomic<int> state{0};  // 0 open, 1 claimed by the pool, 2 claimed by the caller
  std::atomic<bool> done{false};
};

// The ranges this library's calls have been cut into so far (a call on one thread: one), for
// jaxinfer_split_count.
inline std::atomic<int64_t> ranges_cut{0};

// Runs `all` (columns [all.c0, all.c1)) on up to `threads` threads, cut as split_parts and
// part_bounds say.
inline void split_run(Job all, int64_t unit, int64_t threads, ffi::ThreadPool pool) {
  const int64_t base = all.c0, width = all.c1 - all.c0;
  const int64_t parts = threads > 1 && pool.num_threads() >= 1 ? split_parts(width, unit, threads) : 1;
  ranges_cut.fetch_add(parts, std::memory_order_relaxed);
  if (parts == 1) {
    run(all);
    return;
  }
  all.parts = parts;
  // Shared with the pool's tasks, which may run after this call has returned (and then find
  // their range claimed).
  std::shared_ptr<Offer[]> offers(new Offer[parts - 1]);
  for (int64_t k = 1; k < parts; ++k) {
    Offer& o = offers[k - 1];
    o.job = all;
    part_bounds(width, unit, parts, k, &o.job.c0, &o.job.c1);
    o.job.c0 += base;
    o.job.c1 += base;
  }
  for (int64_t k = 1; k < parts; ++k) {
    pool.Schedule([offers, k] {
      Offer& o = offers[k - 1];
      int open = 0;
      if (o.state.compare_exchange_strong(open, 1, std::memory_order_acq_rel)) {
        run(o.job);
        o.done.store(true, std::memory_order_release);
      }
    });
  }
  Job first = all;
  part_bounds(width, unit, parts, 0, &first.c0, &first.c1);
  first.c0 += base;
  first.c1 += base;
  run(first);
  // The ranges no pool thread has taken yet, last first (the pool starts from the first).
  for (int64_t k = parts - 1; k >= 1; --k) {
    Offer& o = offers[k - 1];
    int open = 0;
    if (o.state.compare_exchange_strong(open, 2, std::memory_order_acq_rel)) run(o.job);
  }
  for (int64_t k = 1; k < parts; ++k) {
    const Offer& o = offers[k - 1];
    if (o.state.load(std::memory_order_acquire) == 1)
      while (!o.done.load(std::memory_order_acquire)) _mm_pause();
  }
}

}  // namespace jaxinfer_native

// The ranges split_run cuts `width` columns in units of `unit` into for `threads` threads (where
// XLA's pool has a thread): writes parts + 1 bounds (range k is [bounds[k], bounds[k + 1])) and
// returns parts; bounds must hold threads + 1 values. Each library carries its own copy.
extern "C" __attribute__((used, visibility("default"))) inline int64_t jaxinfer_split_plan(int64_t width, int64_t unit,
                                                                                          int64_t threads,
                                                                                          int64_t* bounds) {
  const int64_t parts = jaxinfer_native::split_parts(width, unit, threads);
  for (int64_t k = 0; k < parts; ++k) jaxinfer_native::part_bounds(width, unit, parts, k, &bounds[k], &bounds[k + 1]);
  return parts;
}

// How many ranges this library's calls have been cut into so far in this process.
extern "C" __attribute__((used, visibility("default"))) inline int64_t jaxinfer_split_count() {
  return jaxinfer_native::ranges_cut.load(std::memory_order_relaxed);
}
