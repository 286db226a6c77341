// The native decode attention kernel (paged_attention.cc, jaxinfer_paged_rows) over float32 pages
// and over int8 ones, at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, pages of
// 16) on one thread, timed by the thread's own CPU time (CLOCK_THREAD_CPUTIME_ID), the best of
// `reps` passes: a figure a shared, loaded box leaves nearly alone. One pass is LAYERS layers'
// attention for ROWS decode rows (one query token each) whose lengths spread evenly from a tenth
// of CONTEXT to all of it, as in a running batch; every layer has pools of its own, and each
// row's pages lie scattered through them (a random permutation), as in a running engine.
//
// Built from the kernel's own source (its unnamed namespace becomes this file's); from the
// repository root, with INC=$(python -c "import jax; print(jax.ffi.include_dir())"):
//   g++ -O3 -std=c++17 -w -I$INC -Ijaxinfer/cpu_kernels benchmarks/attention_cpu_time.cc -o /tmp/attn
//   taskset -c 0 /tmp/attn ROWS CONTEXT [REPS] [LAYERS]   # prints the best pass per pool dtype, ms
#include "paged_attention.cc"

#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

static double thread_cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s ROWS CONTEXT [REPS] [LAYERS]\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), S = std::atoll(argv[2]);
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const int layers = argc > 4 ? std::atoi(argv[4]) : 30;
  const int64_t T = 1, N = 9, K = 3, H = 64, ps = 16, n = (S + ps - 1) / ps, P = B * n + 1;
  const bool avx512 = cpu_has("avx512");
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(B * T * N * H), out(B * T * N * H);
  for (auto& x : q) x = u(rng);
  std::vector<int32_t> base(B, 0), qpos(B * T), end(B);
  for (int64_t b = 0; b < B; ++b) {
    end[b] = static_cast<int32_t>(S / 10 + (S - S / 10) * b / std::max<int64_t>(1, B - 1));
    qpos[b] = end[b] - 1;
  }
  struct Layer {
    std::vector<float> kf, vf, ks, vs;
    std::vector<int8_t> k8, v8;
    std::vector<int32_t> table;
  };
  std::vector<Layer> ls(layers);
  for (auto& l : ls) {
    l.kf.resize(P * K * H * ps);
    l.vf.resize(P * K * H * ps);
    l.k8.resize(P * K * H * ps);
    l.v8.resize(P * K * H * ps);
    l.ks.resize(P * K * ps);
    l.vs.resize(P * K * ps);
    for (size_t i = 0; i < l.kf.size(); ++i) {
      l.k8[i] = static_cast<int8_t>(rng() % 255 - 127);
      l.v8[i] = static_cast<int8_t>(rng() % 255 - 127);
      l.kf[i] = l.k8[i] / 127.0f;
      l.vf[i] = l.v8[i] / 127.0f;
    }
    for (auto& x : l.ks) x = 1.0f / 127.0f;
    for (auto& x : l.vs) x = 1.0f / 127.0f;
    std::vector<int32_t> perm(P - 1);
    std::iota(perm.begin(), perm.end(), 1);
    std::shuffle(perm.begin(), perm.end(), rng);
    l.table.assign(perm.begin(), perm.begin() + B * n);
  }
  for (int int8 = 0; int8 < 2; ++int8) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const double t = thread_cpu_s();
      for (const auto& l : ls) {
        Rows rows{q.data(), int8 ? static_cast<const void*>(l.k8.data()) : l.kf.data(),
                  int8 ? static_cast<const void*>(l.v8.data()) : l.vf.data(), int8 ? l.ks.data() : nullptr,
                  int8 ? l.vs.data() : nullptr, l.table.data(), base.data(), qpos.data(), end.data(), out.data(),
                  B, T, N, K, H, ps, P, n, 0, 0.125f, 0.0f};
        void (*fn)(const Job&) = avx512 ? (int8 ? avx512::run_i8 : avx512::run_f32)
                                        : (int8 ? avx2::run_i8 : avx2::run_f32);
        run(Job{fn, &rows, nullptr, nullptr, 0, 0, B, 0, B});
      }
      best = std::min(best, thread_cpu_s() - t);
    }
    std::printf("%s pages, %s, B=%lld S=%lld, %d layers: %.2f ms (%.3f a layer)\n", int8 ? "int8" : "float32",
                avx512 ? "avx512" : "avx2", static_cast<long long>(B), static_cast<long long>(S), layers,
                best * 1e3, best * 1e3 / layers);
  }
}
