// Paged attention of decode rows for XLA CPU through the FFI: each row's few queries against
// the pages its page-table row names, read where they lie in the pool.
//   jaxinfer_paged_rows: float32 pools;
//   jaxinfer_paged_rows_i8: int8 pools with one float32 scale per (page, KV head, position).
//
// Why: XLA CPU runs the packed step's reference reader (models/packed.py, paged_rows_attention)
// by gathering a block of pages per group of rows, transposing it and folding it into a running
// softmax. On the AMX box that reads the keys and values at 5-7 GB/s and is three quarters of a
// 64-row w8a8 decode step (benchmarks/RESULTS.md, "Native attention kernels"), as slow over
// int8 pages as over float32 ones: the gathers, transposes and per-block work bind it, not the
// bytes.
//
// Here one work item is one (row, KV head): its T x G queries (T query tokens, G query heads
// per KV head) walk the row's pages in order. A page's keys [H, ps] (transposed, as the pools
// store them) give every query's ps scores as H multiply-adds of ps-wide vectors; the values
// [ps, H] are added into per-query accumulators of H floats, with the running softmax (max, sum)
// kept per query as the reference keeps it per block. The page stays in L1 for all the item's
// queries, so each page is read from memory once. Positions at or past the row's end, after a
// query's own position, or outside its window are never read into a sum (stale or NaN pages
// cannot leak), and a query that sees nothing gives 0, as in the reference.
//
// The loops are plain C++ written for the compiler's vectorizer (ps-wide and H-wide inner
// loops, an exp by range reduction and a polynomial), compiled once per vector variant
// (AVX-512 and AVX2 + FMA, as f32_gemv.cc). Items are split between the caller and XLA's
// thread pool (gemv_split.h), dealt round-robin (of n threads, one takes items 0, n, 2n, ..., the
// next 1, n + 1, ...), so long and short rows mix.
// Results equal the reference to float32 rounding (the sums run in another order).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"  // v16 values never cross a call: all inlined

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::split_run;

namespace {

constexpr float kNeg = -1e30f;  // the reference's masked score: finite
constexpr int64_t kMaxPage = 64;  // positions per page this kernel takes

struct Rows {
  const float* q;  // [B, T, N, H]
  const void* k;   // [P, K, H, ps] float32 or int8
  const void* v;   // [P, K, ps, H]
  const float* ks;  // [P, K, ps] (int8 pools) or null
  const float* vs;
  const int32_t* table;  // [B, n]
  const int32_t* base;   // [B] logical page of column 0
  const int32_t* qpos;   // [B, T]
  const int32_t* end;    // [B] positions < end are written
  float* out;            // [B, T, N, H]
  int64_t B, T, N, K, H, ps, P, n, window;  // window 0: none
  float scale, softcap;                      // softcap 0: none
};

struct Prefill {
  const float* q;    // [T, N, H]
  const float* k;    // [T, K, H] the row's own keys and values
  const float* v;
  const int32_t* pos;  // [T]
  const int32_t* seg;  // [T] segment, -1: padding (last)
  const void* kp;      // pools [P, K, H, ps] and [P, K, ps, H]: segment 0's history
  const void* vp;
  const float* ks;  // [P, K, ps] (int8 pools) or null
  const float* vs;
  const int32_t* table;  // [n] segment 0's pages, column c holding logical page base0 + c
  float* out;            // [T, N, H]
  int64_t T, N, K, H, ps, P, n, base0, hist_end, window, valid;  // valid: tokens before the padding
  float scale, softcap;
};

// Each vector variant compiles the kernel body (paged_attention_body.h) for its instructions.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
namespace avx512 {
constexpr bool kAvx512 = true;
#include "paged_attention_body.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr bool kAvx512 = false;
#include "paged_attention_body.h"
}  // namespace avx2
#pragma GCC pop_options

bool cpu_has(std::string_view isa) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "avx512" ? avx512 : isa == "avx2" ? avx2 : false;
}

template <bool int8>
ffi::Error paged_rows(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs, ffi::Buffer<ffi::S32> table,
                      ffi::Buffer<ffi::S32> base, ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S32> end,
                      ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window,
                      int64_t threads, std::string_view isa, ffi::ThreadPool pool) {
  const std::string what = int8 ? "paged_rows_i8" : "paged_rows";
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument(what + ": q [B, T, N, H], pools [P, K, H, ps] and [P, K, ps, H], table [B, n]");
  const auto want = int8 ? ffi::DataType::S8 : ffi::DataType::F32;
  if (k.element_type() != want || v.element_type() != want)
    return ffi::Error::InvalidArgument(what + (int8 ? ": pools must be int8" : ": pools must be float32"));
  Rows r{q.typed_data(), k.untyped_data(), v.untyped_data(), int8 ? ks.typed_data() : nullptr,
         int8 ? vs.typed_data() : nullptr, table.typed_data(), base.typed_data(), qpos.typed_data(),
         end.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[1], qd[3], kd[3], kd[0], td[1],
         window, scale, softcap};
  if (kd[2] != r.H || vd[0] != r.P || vd[1] != r.K || vd[2] != r.ps || vd[3] != r.H || td[0] != r.B ||
      r.K < 1 || r.N % r.K != 0)
    return ffi::Error::InvalidArgument(what + ": shapes of q, pools and table disagree");
  if (r.ps > kMaxPage) return ffi::Error::InvalidArgument(what + ": at most 64 positions per page");
  if (int8 && (ks.element_count() != static_cast<size_t>(r.P * r.K * r.ps) ||
               vs.element_count() != static_cast<size_t>(r.P * r.K * r.ps)))
    return ffi::Error::InvalidArgument(what + ": scales must be [P, K, ps]");
  if (base.element_count() != static_cast<size_t>(r.B) || end.element_count() != static_cast<size_t>(r.B) ||
      qpos.element_count() != static_cast<size_t>(r.B * r.T))
    return ffi::Error::InvalidArgument(what + ": base and end must be [B], qpos [B, T]");
  if (!cpu_has(isa)) return ffi::Error::InvalidArgument(what + ": this CPU lacks " + std::string(isa));
  void (*fn)(const Job&) = isa == "avx512" ? (int8 ? avx512::run_i8 : avx512::run_f32)
                                           : (int8 ? avx2::run_i8 : avx2::run_f32);
  const Job all{fn, &r, nullptr, nullptr, 0, 0, r.B, 0, r.B};  // one item per row
  split_run(all, 1, threads, pool);
  return ffi::Error::Success();
}

