// Products of a few activation rows with an int8 weight, for XLA CPU through the XLA FFI:
//   jaxinfer_int8_gemv: int8 x int8 -> int32, acc[m, o] = sum_k x[m, k] * w[k, o], exactly
//                       what XLA's s8 dot gives (w8a8);
//   jaxinfer_wo8_gemv:  float32 x int8 -> float32 (weight-only int8), the int8 weight widened
//                       in registers; the section "weight-only" says how;
//   jaxinfer_s8_gemm:   int8 x int8 -> int32 for any number of rows in AVX2 (w8a8's decode
//                       batches and prompt chunks), exactly XLA's s8 dot;
//   jaxinfer_wo8_gemm:  weight-only int8 for any number of rows (decode batches, prompt chunks), in
//                       AVX2 + FMA, so it runs on every x86-64 CPU of the last decade; the
//                       section "AVX2" says how.
// Each handler picks its vector code by what the CPU reports (__builtin_cpu_supports, i.e.
// cpuid) at run time: AVX-512BW where the CPU has it, AVX2 + FMA elsewhere (AMD Zen 2/3, older
// Intel). Both give the same results: the same integers, or the same FMA chain per output.
//
// Why: at batch 1 XLA CPU runs this dot through YNNPACK, which repacks the whole weight into
// its VNNI layout on every call (ynn::interleave4_x8 was 49% of a w8a8 batch-1 decode step on
// an AMX box). This kernel reads the weight once, in the layout it is stored in ([I, O],
// row-major), and streams it.
//
// Method (AVX-512BW): two weight rows k, k+1 are interleaved byte-wise (unpacklo/hi_epi8),
// sign-extended to int16 pairs (w[k, o], w[k+1, o]), and multiplied by the pair
// (x[k], x[k+1]) with madd_epi16: one int32 lane per output holds
// x[k] w[k, o] + x[k+1] w[k+1, o]. |x|, |w| <= 128, so a pair is at most 2^15 and int32 holds
// any realistic I. A column block of 64 outputs is four accumulators whose lanes are a fixed
// permutation of the 64 outputs (unpack works within 128-bit lanes), undone when stored.
// The column blocks are split into one contiguous range per thread: the calling thread runs the
// first, the others are offered to XLA's own intra-op thread pool (the FFI's ThreadPool context;
// gemv_split.h). Measured on two cores against the alternatives: a
// helper thread of our own that spun between calls fought XLA's spinning pool threads for the
// two cores (57 tok/s at batch 1, against 68-75 this way), and two custom calls on column
// windows left to XLA's executor to overlap were slower still.
// AVX2 runs the same method on 32 columns at a time. Anything the vector loops do not cover
// (an odd last row, columns past the last whole block) takes the scalar loop, which gives the
// same integers.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <immintrin.h>

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::run;
using jaxinfer_native::split_run;

namespace {

constexpr int kMaxRows = 4;  // activation rows per call (batch-1 decode, small verify rows)
// Rows per pass over a column block: between passes a block's four accumulators wait in
// `out` (in their lane order, put right once at the end), so the weight is read KC rows at a
// time as KC short contiguous streams, whatever O is.
constexpr int64_t KC = 64;
constexpr int64_t kAhead = 4;  // column blocks prefetched ahead

// Scalar reference for columns [o0, o1) into out [M, ldo] at column o - c0: the same integers
// as any other path.
void gemv_scalar(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t I, int64_t O,
                 int64_t ldo, int64_t c0, int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = o0; o < o1; ++o) out[m * ldo + o - c0] = 0;
  for (int64_t k = 0; k < I; ++k) {
    const int8_t* row = w + k * O;
    for (int64_t m = 0; m < M; ++m) {
      const int32_t xk = x[m * I + k];
      int32_t* dst = out + m * ldo - c0;
      for (int64_t o = o0; o < o1; ++o) dst[o] += xk * static_cast<int32_t>(row[o]);
    }
  }
}

