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
// [I, O]: a block of NV vectors of output columns keeps M x NV accumulators in registers over KC
// weight rows at a time (between passes they wait in `out`), prefetching the same rows kAhead
// blocks ahead. Each output is one FMA chain over k = 0..I-1 in order, the order of XLA's
// one-row dot, so row m of the result has the bits XLA gives for x[m] alone.
// [O, I]: NR weight rows at a time are read as NR contiguous streams; each (row, m) pair has a
// vector accumulator over k, summed across lanes at the end (not XLA's order: results agree
// to float32 rounding).
// The output columns are split between the caller and XLA's thread pool (gemv_split.h).
//
// Each has two vector variants, chosen per call by the handler's `isa` attribute (the Python
// side passes the best this CPU has, or what JAXINFER_NATIVE_ISA caps it to): AVX-512F (32 zmm
// registers, 16 lanes) and AVX2 + FMA (16 ymm registers, 8 lanes, so fewer accumulators per
// block) for the AMD EPYC boxes that have no AVX-512. In [I, O] both run the same FMA chain per
// output, so they give the same bits; columns or rows past the last whole block take the
// scalar loop (in [I, O], the same chain again).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::run;
using jaxinfer_native::split_run;

namespace {

constexpr int kMaxRows = 8;
constexpr int64_t KC = 64;     // weight rows per pass over a column block ([I, O], AVX-512)
constexpr int64_t kAhead = 4;  // column blocks prefetched ahead ([I, O], AVX-512)
// [I, O], AVX2: weight rows per pass, and columns prefetched ahead. Its blocks are 16-32
// columns, so a pass reads KC_AVX2 rows 64-128 bytes at a time; 64 such streams ran far below
// the AVX-512 variant. Measured on the AVX-512 box with AVX2 forced (2 threads, the 30 SmolLM2
// layers, M = 2 / 5 / 8, ms, 64 columns ahead): KC_AVX2 64: 24 / 33 / 42; 32: 19 / 25 / 27;
// 16: 19 / 22 / 24; 8: 21 / 24 / 27. Ahead 32 / 64 / 128 / 256 columns at KC_AVX2 16: about
// equal, 128 by a hair; none (at KC_AVX2 64): up to twice the time.
constexpr int64_t KC_AVX2 = 16;
constexpr int64_t kAheadColsAvx2 = 128;
// How far ahead the [O, I] streams are prefetched, into L2. Measured on the AMX box (one
// thread, M = 5, the 113 MB SmolLM2 head, ns per weight row): none 260; into L1 1 / 4 / 8 / 16 /
// 32 / 64 KB ahead 211 / 214 / 174 / 169 / 165 / 182; into L2 16 / 64 KB ahead 151 / 163.
constexpr int64_t kAheadBytes = 16384;

// The vector variant a call runs; the handler refuses one this CPU lacks (it would fault).
enum class Isa { kAvx2, kAvx512 };

bool cpu_has(Isa isa) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == Isa::kAvx512 ? avx512 : avx2;
}

// ----------------------------------------------------------------------------- w [I, O]
// AVX2 runs a block's rows in groups of at most 4 (5 rows: 3 + 2; 8: 4 + 4), the second group
// re-reading the weight rows the first just brought into L1, so a block can stay 2-4 vectors
// (whole cache lines) wide in 16 registers.
constexpr int group_avx2(int M) { return M <= 4 ? M : (M + 1) / 2; }

// Vectors per column block: the accumulators (rows x NV) stay in registers beside the NV weight
// vectors and the broadcast x value (AVX-512, 32 registers: M * NV <= 24; AVX2, 16: a group's
// rows * NV <= 12).
constexpr int nv_io(Isa isa, int M) {
  if (isa == Isa::kAvx512) return M <= 6 ? 4 : 3;
  return group_avx2(M) <= 2 ? 4 : 3;
}
constexpr int64_t io_cols(Isa isa, int M) { return (isa == Isa::kAvx512 ? 16 : 8) * nv_io(isa, M); }