template <bool int8>
ffi::Error prefill_row(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                       ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> seg, ffi::AnyBuffer kp, ffi::AnyBuffer vp,
                       ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs, ffi::Buffer<ffi::S32> table,
                       ffi::Buffer<ffi::S32> hist, ffi::ResultBuffer<ffi::F32> out, float scale, float softcap,
                       int64_t window, int64_t threads, std::string_view isa, ffi::ThreadPool pool) {
  const std::string what = int8 ? "prefill_row_i8" : "prefill_row";
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = kp.dimensions(), vd = vp.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument(what + ": q [T, N, H], k and v [T, K, H], pools [P, K, H, ps] and [P, K, ps, H]");
  const auto want = int8 ? ffi::DataType::S8 : ffi::DataType::F32;
  if (kp.element_type() != want || vp.element_type() != want)
    return ffi::Error::InvalidArgument(what + (int8 ? ": pools must be int8" : ": pools must be float32"));
  const int64_t T = qd[0], N = qd[1], H = qd[2], K = kd[1], P = pd[0], ps = pd[3];
  if (kd[0] != T || kd[2] != H || v.element_count() != k.element_count() || pd[1] != K || pd[2] != H || vd[0] != P || vd[1] != K ||
      vd[2] != ps || vd[3] != H || K < 1 || N % K != 0 || pos.element_count() != static_cast<size_t>(T) ||
      seg.element_count() != static_cast<size_t>(T) || hist.element_count() != 2)
    return ffi::Error::InvalidArgument(what + ": shapes of q, k, v, pos, seg and pools disagree");
  if (T % 16 != 0 || H % 16 != 0 || ps % 16 != 0)
    return ffi::Error::InvalidArgument(what + ": the row, head dim and page size must be multiples of 16");
  if (int8 && (ks.element_count() != static_cast<size_t>(P * K * ps) ||
               vs.element_count() != static_cast<size_t>(P * K * ps)))
    return ffi::Error::InvalidArgument(what + ": scales must be [P, K, ps]");
  if (!cpu_has(isa)) return ffi::Error::InvalidArgument(what + ": this CPU lacks " + std::string(isa));
  int64_t valid = 0;
  while (valid < T && seg.typed_data()[valid] >= 0) ++valid;
  Prefill r{q.typed_data(), k.typed_data(), v.typed_data(), pos.typed_data(), seg.typed_data(), kp.untyped_data(),
            vp.untyped_data(), int8 ? ks.typed_data() : nullptr, int8 ? vs.typed_data() : nullptr,
            table.typed_data(), out->typed_data(), T, N, K, H, ps, P,
            static_cast<int64_t>(table.element_count()), hist.typed_data()[0], hist.typed_data()[1], window, valid,
            scale, softcap};
  void (*fn)(const Job&) = isa == "avx512" ? (int8 ? avx512::prefill_i8 : avx512::prefill_f32)
                                           : (int8 ? avx2::prefill_i8 : avx2::prefill_f32);
  const int64_t items = T / 16 * K;
  const Job all{fn, &r, nullptr, nullptr, 0, 0, items, 0, items};
  split_run(all, 1, threads, pool);
  return ffi::Error::Success();
}

}  // namespace

// Both kernels return float32 [.., N, H] and take the same attributes.
#define JAXINFER_ATTENTION_TAIL      \
  Ret<ffi::Buffer<ffi::F32>>()       \
      .Attr<float>("scale")          \
      .Attr<float>("softcap")        \
      .Attr<int64_t>("window")       \
      .Attr<int64_t>("threads")      \
      .Attr<std::string_view>("isa") \
      .Ctx<ffi::ThreadPool>()

// q, pools k and v (float32 or int8), their scales, table, base, qpos, end
#define JAXINFER_PAGED_ROWS_BINDING        \
  ffi::Ffi::Bind()                         \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .JAXINFER_ATTENTION_TAIL

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_paged_rows, paged_rows<false>, JAXINFER_PAGED_ROWS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_paged_rows_i8, paged_rows<true>, JAXINFER_PAGED_ROWS_BINDING);

// q, the row's own k and v, pos, seg, pools (float32 or int8), their scales, table, (base0, hist_end)
#define JAXINFER_PREFILL_ROW_BINDING       \
  ffi::Ffi::Bind()                         \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::AnyBuffer>()               \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .JAXINFER_ATTENTION_TAIL

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_prefill_row, prefill_row<false>, JAXINFER_PREFILL_ROW_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_prefill_row_i8, prefill_row<true>, JAXINFER_PREFILL_ROW_BINDING);
