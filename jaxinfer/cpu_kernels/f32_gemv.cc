// Products of a few float32 activation rows with a float32 weight, for XLA CPU through the FFI:
//   jaxinfer_f32_gemv:   y[m, o] = sum_k x[m, k] w[k, o], the weight stored [I, O] (the
//                        layers' projections);
//   jaxinfer_f32_gemv_t: y[m, v] = sum_k x[m, k] w[v, k], the weight stored [O, I] (a tied
//                        LM head, the embedding table).
//
// Why: a speculative verification step runs the model on k + 1 = 2..8 rows. XLA CPU streams a
// float32 weight at one row (20-32 GB/s on the AMX box), but from two rows on it packs the
// weight first (9-12 GB/s), so a 5-row step cost 1.55 one-row steps where the weight reads
// alone say ~1.1. These kernels read each weight once, as stored, for all the rows.
//
// [I, O]: a block of 16 * NV output columns keeps M x NV accumulators in registers over KC
// weight rows at a time (between passes they wait in `out`), prefetching the same rows kAhead
// blocks ahead. Each output is one FMA chain over k = 0..I-1 in order, the order of XLA's
// one-row dot, so row m of the result has the bits XLA gives for x[m] alone.
// [O, I]: NR weight rows at a time are read as NR contiguous streams; each (row, m) pair has a
// 16-lane accumulator over k, summed across lanes at the end (not XLA's order: results agree
// to float32 rounding).
// The output columns are split between the caller and XLA's thread pool (gemv_split.h).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::run;
using jaxinfer_native::split_run;

namespace {

constexpr int kMaxRows = 8;
constexpr int64_t KC = 64;     // weight rows per pass over a column block ([I, O])
constexpr int64_t kAhead = 4;  // column blocks prefetched ahead ([I, O])
// How far ahead the [O, I] streams are prefetched, into L2. Measured on the AMX box (one
// thread, M = 5, the 113 MB SmolLM2 head, ns per weight row): none 260; into L1 1 / 4 / 8 / 16 /
// 32 / 64 KB ahead 211 / 214 / 174 / 169 / 165 / 182; into L2 16 / 64 KB ahead 151 / 163.
constexpr int64_t kAheadBytes = 16384;

bool have_avx512f() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

// ----------------------------------------------------------------------------- w [I, O]
constexpr int nv_io(int M) { return M <= 6 ? 4 : 3; }  // M * NV accumulators <= 24 registers

template <int M>
__attribute__((target("avx512f"))) void io_avx512(const float* x, const float* w, float* out, int64_t I,
                                                  int64_t O, int64_t c0, int64_t nb) {
  constexpr int NV = nv_io(M);
  constexpr int64_t CB = 16 * NV;
  for (int64_t k0 = 0; k0 < I; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * CB;
      __m512 acc[M][NV];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < NV; ++j)
          acc[m][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * O + o + 16 * j);
      // the same rows a few blocks ahead, or the next pass's rows near the end of this one
      // (a prefetch past the weight's end does not fault)
      const float* ahead = b + kAhead < nb ? w + o + CB * kAhead : w + (k1 - k0) * O + c0 + (b + kAhead - nb) * CB;
      for (int64_t k = k0; k < k1; ++k) {
        const float* row = w + k * O + o;
        for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * O + 16 * j), _MM_HINT_T0);
        __m512 wv[NV];
        for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_ps(row + 16 * j);
        for (int m = 0; m < M; ++m) {
          const __m512 xb = _mm512_set1_ps(x[m * I + k]);
          for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
        }
      }
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + m * O + o + 16 * j, acc[m][j]);
    }
  }
}

// Columns [o0, o1): the same FMA chain per output, one at a time.
void io_scalar(const float* x, const float* w, float* out, int64_t M, int64_t I, int64_t O, int64_t o0,
               int64_t o1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = o0; o < o1; ++o) {
      float s = 0.0f;
      for (int64_t k = 0; k < I; ++k) s = std::fma(x[m * I + k], w[k * O + o], s);
      out[m * O + o] = s;
    }
}

template <int M>
void run_io_m(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  constexpr int64_t CB = 16 * nv_io(M);
  const int64_t nb = have_avx512f() && j.I > 0 ? (j.c1 - j.c0) / CB : 0;
  if (nb) io_avx512<M>(x, w, out, j.I, j.O, j.c0, nb);
  io_scalar(x, w, out, M, j.I, j.O, j.c0 + nb * CB, j.c1);
}