// Columns [c0, c0 + 64 * nb) (c0 a multiple of 64) into out [M, ldo] at column o - c0.
__attribute__((target("avx512f,avx512bw"))) void gemv_avx512(const int8_t* x, const int8_t* w,
                                                               int32_t* out, int64_t M, int64_t I,
                                                               int64_t O, int64_t ldo, int64_t c0,
                                                               int64_t nb) {
  const int64_t I2 = I & ~int64_t(1);
  for (int64_t k0 = 0; k0 < I2 || k0 == 0; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I2);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * 64;
      int32_t* dst = out + b * 64;  // + m * ldo
      __m512i acc[kMaxRows][4];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j)
          acc[m][j] = k0 == 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(dst + m * ldo + 16 * j);
      // the same rows a few blocks ahead, or the next pass's rows near the end of this one
      // (a prefetch past the weight's end does not fault)
      const int8_t* ahead =
          b + kAhead < nb ? w + o + 64 * kAhead : w + (k1 - k0) * O + c0 + (b + kAhead - nb) * 64;
      for (int64_t k = k0; k < k1; k += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + k * O), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (k + 1) * O), _MM_HINT_T0);
        const __m512i a = _mm512_loadu_si512(w + k * O + o);
        const __m512i c = _mm512_loadu_si512(w + (k + 1) * O + o);
        const __m512i lo = _mm512_unpacklo_epi8(a, c);  // per 128-bit lane: pairs of cols 0-7
        const __m512i hi = _mm512_unpackhi_epi8(a, c);  // ... and of cols 8-15
        const __m512i p0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
        const __m512i p1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
        const __m512i p2 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
        const __m512i p3 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
        for (int m = 0; m < M; ++m) {
          const int16_t x0 = x[m * I + k], x1 = x[m * I + k + 1];
          const __m512i xp = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(x0)) |
                                               (static_cast<int32_t>(x1) << 16));
          acc[m][0] = _mm512_add_epi32(acc[m][0], _mm512_madd_epi16(p0, xp));
          acc[m][1] = _mm512_add_epi32(acc[m][1], _mm512_madd_epi16(p1, xp));
          acc[m][2] = _mm512_add_epi32(acc[m][2], _mm512_madd_epi16(p2, xp));
          acc[m][3] = _mm512_add_epi32(acc[m][3], _mm512_madd_epi16(p3, xp));
        }
      }
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) _mm512_storeu_si512(dst + m * ldo + 16 * j, acc[m][j]);
    }
  }
  // Lane order -> column order. Lane L of lo holds cols 16L..16L+7, of hi cols 16L+8..16L+15;
  // p0/p2 took lanes 0-1, p1/p3 lanes 2-3.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      int32_t* dst = out + m * ldo + b * 64;
      int32_t t[4][16];
      std::memcpy(t, dst, sizeof(t));
      for (int L = 0; L < 4; ++L) {
        std::memcpy(dst + 16 * L, t[L < 2 ? 0 : 1] + (L % 2) * 8, 8 * sizeof(int32_t));
        std::memcpy(dst + 16 * L + 8, t[L < 2 ? 2 : 3] + (L % 2) * 8, 8 * sizeof(int32_t));
      }
    }
  if (I2 != I) {  // the odd last row
    const int8_t* row = w + (I - 1) * O + c0;
    for (int64_t m = 0; m < M; ++m) {
      const int32_t xk = x[m * I + I - 1];
      for (int64_t i = 0; i < nb * 64; ++i) out[m * ldo + i] += xk * static_cast<int32_t>(row[i]);
    }
  }
}

// The AVX2 form of gemv_avx512: columns [c0, c0 + 32 * nb) into out [M, ldo] at column o - c0.
// unpacklo/hi work within 128-bit lanes, so lo holds the pairs of columns 0-7 (low lane) and
// 16-23 (high lane), hi those of 8-15 and 24-31: each widened half lands on 8 whole columns.
__attribute__((target("avx2"))) void gemv_avx2(const int8_t* x, const int8_t* w, int32_t* out, int64_t M,
                                                int64_t I, int64_t O, int64_t ldo, int64_t c0, int64_t nb) {
  const int64_t I2 = I & ~int64_t(1);
  for (int64_t k0 = 0; k0 < I2 || k0 == 0; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I2);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * 32;
      int32_t* dst = out + b * 32;  // + m * ldo
      constexpr int kCol[4] = {0, 16, 8, 24};  // first column of each accumulator
      __m256i acc[kMaxRows][4];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j)
          acc[m][j] = k0 == 0 ? _mm256_setzero_si256()
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst + m * ldo + kCol[j]));
      for (int64_t k = k0; k < k1; k += 2) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * O + o));
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k + 1) * O + o));
        const __m256i lo = _mm256_unpacklo_epi8(a, c), hi = _mm256_unpackhi_epi8(a, c);
        const __m256i p[4] = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)),
                              _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)),
                              _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)),
                              _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1))};
        for (int m = 0; m < M; ++m) {
          const int16_t x0 = x[m * I + k], x1 = x[m * I + k + 1];
          const __m256i xp = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(x0)) |
                                               (static_cast<int32_t>(x1) << 16));
          for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(p[j], xp));
        }
      }
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + m * ldo + kCol[j]), acc[m][j]);
    }
  }
  if (I2 != I) {  // the odd last row
    const int8_t* row = w + (I - 1) * O + c0;
    for (int64_t m = 0; m < M; ++m) {
      const int32_t xk = x[m * I + I - 1];
      for (int64_t i = 0; i < nb * 32; ++i) out[m * ldo + i] += xk * static_cast<int32_t>(row[i]);
    }
  }
}

bool have_avx512bw() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return ok;
}

bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void run_int8(const Job& j) {  // c0 a multiple of 64
  const auto* x = static_cast<const int8_t*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<int32_t*>(j.out);
  const int64_t width = have_avx512bw() ? 64 : have_avx2() ? 32 : 0;
  const int64_t nb = width ? (j.c1 - j.c0) / width : 0;
  if (nb && width == 64) gemv_avx512(x, w, out + j.c0, j.M, j.I, j.O, j.O, j.c0, nb);
  if (nb && width == 32) gemv_avx2(x, w, out + j.c0, j.M, j.I, j.O, j.O, j.c0, nb);
  if (j.c0 + nb * width < j.c1)
    gemv_scalar(x, w, out + j.c0, j.M, j.I, j.O, j.O, j.c0, j.c0 + nb * width, j.c1);
}

// Checks x [M <= 4, I] and w [I, O], then runs fn over O's columns in units of `unit`.
template <typename X, typename Y>
ffi::Error gemv(void (*fn)(const Job&), const char* what, X x, ffi::Buffer<ffi::S8> w, Y out,
                int64_t unit, int64_t threads, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument(std::string(what) + ": x must be [M, I] and w [I, O]");
  const int64_t M = xd[0], I = xd[1], O = wd[1];
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument(std::string(what) + ": 1 to 4 rows");
  const Job all{fn, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  split_run(all, unit, threads, pool);
  return ffi::Error::Success();
}

ffi::Error Int8Gemv(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> out,
                    int64_t threads, ffi::ThreadPool pool) {
  return gemv(run_int8, "int8_gemv", x, w, out, 64, threads, pool);
}

// ----------------------------------------------------------------------------- weight-only
// y[m, o] = sum_k x[m, k] * float(w[k, o]) for float32 x and an int8 weight stored [I, O]; the
// per-channel scale is applied by the caller. Each output is one FMA chain over k = 0..I-1,
// the order XLA's one-row float32 dot uses, so at one row the result is the bits of
// `x @ w.astype(f32)`. XLA widens the whole weight to float32 on every call instead (a
// weight-only int8 batch-1 step ran at 7 tok/s).
__attribute__((target("avx512f,avx512bw"))) void run_wo8_avx512(const Job& j) {  // c0 a multiple of 32
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const int64_t M = j.M, I = j.I, O = j.O;
  const int64_t nb = (j.c1 - j.c0) / 32;
  for (int64_t k0 = 0; k0 < I || k0 == 0; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = j.c0 + b * 32;
      __m512 acc[kMaxRows][2];
      for (int m = 0; m < M; ++m)
        for (int q = 0; q < 2; ++q)
          acc[m][q] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * O + o + 16 * q);
      const int8_t* ahead =
          b + kAhead < nb ? w + o + 32 * kAhead : w + (k1 - k0) * O + j.c0 + (b + kAhead - nb) * 32;
      for (int64_t k = k0; k < k1; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + k * O), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * O + o));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        for (int m = 0; m < M; ++m) {
          const __m512 xb = _mm512_set1_ps(x[m * I + k]);
          acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
        }
      }
      for (int m = 0; m < M; ++m)
        for (int q = 0; q < 2; ++q) _mm512_storeu_ps(out + m * O + o + 16 * q, acc[m][q]);
    }
  }
  for (int64_t o = j.c0 + nb * 32; o < j.c1; ++o)  // columns past the last whole block
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < I; ++k) s = std::fma(x[m * I + k], static_cast<float>(w[k * O + o]), s);
      out[m * O + o] = s;
    }
}

// ----------------------------------------------------------------------------- AVX2
// Weight-only int8 for any number of rows in AVX2 + FMA (16 ymm registers of 8 lanes). Up to
// kDirectMax rows widen the weight in registers ("Few rows", below). More rows: the
// columns go in blocks of 16 (two vectors); a block's int8 weight rows [k0, k1) are widened to
// float32 once, into a small panel that stays in L1 (kKc x 16 floats: 8 KB), and every group of
// up to kG rows of the current row block then runs its FMAs from the panel: kG x 2 accumulators,
// two weight vectors and a broadcast fill 15 of the 16 registers. The weight streams from memory
// once per row block of up to kMc rows (a decode batch of 64: once; a prompt chunk of 512: five
// times), and the widening (4 instructions per 16 weights) is shared by all the block's rows.
// Each output is still one FMA chain over k = 0..I-1 in order, so every path (this one, the
// AVX-512 one above, the scalar tail) gives the same bits, at any thread count.
constexpr int64_t kW = 16;    // columns per block
constexpr int64_t kKc = 128;  // weight rows per panel
constexpr int64_t kMc = 126;  // rows per row block (a multiple of kG)
constexpr int kG = 6;         // rows per register group

