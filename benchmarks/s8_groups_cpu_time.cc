// What weight-only int8 with activations quantized per group of input channels (OpenVINO's
// dynamic quantization) would cost on AVX2: s8_gemm's panel path (rows past 4), its integer
// sums cut at every group of GROUP inputs and each group's sums added into float32 outputs times
// the group's activation scale (cvt + FMA per 8 outputs per group). Timing only: not a kernel of
// the library (the scales are all one value; I and 256 must be multiples of GROUP).
// Built as a SRC of kernel_cpu_time.cc, from the repository root:
//   g++ -O3 -std=c++17 -w -I$INC -Ijaxinfer/cpu_kernels -DSRC='"s8_groups_cpu_time.cc"' \
//       -DGROUP=32 -DWT=int8_t -DXT=int8_t -DOT=float -DFN=run_s8_groups \
//       benchmarks/kernel_cpu_time.cc -o /tmp/s8g32
#include "int8_gemv.cc"

#ifndef GROUP
#define GROUP 32
#endif

namespace {

__attribute__((target("avx2,fma"))) void run_s8_groups(const Job& j) {
  constexpr int64_t G = GROUP;  // inputs per group, even, dividing I and 2 * kKc2
  const auto* x = static_cast<const int8_t*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<float*>(j.out);
  const int64_t M = j.M, I = j.I, O = j.O, nb = (j.c1 - j.c0) / kW;
  std::unique_ptr<int16_t[]> x2(new int16_t[M * I]);
  for (int64_t i = 0; i < M * I; ++i) x2[i] = x[i];
  std::unique_ptr<float[]> xs(new float[M * (I / G)]);  // each row's scale per group
  for (int64_t i = 0; i < M * (I / G); ++i) xs[i] = 1.0f / 127;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = j.c0; o < j.c1; ++o) out[m * O + o] = 0.0f;
  alignas(64) int16_t panel[2 * kKc2 * kW];
  alignas(32) int32_t sums[kG * kW];
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t m1 = std::min(m0 + kMc, M);
    for (int64_t k0 = 0; k0 < I; k0 += 2 * kKc2) {
      const int64_t k1 = std::min(k0 + 2 * kKc2, I);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t o = j.c0 + b * kW;
        widen_pairs(w, I, O, o, k0, k1, panel);
        for (int64_t m = m0; m < m1; m += kG) {
          const int g = static_cast<int>(std::min<int64_t>(kG, m1 - m));
          for (int64_t k = k0; k < k1; k += G) {  // one group: integer sums from zero
            kS8Rows[g](x2.get() + m * I + k, panel + (k - k0) * kW, sums, I, kW, 0, 0, G);
            for (int r = 0; r < g; ++r) {
              const __m256 sc = _mm256_set1_ps(xs[(m + r) * (I / G) + k / G]);
              float* y = out + (m + r) * O + o;
              for (int h = 0; h < 2; ++h) {
                const __m256 v = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums + r * kW + 8 * h)));
                _mm256_storeu_ps(y + 8 * h, _mm256_fmadd_ps(v, sc, _mm256_loadu_ps(y + 8 * h)));
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
