// Products of a few float32 activation rows with a float32 weight, for XLA CPU through the FFI:
//   jaxinfer_f32_gemv:   y[m, o] = sum_k x[m, k] w[k, o], the weight stored [I, O] (the
//                        layers' projections);
//   jaxinfer_f32_gemv_t: y[m, v] = sum_k x[m, k] w[v, k], the weight stored [O, I] (a tied
//                        LM head, the embedding table);
//   jaxinfer_f32_gemm_packed: y[m, o] = sum_k x[m, k] w[k, o] for any number of rows, the
//                        weight packed once into panels of 16 columns (below, "packed").
//
// Why: a speculative verification step runs the model on k + 1 = 2..8 rows, a small decode batch
// on up to 16. XLA CPU streams a float32 weight at one row (20-32 GB/s on the AMX box), but from
// two rows on it packs the weight first (9-12 GB/s), so a 5-row step cost 1.55 one-row steps
// where the weight reads alone say ~1.1. These kernels read each weight once, as stored, for
// all the rows (in groups of rows, below).
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
// side passes the best this CPU has, or the variant a caller names): AVX-512F (32 zmm
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
#include <type_traits>

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::run;
using jaxinfer_native::split_run;

namespace {

constexpr int kMaxRows = 16;    // f32_gemv's rows
constexpr int kMaxGroups = 64;  // row groups per call: f32_gemm_packed's 512 rows, in groups of 8
// [I, O]: weight rows per pass over a column block. A pass reads KC rows 64-256 bytes at a time
// (one block), prefetching the same rows a few blocks ahead. Measured on the AVX-512 box with
// AVX2 forced (2 threads, the 30 SmolLM2 layers, M = 2 / 5 / 8, ms, 64 columns ahead): KC 64:
// 24 / 33 / 42; 32: 19 / 25 / 27; 16: 19 / 22 / 24; 8: 21 / 24 / 27. With AVX-512, KC 64 -> 16:
// M = 1 / 2 / 5 / 8 23.0 / 23.0 / 24.7 / 29.7 -> 18.6 / 18.3 / 21.2 / 23.9 ms.
constexpr int64_t KC = 16;
// Columns prefetched ahead ([I, O]). At KC 16, 32 / 64 / 128 / 256 were about equal (AVX2),
// 128 by a hair; none (at KC 64): up to twice the time.
constexpr int64_t kAheadCols = 128;
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

// Rows run in groups small enough that a group's accumulators stay in registers beside the
// weight vectors and one broadcast or x vector; every group after the first re-reads, from L1,
// the weight the first just brought in, so the weight streams from memory once for all rows.
// Groups are as even as possible (10 rows: 5 + 5; AVX2 [I, O], 5 rows: 3 + 2).
struct Groups {
  int n, size[kMaxGroups];
};

constexpr int max_group(Isa isa) { return isa == Isa::kAvx512 ? 8 : 4; }

Groups groups_of(Isa isa, int M) {
  const int g = max_group(isa);
  Groups out{(M + g - 1) / g, {}};
  for (int i = 0, left = M; i < out.n; ++i) {
    out.size[i] = (left + (out.n - i) - 1) / (out.n - i);
    left -= out.size[i];
  }
  return out;
}

// [I, O]: vectors per column block for groups of up to G rows (AVX-512, 32 registers: G * NV
// <= 24; AVX2, 16: G * NV <= 12).
constexpr int nv_io(Isa isa, int G) {
  if (isa == Isa::kAvx512) return G <= 6 ? 4 : 3;
  return G <= 2 ? 4 : 3;
}
constexpr int64_t lanes(Isa isa) { return isa == Isa::kAvx512 ? 16 : 8; }

// [O, I]: weight rows at a time for groups of up to G rows: NR * G accumulators (AVX-512: <= 24
// of 32 registers; AVX2: <= 12 of 16).
constexpr int nr_oi(Isa isa, int G) {
  if (isa == Isa::kAvx512) return G <= 5 ? 4 : G <= 7 ? 3 : 2;
  return G <= 2 ? 4 : G <= 4 ? 3 : G <= 6 ? 2 : 1;
}

// ----------------------------------------------------------------------------- w [I, O]
// G rows of the block at column o over weight rows [k0, k1): each output one FMA chain over k
// (the accumulators wait in `out` between passes). The first group prefetches the rows at pf
// for the blocks to come. kPacked: w is packed in panels [O / 16, I, 16] instead (below).
template <int G, int NV, bool kPrefetch, bool kPacked = false>
__attribute__((target("avx512f"))) void io_rows_avx512(const float* x, const float* w, float* out, int64_t I,
                                                       int64_t O, int64_t o, int64_t k0, int64_t k1,
                                                       const float* pf) {
  __m512 acc[G][NV];
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < NV; ++j)
      acc[m][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * O + o + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = w + k * O + o;
    if (kPrefetch && !kPacked)
      for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + k * O + 16 * j), _MM_HINT_T0);
    if (kPrefetch && kPacked)  // this block's panels, 32 rows ahead
      for (int j = 0; j < NV; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + ((o / 16 + j) * I + k + 32) * 16), _MM_HINT_T0);
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j)
      wv[j] = kPacked ? _mm512_loadu_ps(w + ((o / 16 + j) * I + k) * 16) : _mm512_loadu_ps(row + 16 * j);
    for (int m = 0; m < G; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * I + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + m * O + o + 16 * j, acc[m][j]);
}