__attribute__((target("avx2,fma"))) void widen_panel(const int8_t* w, int64_t O, int64_t o, int64_t k0, int64_t k1,
                                                     float* panel) {
  for (int64_t k = k0; k < k1; ++k) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * O + o));
    _mm256_storeu_ps(panel + (k - k0) * kW, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    _mm256_storeu_ps(panel + (k - k0) * kW + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
  }
}

// G rows (x and out at the group's first row) of the block at column o over weight rows
// [k0, k1), the block's panel holding those rows; the accumulators wait in `out` between panels.
// The accumulators are named variables, not an array: g++ kept an array's 12 vectors on the
// stack as well, storing them all on every k (half the speed).
#define JAXINFER_WO8_ROWS(X)   X(0) X(1) X(2) X(3) X(4) X(5)
template <int G>
__attribute__((target("avx2,fma"))) void wo8_rows_avx2(const float* x, const float* panel, float* out, int64_t I,
                                                       int64_t O, int64_t o, int64_t k0, int64_t k1) {
  static_assert(G >= 1 && G <= 6);
  __m256 a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5;
#define LOAD(m)                                                                    \
  if constexpr (m < G) {                                                           \
    a##m = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * O + o);       \
    b##m = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * O + o + 8);   \
  }
  JAXINFER_WO8_ROWS(LOAD)
#undef LOAD
  const float* p = panel;
  const float* xk = x + k0;
  for (int64_t k = k0; k < k1; ++k, p += kW, ++xk) {
    const __m256 w0 = _mm256_load_ps(p), w1 = _mm256_load_ps(p + 8);
#define FMA(m)                                          \
  if constexpr (m < G) {                                \
    const __m256 xb = _mm256_broadcast_ss(xk + m * I);  \
    a##m = _mm256_fmadd_ps(xb, w0, a##m);               \
    b##m = _mm256_fmadd_ps(xb, w1, b##m);               \
  }
    JAXINFER_WO8_ROWS(FMA)
#undef FMA
  }
#define STORE(m)                                    \
  if constexpr (m < G) {                            \
    _mm256_storeu_ps(out + m * O + o, a##m);        \
    _mm256_storeu_ps(out + m * O + o + 8, b##m);    \
  }
  JAXINFER_WO8_ROWS(STORE)
#undef STORE
}
#undef JAXINFER_WO8_ROWS

using Wo8Rows = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
constexpr Wo8Rows kWo8Rows[kG + 1] = {nullptr,          wo8_rows_avx2<1>, wo8_rows_avx2<2>, wo8_rows_avx2<3>,
                                      wo8_rows_avx2<4>, wo8_rows_avx2<5>, wo8_rows_avx2<6>};

// The scalar chain for columns [o0, o1): the same FMA chain as the vector lanes.
void wo8_scalar(const float* x, const int8_t* w, float* out, int64_t M, int64_t I, int64_t O, int64_t o0,
                int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < I; ++k) s = std::fma(x[m * I + k], static_cast<float>(w[k * O + o]), s);
      out[m * O + o] = s;
    }
}

// Few rows (G <= kG: batch-1 decode, a small batch, a verification step's rows): no panel, the
// int8 weight widened in registers, NV vectors of 8 columns per block (G * NV <= 12
// accumulators). One row takes 8 (a block of 64 columns: one cache line of each weight row), so
// that 8 independent FMA chains cover the FMA's latency; the two 16-column chains of the panel
// path left one row latency-bound. A block runs kKcDirect weight rows per pass (64 for the
// 16-column blocks of 4-6 rows, whose accumulators would otherwise go back and forth to `out`
// more often than they compute) and prefetches the same rows kAheadDirect bytes of columns
// ahead: a block's int8 rows are O bytes apart, and without it every pass waited on its misses.
// Measured on the Zen 3 box (one thread, its CPU time, SmolLM2's 30 layers of projections,
// ms), M = 1 / 2 / 4 / 6 / 8 / 12: the panel path 19.6 / 22.2 / 22.6 / 28.8 / 49.6 / 57.9, this
// (and wo8_direct_groups from 7 rows) 9.6 / 10.7 / 13.6 / 20.9 / 30.8 / 38.4, f32_gemv on the
// float32 weights 33.5 / 29.9 / 34.2 / 35.5 / 41.6 / 54.1.
// Each output is still one FMA chain over k in order.
constexpr int64_t kKcDirect = 16;
constexpr int64_t kAheadDirect = 256;

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* p) {  // 8 int8 -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int G, int NV>
__attribute__((target("avx2,fma"))) void wo8_direct_avx2(const float* x, const int8_t* w, float* out, int64_t I,
                                                         int64_t O, int64_t o, int64_t k0, int64_t k1,
                                                         const int8_t* pf) {
  static_assert(G >= 1 && G * NV <= 12);
  __m256 acc[G][NV];
#pragma GCC unroll 8
  for (int m = 0; m < G; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j)
      acc[m][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * O + o + 8 * j);
  const int8_t* row = w + k0 * O + o;
  for (int64_t k = k0; k < k1; ++k, row += O) {
    for (int64_t p = 0; p < 8 * NV; p += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + k * O + p), _MM_HINT_T0);
    if constexpr (G * NV + G + 1 <= 16) {  // the G broadcasts held, one weight vector at a time
      __m256 xb[G];
#pragma GCC unroll 8
      for (int m = 0; m < G; ++m) xb[m] = _mm256_broadcast_ss(x + m * I + k);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const __m256 wv = widen8(row + 8 * j);
#pragma GCC unroll 8
        for (int m = 0; m < G; ++m) acc[m][j] = _mm256_fmadd_ps(xb[m], wv, acc[m][j]);
      }
    } else {  // the NV weight vectors held, one broadcast at a time (else 6 rows would spill)
      __m256 wv[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) wv[j] = widen8(row + 8 * j);
#pragma GCC unroll 8
      for (int m = 0; m < G; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * I + k);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < G; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + m * O + o + 8 * j, acc[m][j]);
}

