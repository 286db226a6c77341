// One native matmul kernel over SmolLM2-135M's projections (the 30 layers' q k v o gate up down,
// every weight distinct, 106 M weights) on one thread, timed by the thread's own CPU time
// (CLOCK_THREAD_CPUTIME_ID), the best of `reps` passes: a figure a shared, loaded box leaves
// nearly alone, where wall time (benchmarks/wo8_gemm.py) moves by 2-3x between rounds. One
// thread and no XLA: it shows what the kernel's code costs, not how it shares out over cores.
//
// Built from the kernel's own source (its unnamed namespace becomes this file's), one binary
// per kernel; from the repository root, with INC=$(python -c "import jax; print(jax.ffi.include_dir())"):
//   g++ -O3 -std=c++17 -w -I$INC -Ijaxinfer/cpu_kernels -DSRC='"int8_gemv.cc"' -DWT=int8_t -DXT=float \
//       -DOT=float -DFN=run_wo8 benchmarks/kernel_cpu_time.cc -o /tmp/wo8
//   g++ ... -DSRC='"int8_gemv.cc"' -DWT=int8_t -DXT=int8_t -DOT=int32_t -DFN=run_s8_avx2 ... -o /tmp/s8
//   g++ ... -DSRC='"f32_gemv.cc"' -DWT=float -DXT=float -DOT=float -DFN='run_io<Isa::kAvx2>' ... -o /tmp/f32
//   g++ ... -DSRC='"int8_gemv.cc"' -DWT=int8_t -DXT=int8_t -DOT=int32_t -DFN=run_s8p_avx2 -DPACK_S8 ... -o /tmp/s8p
//   /tmp/wo8 ROWS [REPS]      # prints the best pass in ms
// (-DPACK_S8: each weight packed first, as cpu_kernels.s8_pack does at load, for s8_gemm_packed.)
// (f32_gemv's run_io takes up to 16 rows in the engine; it runs any number here.)
#include SRC

#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

static double thread_cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s ROWS [REPS]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const int64_t D = 576, F = 1536, KV = 192;
  const int64_t layer[7][2] = {{D, D}, {D, KV}, {D, KV}, {D, D}, {D, F}, {D, F}, {F, D}};
  std::srand(0);
  std::vector<std::vector<WT>> ws;
  for (int l = 0; l < 30; ++l)
    for (const auto& s : layer) {
      ws.emplace_back(s[0] * s[1]);
      for (auto& v : ws.back()) v = static_cast<WT>(std::rand() % 255 - 127);
#ifdef PACK_S8
      std::vector<WT> p(ws.back().size());  // [O/16, I/2, 32]: byte (nb, kp, 2n + j) = w[2kp + j, 16nb + n]
      for (int64_t k = 0; k < s[0]; ++k)
        for (int64_t o = 0; o < s[1]; ++o)
          p[((o / 16) * (s[0] / 2) + k / 2) * 32 + 2 * (o % 16) + k % 2] = ws.back()[k * s[1] + o];
      ws.back() = p;
#endif
    }
  std::vector<XT> x(M * F);
  std::vector<OT> out(M * F);
  for (auto& v : x) v = static_cast<XT>(std::rand() % 255 - 127);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t = thread_cpu_s();
    for (size_t n = 0; n < ws.size(); ++n) {
      const int64_t I = layer[n % 7][0], O = layer[n % 7][1];
      run(Job{FN, x.data(), ws[n].data(), out.data(), M, I, O, 0, O});
    }
    best = std::min(best, thread_cpu_s() - t);
  }
  std::printf("M=%lld: %.1f ms\n", static_cast<long long>(M), best * 1e3);
}