// The same in 8 lanes: the same FMA chain per output, so the same bits.
template <int G, int NV, bool kPrefetch>
__attribute__((target("avx2,fma"))) void io_rows_avx2(const float* x, const float* w, float* out, int64_t I,
                                                      int64_t O, int64_t o, int64_t k0, int64_t k1,
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

using IoRows = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        const float*);

template <Isa A, int G, int NV, bool P>
constexpr IoRows io_rows() {
  if constexpr (A == Isa::kAvx512)
    return io_rows_avx512<G, NV, P>;
  else
    return io_rows_avx2<G, NV, P>;
}

// pick(std::integral_constant<int, G>) for a run-time group size G: 1..8 with AVX-512, 1..4
// with AVX2 (max_group); anything else gives a null function.
template <Isa A, typename Pick>
auto for_group(int G, Pick pick) {
  using Fn = decltype(pick(std::integral_constant<int, 1>{}));
  switch (G) {
    case 1: return pick(std::integral_constant<int, 1>{});
    case 2: return pick(std::integral_constant<int, 2>{});
    case 3: return pick(std::integral_constant<int, 3>{});
    case 4: return pick(std::integral_constant<int, 4>{});
    case 5: if constexpr (A == Isa::kAvx512) return pick(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (A == Isa::kAvx512) return pick(std::integral_constant<int, 6>{}); break;
    case 7: if constexpr (A == Isa::kAvx512) return pick(std::integral_constant<int, 7>{}); break;
    case 8: if constexpr (A == Isa::kAvx512) return pick(std::integral_constant<int, 8>{}); break;
  }
  return Fn{nullptr};
}

template <Isa A, bool P>
IoRows io_rows_for(int G, int nv) {
  return for_group<A>(G, [nv](auto g) {
    constexpr int kG = decltype(g)::value;
    return nv == 4 ? io_rows<A, kG, 4, P>() : io_rows<A, kG, 3, P>();
  });
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

int64_t io_cols(Isa isa, int M) { return lanes(isa) * nv_io(isa, groups_of(isa, M).size[0]); }

template <Isa A>
void run_io(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const int M = static_cast<int>(j.M);
  const Groups g = groups_of(A, M);
  const int nv = nv_io(A, g.size[0]);  // the first group is the largest
  const int64_t CB = lanes(A) * nv, I = j.I, O = j.O, c0 = j.c0;
  const int64_t nb = I > 0 ? (j.c1 - c0) / CB : 0;
  IoRows first = io_rows_for<A, true>(g.size[0], nv), rest[kMaxGroups] = {};
  for (int i = 1; i < g.n; ++i) rest[i] = io_rows_for<A, false>(g.size[i], nv);
  const int64_t ahead = (kAheadCols + CB - 1) / CB;  // blocks
  for (int64_t k0 = 0; k0 < I && nb; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * CB;
      // the same rows a few blocks ahead, or the next pass's rows near the end of this one (a
      // prefetch past the weight's end does not fault)
      const float* pf = b + ahead < nb ? w + o + CB * ahead : w + (k1 - k0) * O + c0 + (b + ahead - nb) * CB;
      first(x, w, out, I, O, o, k0, k1, pf);
      for (int i = 1, m0 = g.size[0]; i < g.n; m0 += g.size[i++])
        rest[i](x + m0 * I, w, out + m0 * O, I, O, o, k0, k1, pf);
    }
  }
  io_scalar(x, w, out, M, I, O, c0 + nb * CB, j.c1);
}

// ----------------------------------------------------------------------------- packed
// f32_gemm_packed: the weight packed once, at load, into panels of 16 columns [O / 16, I, 16]
// (cpu_kernels.f32_pack), for any number of rows up to 512 (AVX-512 only). XLA CPU transposes
// (packs) a float32 weight for its dot on every call, at every row count past one: in a 64-row
// float32 decode step ynn::transpose_* took a third as many samples as the dot itself. Here a
// block of 48 columns is three contiguous panel streams (a last block may have one or two);
// each group of up to 8 rows sums the block's whole K with its 8 x 3 accumulators in
// registers, the first group streaming the panels from memory (prefetching 32 rows ahead in
// each) and the others re-reading them from L2 (I x 48 floats: 110 KB at I = 576). Each
// output is one FMA chain over k in order, as in run_io, so row m has the bits of XLA's
// one-row dot of x[m]. Microbenchmark (the 30 SmolLM2 layers' seven projections, 2 threads,
// ms), M = 1 / 3 / 16 / 64 / 512: XLA 17.9 / 31.5 / 43.3 / 64.7 / 378.6, f32_gemv (M <= 16)
// 17.3 / 18.2 / 25.3, this 15.8 / 15.7 / 23.9 / 56.7 / 376.7.
template <bool P, int NV>
IoRows packed_rows_for(int G) {
  return for_group<Isa::kAvx512>(G, [](auto g) -> IoRows { return io_rows_avx512<decltype(g)::value, NV, P, true>; });
}

// Columns [c0, c1) (whole panels): blocks of three panels, then one of the one or two left.
template <int NV>
void packed_block(const float* x, const float* w, float* out, const Groups& g, int64_t I, int64_t O, int64_t o) {
  const IoRows first = packed_rows_for<true, NV>(g.size[0]);
  first(x, w, out, I, O, o, 0, I, nullptr);
  for (int i = 1, m0 = g.size[0]; i < g.n; m0 += g.size[i++])
    packed_rows_for<false, NV>(g.size[i])(x + m0 * I, w, out + m0 * O, I, O, o, 0, I, nullptr);
}

void run_packed(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const Groups g = groups_of(Isa::kAvx512, static_cast<int>(j.M));
  int64_t o = j.c0;
  for (; o + 48 <= j.c1; o += 48) packed_block<3>(x, w, out, g, j.I, j.O, o);
  if (j.c1 - o == 32) packed_block<2>(x, w, out, g, j.I, j.O, o);
  if (j.c1 - o == 16) packed_block<1>(x, w, out, g, j.I, j.O, o);
}

// ----------------------------------------------------------------------------- w [O, I]
// G rows of x against NR weight rows at `rows` (row r of the output): a vector accumulator per
// pair over all of I, summed across lanes at the end. The first group prefetches ahead.
template <int G, int NR, bool kPrefetch>
__attribute__((target("avx512f"))) void oi_rows_avx512(const float* x, const float* rows, float* out, int64_t I,
                                                       int64_t O, int64_t r) {
  const int64_t kv = I / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (I % 16)) - 1);
  __m512 acc[NR][G];
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < G; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t v = 0; v < kv; ++v) {
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) {
      if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(rows + i * I + 16 * v) + kAheadBytes, _MM_HINT_T1);
      wv[i] = _mm512_loadu_ps(rows + i * I + 16 * v);
    }
    for (int m = 0; m < G; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * I + 16 * v);
      for (int i = 0; i < NR; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  if (tail) {  // I % 16 last input channels
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm512_maskz_loadu_ps(tail, rows + i * I + 16 * kv);
    for (int m = 0; m < G; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * I + 16 * kv);
      for (int i = 0; i < NR; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < G; ++m) out[m * O + r + i] = _mm512_reduce_add_ps(acc[i][m]);
}

__attribute__((target("avx2,fma"))) inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The same in 8 lanes.
template <int G, int NR, bool kPrefetch>
__attribute__((target("avx2,fma"))) void oi_rows_avx2(const float* x, const float* rows, float* out, int64_t I,
                                                      int64_t O, int64_t r) {
  const int64_t kv = I / 8;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(I % 8)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 acc[NR][G];
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < G; ++m) acc[i][m] = _mm256_setzero_ps();
  for (int64_t v = 0; v < kv; ++v) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) {
      // once per 64-byte line (four 113 MB heads, M = 1 / 2 / 5 / 8, 2 threads: 16 / 17 / 18 /
      // 21 ms, against 18 / 20 / 22 / 24 with one per vector)
      if (kPrefetch && v % 2 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(rows + i * I + 8 * v) + kAheadBytes, _MM_HINT_T1);
      wv[i] = _mm256_loadu_ps(rows + i * I + 8 * v);
    }
    for (int m = 0; m < G; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * I + 8 * v);
      for (int i = 0; i < NR; ++i) acc[i][m] = _mm256_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  if (I % 8) {  // the last input channels; masked-off lanes are neither read nor faulted
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_maskload_ps(rows + i * I + 8 * kv, tail);
    for (int m = 0; m < G; ++m) {
      const __m256 xv = _mm256_maskload_ps(x + m * I + 8 * kv, tail);
      for (int i = 0; i < NR; ++i) acc[i][m] = _mm256_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < G; ++m) out[m * O + r + i] = reduce_add(acc[i][m]);
}