using Wo8Direct = void (*)(const float*, const int8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           const int8_t*);

// Columns [o, c1) of G rows in blocks of NV vectors; returns the first column left (fewer than
// 8 * NV).
template <int G, int NV>
int64_t wo8_direct_blocks(const float* x, const int8_t* w, float* out, int64_t I, int64_t O, int64_t o, int64_t c1) {
  constexpr int64_t CB = 8 * NV;
  const int64_t nb = (c1 - o) / CB, ahead = (kAheadDirect + CB - 1) / CB;
  constexpr int64_t KC = NV == 2 ? 64 : kKcDirect;
  for (int64_t k0 = 0; k0 < I && nb; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I);
    for (int64_t b = 0; b < nb; ++b) {
      // the same rows a few blocks ahead, or the next pass's rows near the end of this one (a
      // prefetch past the weight's end does not fault)
      const int8_t* pf = b + ahead < nb ? w + o + (b + ahead) * CB : w + (k1 - k0) * O + o + (b + ahead - nb) * CB;
      wo8_direct_avx2<G, NV>(x, w, out, I, O, o + b * CB, k0, k1, pf);
    }
  }
  return o + nb * CB;
}

// G rows: 64-column blocks where G allows, then 16-column ones, then scalar (the caller).
template <int G>
int64_t wo8_direct_rows(const float* x, const int8_t* w, float* out, int64_t I, int64_t O, int64_t c0, int64_t c1) {
  constexpr int NV = G == 1 ? 8 : G <= 3 ? 4 : G == 4 ? 3 : 2;
  int64_t o = wo8_direct_blocks<G, NV>(x, w, out, I, O, c0, c1);
  if constexpr (NV > 2) o = wo8_direct_blocks<G, 2>(x, w, out, I, O, o, c1);
  return o;
}

// M <= kG rows of columns [c0, c1): returns the first column left for the scalar loop.
int64_t wo8_direct(const float* x, const int8_t* w, float* out, int M, int64_t I, int64_t O, int64_t c0,
                   int64_t c1) {
  if (I == 0) return c0;  // the scalar loop writes the zeros
  switch (M) {
    case 1: return wo8_direct_rows<1>(x, w, out, I, O, c0, c1);
    case 2: return wo8_direct_rows<2>(x, w, out, I, O, c0, c1);
    case 3: return wo8_direct_rows<3>(x, w, out, I, O, c0, c1);
    case 4: return wo8_direct_rows<4>(x, w, out, I, O, c0, c1);
    case 5: return wo8_direct_rows<5>(x, w, out, I, O, c0, c1);
    default: return wo8_direct_rows<6>(x, w, out, I, O, c0, c1);
  }
}

// 7 to kDirectMax rows (a small decode batch): groups of 2 to 4 rows as even as they go, each
// with 24-column blocks (G x 3 accumulators), every group of a block re-reading the int8 rows
// the first brought into L1 and widening them again. The panel path below would leave the last
// group of a batch of 8 (6 + 2) with four FMA chains, bound by their latency. Returns the first
// column left.
constexpr int64_t kDirectMax = 16;

