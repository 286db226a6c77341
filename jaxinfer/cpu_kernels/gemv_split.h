// The two-core split shared by the native kernels (int8_gemv.cc, f32_gemv.cc): a call's
// output columns are cut in two, the caller runs the first part and offers the second to
// XLA's own intra-op thread pool (the FFI's ThreadPool context).
#pragma once

#include <immintrin.h>

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
};

inline void run(const Job& j) { j.fn(j); }

// The second part of a split call, offered to XLA's intra-op thread pool. Whoever claims it
// first runs it: a pool thread, or the caller once its own part is done (so a caller never
// waits on a queue that a busy pool may not drain: two gemvs running at once cannot deadlock).
struct Offer {
  Job job;
  std::atomic<int> state{0};  // 0 open, 1 claimed by the pool, 2 claimed by the caller
  std::atomic<bool> done{false};
};

// Columns [0, O) of `all`: the caller takes the larger part (and any tail past the last whole
// unit); the rest, when there are at least 8 units, is offered to the pool.
inline void split_run(Job all, int64_t unit, ffi::ThreadPool pool) {
  const int64_t units = all.O / unit;
  if (units < 8 || pool.num_threads() < 1) {
    run(all);
    return;
  }
  const int64_t split = unit * ((units + 1) / 2);
  auto offer = std::make_shared<Offer>();
  offer->job = all;
  offer->job.c0 = split;
  offer->job.c1 = units * unit;
  pool.Schedule([offer] {
    int open = 0;
    if (offer->state.compare_exchange_strong(open, 1, std::memory_order_acq_rel)) {
      run(offer->job);
      offer->done.store(true, std::memory_order_release);
    }
  });
  Job first = all;
  first.c1 = split;
  run(first);
  if (units * unit < all.O) {
    Job tail = all;
    tail.c0 = units * unit;
    run(tail);
  }
  int open = 0;
  if (offer->state.compare_exchange_strong(open, 2, std::memory_order_acq_rel)) {
    run(offer->job);  // no pool thread took it yet
  } else {
    while (!offer->done.load(std::memory_order_acquire)) _mm_pause();
  }
}

}  // namespace jaxinfer_native