// ----------------------------------------------------------------------------- w [O, I]
constexpr int nr_oi(int M) { return M <= 5 ? 4 : M <= 7 ? 3 : 2; }  // M * NR accumulators <= 24

template <int M>
__attribute__((target("avx512f"))) void oi_avx512(const float* x, const float* w, float* out, int64_t I,
                                                  int64_t O, int64_t r0, int64_t r1) {
  constexpr int NR = nr_oi(M);
  const int64_t kv = I / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (I % 16)) - 1);
  for (int64_t r = r0; r < r1; r += NR) {
    const float* rows = w + r * I;
    __m512 acc[NR][M];
    for (int i = 0; i < NR; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    for (int64_t v = 0; v < kv; ++v) {
      __m512 wv[NR];
      for (int i = 0; i < NR; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(rows + i * I + 16 * v) + kAheadBytes, _MM_HINT_T1);
        wv[i] = _mm512_loadu_ps(rows + i * I + 16 * v);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * I + 16 * v);
        for (int i = 0; i < NR; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
    if (tail) {  // I % 16 last input channels
      __m512 wv[NR];
      for (int i = 0; i < NR; ++i) wv[i] = _mm512_maskz_loadu_ps(tail, rows + i * I + 16 * kv);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * I + 16 * kv);
        for (int i = 0; i < NR; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int m = 0; m < M; ++m) out[m * O + r + i] = _mm512_reduce_add_ps(acc[i][m]);
  }
}

void oi_scalar(const float* x, const float* w, float* out, int64_t M, int64_t I, int64_t O, int64_t r0,
               int64_t r1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = r0; r < r1; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < I; ++k) s = std::fma(x[m * I + k], w[r * I + k], s);
      out[m * O + r] = s;
    }
}

template <int M>
void run_oi_m(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  constexpr int NR = nr_oi(M);
  const int64_t r1 = have_avx512f() ? j.c0 + (j.c1 - j.c0) / NR * NR : j.c0;
  if (r1 > j.c0) oi_avx512<M>(x, w, out, j.I, j.O, j.c0, r1);
  oi_scalar(x, w, out, M, j.I, j.O, r1, j.c1);
}

// ----------------------------------------------------------------------------- handlers
using RunFn = void (*)(const Job&);

template <int M>
struct IoFn {
  static constexpr RunFn fn = run_io_m<M>;
};
template <int M>
struct OiFn {
  static constexpr RunFn fn = run_oi_m<M>;
};

template <template <int> class F>
RunFn for_rows(int64_t M) {
  switch (M) {
    case 1: return F<1>::fn;
    case 2: return F<2>::fn;
    case 3: return F<3>::fn;
    case 4: return F<4>::fn;
    case 5: return F<5>::fn;
    case 6: return F<6>::fn;
    case 7: return F<7>::fn;
    case 8: return F<8>::fn;
    default: return nullptr;
  }
}

// transposed: w is [O, I] (else [I, O]). The split unit: whole column blocks for [I, O]
// (their width at this M), whole row groups for [O, I].
ffi::Error f32_gemv(bool transposed, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> out, int64_t threads, ffi::ThreadPool pool) {
  const char* what = transposed ? "f32_gemv_t" : "f32_gemv";
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t wi = transposed ? 1 : 0;
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[wi])
    return ffi::Error::InvalidArgument(std::string(what) + (transposed ? ": x must be [M, I] and w [O, I]"
                                                                       : ": x must be [M, I] and w [I, O]"));
  const int64_t M = xd[0], I = xd[1], O = wd[1 - wi];
  const RunFn fn = transposed ? for_rows<OiFn>(M) : for_rows<IoFn>(M);
  if (fn == nullptr) return ffi::Error::InvalidArgument(std::string(what) + ": 1 to 8 rows");
  const Job all{fn, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  const int64_t unit = transposed ? 16 * nr_oi(static_cast<int>(M)) : 16 * nv_io(static_cast<int>(M));
  if (threads > 1) {
    split_run(all, unit, pool);
  } else {
    run(all);
  }
  return ffi::Error::Success();
}

ffi::Error F32Gemv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                   int64_t threads, ffi::ThreadPool pool) {
  return f32_gemv(false, x, w, out, threads, pool);
}

ffi::Error F32GemvT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                    int64_t threads, ffi::ThreadPool pool) {
  return f32_gemv(true, x, w, out, threads, pool);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_f32_gemv, F32Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_f32_gemv_t, F32GemvT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());