int64_t wo8_direct_groups(const float* x, const int8_t* w, float* out, int M, int64_t I, int64_t O, int64_t c0,
                          int64_t c1) {
  constexpr int64_t CB = 24;
  const int n = (M + 3) / 4;
  int size[kDirectMax / 2];
  for (int i = 0, left = M; i < n; ++i) left -= size[i] = (left + (n - i) - 1) / (n - i);
  const int64_t nb = (c1 - c0) / CB, ahead = (kAheadDirect + CB - 1) / CB;
  for (int64_t k0 = 0; k0 < I && nb; k0 += 64) {
    const int64_t k1 = std::min<int64_t>(k0 + 64, I);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = c0 + b * CB;
      const int8_t* pf = b + ahead < nb ? w + o + ahead * CB : w + (k1 - k0) * O + c0 + (b + ahead - nb) * CB;
      for (int i = 0, m = 0; i < n; m += size[i++]) {
        const float* xm = x + m * I;
        float* om = out + m * O;
        switch (size[i]) {
          case 2: wo8_direct_avx2<2, 3>(xm, w, om, I, O, o, k0, k1, pf); break;
          case 3: wo8_direct_avx2<3, 3>(xm, w, om, I, O, o, k0, k1, pf); break;
          default: wo8_direct_avx2<4, 3>(xm, w, om, I, O, o, k0, k1, pf); break;
        }
      }
    }
  }
  int64_t o = c0 + nb * CB;
  if (I > 0 && o + kW <= c1) {  // fewer than 24 columns left: a 16-column block at most
    for (int m = 0; m < M; m += kG) {
      const int g = std::min(kG, M - m);
      wo8_direct(x + m * I, w, out + m * O, g, I, O, o, o + kW);
    }
    o += kW;
  }
  return I > 0 ? o : c0;
}

__attribute__((target("avx2,fma"))) void run_wo8_avx2(const Job& j) {  // c0 a multiple of kW
  const auto* x = static_cast<const float*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const int64_t M = j.M, I = j.I, O = j.O;
  const int64_t nb = (j.c1 - j.c0) / kW;
  if (M <= kDirectMax) {  // widen in registers, no panel
    const int m = static_cast<int>(M);
    const int64_t o = m <= kG ? wo8_direct(x, w, out, m, I, O, j.c0, j.c1) : wo8_direct_groups(x, w, out, m, I, O, j.c0, j.c1);
    wo8_scalar(x, w, out, M, I, O, o, j.c1);
    return;
  }
  alignas(64) float panel[kKc * kW];
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t m1 = std::min(m0 + kMc, M);
    for (int64_t k0 = 0; k0 < I || k0 == 0; k0 += kKc) {
      const int64_t k1 = std::min(k0 + kKc, I);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t o = j.c0 + b * kW;
        widen_panel(w, O, o, k0, k1, panel);
        for (int64_t m = m0; m < m1; m += kG) {
          const int g = static_cast<int>(std::min<int64_t>(kG, m1 - m));
          kWo8Rows[g](x + m * I, panel, out + m * O, I, O, o, k0, k1);
        }
      }
    }
  }
  wo8_scalar(x, w, out, M, I, O, j.c0 + nb * kW, j.c1);
}

void run_wo8(const Job& j) {
  if (have_avx512bw() && j.M <= kMaxRows)
    run_wo8_avx512(j);
  else if (have_avx2())
    run_wo8_avx2(j);
  else
    wo8_scalar(static_cast<const float*>(j.x), static_cast<const int8_t*>(j.w), static_cast<float*>(j.out), j.M,
               j.I, j.O, j.c0, j.c1);
}

// The column unit of a wo8 call of M rows: a whole block of the code that runs it.
int64_t wo8_unit(int64_t M) { return have_avx512bw() && M <= kMaxRows ? 32 : kW; }

// w8a8 for any number of rows in AVX2: int8 x int8 -> int32, exactly XLA's s8 dot. The
// structure of the weight-only kernel above, in integers: a block's weight rows are widened to
// int16 pairs (w[k, o], w[k+1, o]) once, into a panel in L1, and each group of up to kG rows
// multiplies them by its pairs (x[m, k], x[m, k+1]) with vpmaddwd: 16 products per instruction
// where an FMA makes 8, and no saturation (int16 products summed in int32). The activation rows
// are widened to int16 once per call, padded to an even length. `vpmaddubsw` would take the
// bytes as they are, but it adds its pairs in saturating int16 (255 x 127 x 2 overflows), and
// the exact way round that (sign transfer) costs as many multiplies as this.
constexpr int64_t kKc2 = 128;  // k pairs per panel (256 weight rows)

__attribute__((target("avx2"))) void widen_pairs(const int8_t* w, int64_t I, int64_t O, int64_t o, int64_t k0,
                                                 int64_t k1, int16_t* panel) {
  for (int64_t k = k0; k < k1; k += 2) {  // k1 <= I rounded up to even; a row past I is zeros
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * O + o));
    const __m128i c = k + 1 < I ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * O + o))
                                : _mm_setzero_si128();
    int16_t* dst = panel + (k - k0) * kW;  // 16 columns x 2 int16 per pair of rows
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, c)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, c)));
  }
}