template <int M>
__attribute__((target("avx512f"))) void io_avx512(const float* x, const float* w, float* out, int64_t I,
                                                  int64_t O, int64_t c0, int64_t nb) {
  constexpr int NV = nv_io(Isa::kAvx512, M);
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

// G rows of io_avx2's block at column o over weight rows [k0, k1) (the first group prefetches
// the rows at pf for the blocks to come).
template <int G, int NV, bool kPrefetch>
__attribute__((target("avx2,fma"), always_inline)) inline void io_avx2_rows(const float* x, const float* w,
                                                                          float* out, int64_t I, int64_t O,
                                                                          int64_t o, int64_t k0, int64_t k1,
                                                                          const float* pf) {
  constexpr int64_t CB = 8 * NV;
  __m256 acc[G][NV];
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < NV; ++j)
      acc[m][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * O + o + 8 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = w + k * O + o;
    if (kPrefetch)  // one per 64-byte line
      for (int64_t p = 0; p < CB; p += 16) _mm_prefetch(reinterpret_cast<const char*>(pf + k * O + p), _MM_HINT_T0);
    __m256 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm256_loadu_ps(row + 8 * j);
    for (int m = 0; m < G; ++m) {
      const __m256 xb = _mm256_set1_ps(x[m * I + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + m * O + o + 8 * j, acc[m][j]);
}

// io_avx512 in 8 lanes, with shorter passes and rows in groups: the same FMA chain per output,
// so the same bits.
template <int M>
__attribute__((target("avx2,fma"))) void io_avx2(const float* x, const float* w, float* out, int64_t I,
                                                 int64_t O, int64_t c0, int64_t nb) {
  constexpr int NV = nv_io(Isa::kAvx2, M);
  constexpr int G = group_avx2(M);
  constexpr int64_t CB = 8 * NV;
  constexpr int64_t ahead = (kAheadColsAvx2 + CB - 1) / CB;  // blocks
  for (int64_t k0 = 0; k0 < I; k0 += KC_AVX2) {
    const int64_t k1 = std::min(k0 + KC_AVX2, I);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * CB;
      const float* pf = b + ahead < nb ? w + o + CB * ahead : w + (k1 - k0) * O + c0 + (b + ahead - nb) * CB;
      io_avx2_rows<G, NV, true>(x, w, out, I, O, o, k0, k1, pf);
      if constexpr (M > G) io_avx2_rows<M - G, NV, false>(x + G * I, w, out + G * O, I, O, o, k0, k1, pf);
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

template <int M, Isa A>
void run_io_m(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  constexpr int64_t CB = io_cols(A, M);
  const int64_t nb = j.I > 0 ? (j.c1 - j.c0) / CB : 0;
  if (nb && A == Isa::kAvx512) io_avx512<M>(x, w, out, j.I, j.O, j.c0, nb);
  if (nb && A == Isa::kAvx2) io_avx2<M>(x, w, out, j.I, j.O, j.c0, nb);
  io_scalar(x, w, out, M, j.I, j.O, j.c0 + nb * CB, j.c1);
}

// ----------------------------------------------------------------------------- w [O, I]
// Weight rows at a time: NR * M accumulators (AVX-512: <= 24 of 32 registers; AVX2: <= 12 of 16).
constexpr int nr_oi(Isa isa, int M) {
  if (isa == Isa::kAvx512) return M <= 5 ? 4 : M <= 7 ? 3 : 2;
  return M <= 2 ? 4 : M <= 4 ? 3 : M <= 6 ? 2 : 1;
}

template <int M>
__attribute__((target("avx512f"))) void oi_avx512(const float* x, const float* w, float* out, int64_t I,
                                                  int64_t O, int64_t r0, int64_t r1) {
  constexpr int NR = nr_oi(Isa::kAvx512, M);
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

__attribute__((target("avx2,fma"))) inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// oi_avx512 in 8 lanes.
template <int M>
__attribute__((target("avx2,fma"))) void oi_avx2(const float* x, const float* w, float* out, int64_t I,
                                                 int64_t O, int64_t r0, int64_t r1) {
  constexpr int NR = nr_oi(Isa::kAvx2, M);
  const int64_t kv = I / 8;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(I % 8)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t r = r0; r < r1; r += NR) {
    const float* rows = w + r * I;
    __m256 acc[NR][M];
    for (int i = 0; i < NR; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (int64_t v = 0; v < kv; ++v) {
      __m256 wv[NR];
      for (int i = 0; i < NR; ++i) {
        // once per 64-byte line (four 113 MB heads, M = 1 / 2 / 5 / 8, 2 threads: 16 / 17 / 18 /
        // 21 ms, against 18 / 20 / 22 / 24 with one per vector)
        if (v % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows + i * I + 8 * v) + kAheadBytes, _MM_HINT_T1);
        wv[i] = _mm256_loadu_ps(rows + i * I + 8 * v);
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * I + 8 * v);
        for (int i = 0; i < NR; ++i) acc[i][m] = _mm256_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
    if (I % 8) {  // the last input channels; masked-off lanes are neither read nor faulted
      __m256 wv[NR];
      for (int i = 0; i < NR; ++i) wv[i] = _mm256_maskload_ps(rows + i * I + 8 * kv, tail);
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_maskload_ps(x + m * I + 8 * kv, tail);
        for (int i = 0; i < NR; ++i) acc[i][m] = _mm256_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int m = 0; m < M; ++m) out[m * O + r + i] = reduce_add(acc[i][m]);
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

template <int M, Isa A>
void run_oi_m(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  constexpr int NR = nr_oi(A, M);
  const int64_t r1 = j.c0 + (j.c1 - j.c0) / NR * NR;
  if (r1 > j.c0 && A == Isa::kAvx512) oi_avx512<M>(x, w, out, j.I, j.O, j.c0, r1);
  if (r1 > j.c0 && A == Isa::kAvx2) oi_avx2<M>(x, w, out, j.I, j.O, j.c0, r1);
  oi_scalar(x, w, out, M, j.I, j.O, r1, j.c1);
}

// ----------------------------------------------------------------------------- handlers
using RunFn = void (*)(const Job&);

template <int M, Isa A>
RunFn kernel(bool transposed) {
  return transposed ? run_oi_m<M, A> : run_io_m<M, A>;
}

template <int M>
RunFn kernel(bool transposed, Isa isa) {
  return isa == Isa::kAvx512 ? kernel<M, Isa::kAvx512>(transposed) : kernel<M, Isa::kAvx2>(transposed);
}

RunFn kernel_for(bool transposed, Isa isa, int64_t M) {
  switch (M) {
    case 1: return kernel<1>(transposed, isa);
    case 2: return kernel<2>(transposed, isa);
    case 3: return kernel<3>(transposed, isa);
    case 4: return kernel<4>(transposed, isa);
    case 5: return kernel<5>(transposed, isa);
    case 6: return kernel<6>(transposed, isa);
    case 7: return kernel<7>(transposed, isa);
    case 8: return kernel<8>(transposed, isa);
    default: return nullptr;
  }
}

// transposed: w is [O, I] (else [I, O]). isa: "avx512" or "avx2", which this CPU must have.
// The split unit: whole column blocks for [I, O] (their width at this M and isa), whole row
// groups for [O, I].
ffi::Error f32_gemv(bool transposed, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> out, int64_t threads, std::string_view isa_name,
                    ffi::ThreadPool pool) {
  const std::string what = transposed ? "f32_gemv_t" : "f32_gemv";
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t wi = transposed ? 1 : 0;
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[wi])
    return ffi::Error::InvalidArgument(what + (transposed ? ": x must be [M, I] and w [O, I]"
                                                          : ": x must be [M, I] and w [I, O]"));
  if (isa_name != "avx512" && isa_name != "avx2")
    return ffi::Error::InvalidArgument(what + ": isa must be avx512 or avx2");
  const Isa isa = isa_name == "avx512" ? Isa::kAvx512 : Isa::kAvx2;
  if (!cpu_has(isa)) return ffi::Error::InvalidArgument(what + ": this CPU lacks " + std::string(isa_name));
  const int64_t M = xd[0], I = xd[1], O = wd[1 - wi];
  const RunFn fn = kernel_for(transposed, isa, M);
  if (fn == nullptr) return ffi::Error::InvalidArgument(what + ": 1 to 8 rows");
  const Job all{fn, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  const int m = static_cast<int>(M);
  const int64_t unit = transposed ? 16 * nr_oi(isa, m) : io_cols(isa, m);
  if (threads > 1) {
    split_run(all, unit, pool);
  } else {
    run(all);
  }
  return ffi::Error::Success();
}

ffi::Error F32Gemv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                   int64_t threads, std::string_view isa, ffi::ThreadPool pool) {
  return f32_gemv(false, x, w, out, threads, isa, pool);
}

ffi::Error F32GemvT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                    int64_t threads, std::string_view isa, ffi::ThreadPool pool) {
  return f32_gemv(true, x, w, out, threads, isa, pool);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_f32_gemv, F32Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<std::string_view>("isa")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_f32_gemv_t, F32GemvT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<std::string_view>("isa")
                                  .Ctx<ffi::ThreadPool>());