using OiRows = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t);

template <Isa A, int G, int NR, bool P>
constexpr OiRows oi_rows() {
  if constexpr (A == Isa::kAvx512)
    return oi_rows_avx512<G, NR, P>;
  else
    return oi_rows_avx2<G, NR, P>;
}

template <Isa A, int G, bool P>
OiRows oi_rows_nr(int nr) {
  switch (nr) {
    case 1: if constexpr (A == Isa::kAvx2) return oi_rows<A, G, 1, P>(); break;
    case 2: if constexpr (G * 2 <= (A == Isa::kAvx512 ? 24 : 12)) return oi_rows<A, G, 2, P>(); break;
    case 3: if constexpr (G * 3 <= (A == Isa::kAvx512 ? 24 : 12)) return oi_rows<A, G, 3, P>(); break;
    case 4: if constexpr (G * 4 <= (A == Isa::kAvx512 ? 24 : 12)) return oi_rows<A, G, 4, P>(); break;
  }
  return nullptr;
}

template <Isa A, bool P>
OiRows oi_rows_for(int G, int nr) {
  return for_group<A>(G, [nr](auto g) { return oi_rows_nr<A, decltype(g)::value, P>(nr); });
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

int oi_rows_at_a_time(Isa isa, int M) { return nr_oi(isa, groups_of(isa, M).size[0]); }

template <Isa A>
void run_oi(const Job& j) {
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const float*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const int M = static_cast<int>(j.M);
  const Groups g = groups_of(A, M);
  const int nr = nr_oi(A, g.size[0]);
  const int64_t I = j.I, O = j.O;
  OiRows first = oi_rows_for<A, true>(g.size[0], nr), rest[kMaxGroups] = {};
  for (int i = 1; i < g.n; ++i) rest[i] = oi_rows_for<A, false>(g.size[i], nr);
  const int64_t r1 = j.c0 + (j.c1 - j.c0) / nr * nr;
  for (int64_t r = j.c0; r < r1; r += nr) {
    first(x, w + r * I, out, I, O, r);
    for (int i = 1, m0 = g.size[0]; i < g.n; m0 += g.size[i++]) rest[i](x + m0 * I, w + r * I, out + m0 * O, I, O, r);
  }
  oi_scalar(x, w, out, M, I, O, r1, j.c1);
}

// ----------------------------------------------------------------------------- handlers
using RunFn = void (*)(const Job&);

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
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument(what + ": 1 to 16 rows");
  const RunFn fn = transposed ? (isa == Isa::kAvx512 ? run_oi<Isa::kAvx512> : run_oi<Isa::kAvx2>)
                              : (isa == Isa::kAvx512 ? run_io<Isa::kAvx512> : run_io<Isa::kAvx2>);
  const Job all{fn, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  const int m = static_cast<int>(M);
  const int64_t unit = transposed ? 16 * oi_rows_at_a_time(isa, m) : io_cols(isa, m);
  split_run(all, unit, threads, pool);
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

ffi::Error F32GemmPacked(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                         int64_t threads, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 16 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("f32_gemm_packed: x must be [M, I] and w [O / 16, I, 16]");
  const int64_t M = xd[0], I = xd[1], O = wd[0] * 16;
  if (M < 1 || M > 8 * kMaxGroups) return ffi::Error::InvalidArgument("f32_gemm_packed: 1 to 512 rows");
  if (!cpu_has(Isa::kAvx512)) return ffi::Error::InvalidArgument("f32_gemm_packed: needs AVX-512");
  const Job all{run_packed, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  split_run(all, 48, threads, pool);
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_f32_gemm_packed, F32GemmPacked,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());