// G rows of int16 pairs x2 (row stride ldx int16) of the block at column o over pairs of weight
// rows [k0, k1); the accumulators wait in `out` between panels.
#define JAXINFER_S8_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int G>
__attribute__((target("avx2"))) void s8_rows_avx2(const int16_t* x2, const int16_t* panel, int32_t* out, int64_t ldx,
                                                  int64_t O, int64_t o, int64_t k0, int64_t k1) {
  static_assert(G >= 1 && G <= 6);
  __m256i a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5;
#define LOAD(m)                                                                                                 \
  if constexpr (m < G) {                                                                                        \
    a##m = k0 == 0 ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + m * O + o)); \
    b##m = k0 == 0 ? _mm256_setzero_si256()                                                                     \
                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + m * O + o + 8));                 \
  }
  JAXINFER_S8_ROWS(LOAD)
#undef LOAD
  const int16_t* p = panel;
  const int16_t* xk = x2 + k0;
  for (int64_t k = k0; k < k1; k += 2, p += 2 * kW, xk += 2) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 16));
#define MADD(m)                                                                         \
  if constexpr (m < G) {                                                                \
    int32_t pair;                                                                       \
    std::memcpy(&pair, xk + m * ldx, sizeof(pair));                                     \
    const __m256i xb = _mm256_set1_epi32(pair);                                         \
    a##m = _mm256_add_epi32(a##m, _mm256_madd_epi16(xb, w0));                           \
    b##m = _mm256_add_epi32(b##m, _mm256_madd_epi16(xb, w1));                           \
  }
    JAXINFER_S8_ROWS(MADD)
#undef MADD
  }
#define STORE(m)                                                                        \
  if constexpr (m < G) {                                                                \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * O + o), a##m);             \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * O + o + 8), b##m);         \
  }
  JAXINFER_S8_ROWS(STORE)
#undef STORE
}
#undef JAXINFER_S8_ROWS

using S8Rows = void (*)(const int16_t*, const int16_t*, int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t);
constexpr S8Rows kS8Rows[kG + 1] = {nullptr,         s8_rows_avx2<1>, s8_rows_avx2<2>, s8_rows_avx2<3>,
                                    s8_rows_avx2<4>, s8_rows_avx2<5>, s8_rows_avx2<6>};

// Up to 4 rows (batch-1 decode, small batches): no panel. Each pair of weight rows is widened to
// int16 pairs in registers (the two rows' 16 bytes interleaved: columns 0-7 and 8-15 in order),
// NV of those 16-column pieces per block (4 at one row: 64 columns, one cache line of each row,
// 8 accumulators), prefetched a few blocks ahead, as wo8's few-row path does.
template <int G, int NV>
__attribute__((target("avx2"))) void s8_direct_avx2(const int16_t* x2, const int8_t* w, int32_t* out, int64_t ldx,
                                                    int64_t I, int64_t O, int64_t o, int64_t k0, int64_t k1,
                                                    const int8_t* pf) {
  static_assert(G >= 1 && G * NV * 2 <= 12);
  __m256i acc[G][2 * NV];
#pragma GCC unroll 8
  for (int m = 0; m < G; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NV; ++j)
      acc[m][j] = k0 == 0 ? _mm256_setzero_si256()
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + m * O + o + 8 * j));
  for (int64_t k = k0; k < k1; k += 2) {  // k1 <= I rounded up to even; a row past I is zeros
    const int8_t* a = w + k * O + o;
    _mm_prefetch(reinterpret_cast<const char*>(pf + k * O), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pf + (k + 1) * O), _MM_HINT_T0);
    __m256i xb[G];
#pragma GCC unroll 8
    for (int m = 0; m < G; ++m) {
      int32_t pair;
      std::memcpy(&pair, x2 + m * ldx + k, sizeof(pair));
      xb[m] = _mm256_set1_epi32(pair);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * v));
      const __m128i r1 = k + 1 < I ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + O + 16 * v))
                                   : _mm_setzero_si128();
      const __m256i p0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));
      const __m256i p1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));
#pragma GCC unroll 8
      for (int m = 0; m < G; ++m) {
        acc[m][2 * v] = _mm256_add_epi32(acc[m][2 * v], _mm256_madd_epi16(xb[m], p0));
        acc[m][2 * v + 1] = _mm256_add_epi32(acc[m][2 * v + 1], _mm256_madd_epi16(xb[m], p1));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < G; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NV; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * O + o + 8 * j), acc[m][j]);
}

// Columns [o, c1) of G rows in blocks of 16 NV columns; returns the first column left.
template <int G, int NV>
int64_t s8_direct_blocks(const int16_t* x2, const int8_t* w, int32_t* out, int64_t ldx, int64_t I, int64_t O,
                         int64_t o, int64_t c1) {
  constexpr int64_t CB = 16 * NV, KC = 32;  // KC: weight rows (16 pairs) per pass
  const int64_t I2 = (I + 1) & ~int64_t(1), nb = (c1 - o) / CB, ahead = (kAheadDirect + CB - 1) / CB;
  for (int64_t k0 = 0; k0 < I2 && nb; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, I2);
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* pf = b + ahead < nb ? w + o + (b + ahead) * CB : w + (k1 - k0) * O + o + (b + ahead - nb) * CB;
      s8_direct_avx2<G, NV>(x2, w, out, ldx, I, O, o + b * CB, k0, k1, pf);
    }
  }
  return o + nb * CB;
}

template <int G>
int64_t s8_direct_rows(const int16_t* x2, const int8_t* w, int32_t* out, int64_t ldx, int64_t I, int64_t O,
                       int64_t c0, int64_t c1) {
  constexpr int NV = G == 1 ? 4 : G == 2 ? 2 : 1;
  int64_t o = s8_direct_blocks<G, NV>(x2, w, out, ldx, I, O, c0, c1);
  if constexpr (NV > 1) o = s8_direct_blocks<G, 1>(x2, w, out, ldx, I, O, o, c1);
  return o;
}

__attribute__((target("avx2"))) void run_s8_avx2(const Job& j) {  // c0 a multiple of kW
  const auto* x = static_cast<const int8_t*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<int32_t*>(j.out);
  const int64_t M = j.M, I = j.I, O = j.O, I2 = (I + 1) & ~int64_t(1);
  const int64_t nb = (j.c1 - j.c0) / kW;
  if (nb > 0) {
    std::unique_ptr<int16_t[]> x2(new int16_t[M * I2]);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < I; ++k) x2[m * I2 + k] = x[m * I + k];
      if (I2 != I) x2[m * I2 + I] = 0;
    }
    if (M <= 4 && I > 0) {
      int64_t o = j.c0;
      switch (M) {
        case 1: o = s8_direct_rows<1>(x2.get(), w, out, I2, I, O, j.c0, j.c1); break;
        case 2: o = s8_direct_rows<2>(x2.get(), w, out, I2, I, O, j.c0, j.c1); break;
        case 3: o = s8_direct_rows<3>(x2.get(), w, out, I2, I, O, j.c0, j.c1); break;
        default: o = s8_direct_rows<4>(x2.get(), w, out, I2, I, O, j.c0, j.c1); break;
      }
      if (o < j.c1) gemv_scalar(x, w, out, M, I, O, O, 0, o, j.c1);
      return;
    }
    alignas(64) int16_t panel[2 * kKc2 * kW];
    for (int64_t m0 = 0; m0 < M; m0 += kMc) {
      const int64_t m1 = std::min(m0 + kMc, M);
      for (int64_t k0 = 0; k0 < I2; k0 += 2 * kKc2) {
        const int64_t k1 = std::min(k0 + 2 * kKc2, I2);
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t o = j.c0 + b * kW;
          widen_pairs(w, I, O, o, k0, k1, panel);
          for (int64_t m = m0; m < m1; m += kG) {
            const int g = static_cast<int>(std::min<int64_t>(kG, m1 - m));
            kS8Rows[g](x2.get() + m * I2, panel, out + m * O, I2, O, o, k0, k1);
          }
        }
      }
    }
  }
  if (j.c0 + nb * kW < j.c1) gemv_scalar(x, w, out, M, I, O, O, 0, j.c0 + nb * kW, j.c1);
}

ffi::Error Wo8Gemv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::F32> out,
                   int64_t threads, ffi::ThreadPool pool) {
  return gemv(run_wo8, "wo8_gemv", x, w, out, wo8_unit(x.dimensions()[0]), threads, pool);
}

constexpr int64_t kMaxGemmRows = 512;  // wo8_gemm's rows per call: a prompt chunk

ffi::Error Wo8Gemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::F32> out,
                   int64_t threads, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("wo8_gemm: x must be [M, I] and w [I, O]");
  const int64_t M = xd[0], I = xd[1], O = wd[1];
  if (M < 1 || M > kMaxGemmRows) return ffi::Error::InvalidArgument("wo8_gemm: 1 to 512 rows");
  const Job all{run_wo8, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  split_run(all, wo8_unit(M), threads, pool);
  return ffi::Error::Success();
}

ffi::Error S8Gemm(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> out, int64_t threads,
                  ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("s8_gemm: x must be [M, I] and w [I, O]");
  const int64_t M = xd[0], I = xd[1], O = wd[1];
  if (M < 1 || M > kMaxGemmRows) return ffi::Error::InvalidArgument("s8_gemm: 1 to 512 rows");
  if (!have_avx2()) return ffi::Error::InvalidArgument("s8_gemm: needs AVX2");
  const Job all{run_s8_avx2, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  split_run(all, kW, threads, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_gemv, Int8Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_s8_gemm, S8Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_wo8_gemm, Wo8Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_wo8_gemv, Wo8Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());
