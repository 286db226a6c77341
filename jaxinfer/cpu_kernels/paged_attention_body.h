// The body of paged_attention.cc, included there once per vector variant inside a
// `#pragma GCC target` region and a namespace of its own (avx512::, avx2::), with kAvx512 set
// for the variant: everything here is compiled for that variant's instructions.
// NOLINT(build/header_guard): included twice on purpose.

// ---------------------------------------------------------------- 16-wide vectors
// Where pages and the head dim are whole multiples of 16 (SmolLM2, Gemma 3 at page size 16),
// a page is taken 16 positions at a time as one vector per key row or value chunk, and the
// queries QG at a time: their scores, and their accumulators for one 16-wide chunk of the head
// dim, stay in registers while the block's keys and values stream past once. GCC's vector
// extensions lower each v16 to one zmm register (AVX-512) or two ymm ones (AVX2).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int kMaxGroup = 4;

__attribute__((always_inline)) inline v16f splat(float a) { return v16f{} + a; }
__attribute__((always_inline)) inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline v16f load16(const int8_t* p) {
  v16f v;  // sign-extended to int32, then converted (GCC 12 lowers this lane by lane otherwise)
  if constexpr (kAvx512) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    std::memcpy(&v, &f, sizeof v);
  } else {
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  }
  return v;
}
__attribute__((always_inline)) inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (scores less their running max), to about 2 ulp, on a float or 16 lanes:
// x = n ln2 + r (n rounded to nearest by the 1.5 * 2^23 trick), a degree-6 polynomial for e^r
// on |r| <= ln2 / 2, then 2^n in the exponent bits. Below -87.3 it gives e^-87.3 (1e-38),
// nothing against the sum's 1 at the max.
template <typename F, typename I>
__attribute__((always_inline)) inline F exp_poly(F x) {
  const F lo = F{} + -87.3f;
  x = x < lo ? lo : x;
  const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  F r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits;
  if constexpr (std::is_same_v<F, float>) {
    bits = (static_cast<I>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}
__attribute__((always_inline)) inline float exp_nonpos(float x) { return exp_poly<float, int32_t>(x); }
__attribute__((always_inline)) inline v16f exp16(v16f x) { return exp_poly<v16f, v16i>(x); }


// Row b's queries of KV heads [kh0, kh1), scaled, into qm [(kh - kh0) * M + t * G + g, H]
// (M = T * G); the least and greatest of the row's query positions into qmin, qmax.
__attribute__((always_inline)) inline void load_queries(const Rows& r, int64_t b, int64_t kh0, int64_t kh1,
                                                        float* qm, int64_t* qmin, int64_t* qmax) {
  const int64_t T = r.T, H = r.H, G = r.N / r.K, M = T * G;
  const int32_t* qpos = r.qpos + b * T;
  *qmin = *qmax = qpos[0];
  for (int64_t t = 0; t < T; ++t) {
    *qmin = std::min<int64_t>(*qmin, qpos[t]);
    *qmax = std::max<int64_t>(*qmax, qpos[t]);
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      for (int64_t g = 0; g < G; ++g) {
        const float* src = r.q + ((b * T + t) * r.N + kh * G + g) * H;
        float* dst = qm + ((kh - kh0) * M + t * G + g) * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * r.scale;
      }
    }
  }
}

// M queries' running softmax before any key: nothing summed, max at the masked score.
__attribute__((always_inline)) inline void start_softmax(float* acc, float* mx, float* sum, int64_t M, int64_t H) {
  std::fill(acc, acc + M * H, 0.0f);
  std::fill(mx, mx + M, kNeg);
  std::fill(sum, sum + M, 0.0f);
}

// out [.., H] rows = acc / sum (a query that saw nothing: 0, as the reference).
__attribute__((always_inline)) inline void finish(const float* acc, const float* sum, float* dst, int64_t H) {
  const float inv = 1.0f / std::max(*sum, 1e-30f);
  for (int64_t h = 0; h < H; ++h) dst[h] = acc[h] * inv;
}

// Which item of n the job's i-th is, where split_run cut the n into `parts` ranges (the first
// n % parts of them one longer): range k holds items k, k + parts, k + 2 parts, ..., so items of
// different cost mix between the threads. At one part, item i.
__attribute__((always_inline)) inline int64_t interleaved(int64_t i, int64_t n, int64_t parts) {
  const int64_t q = n / parts, extra = n % parts, long_ones = extra * (q + 1);
  const int64_t k = i < long_ones ? i / (q + 1) : extra + (i - long_ones) / q;
  const int64_t at = i < long_ones ? i % (q + 1) : (i - long_ones) % q;
  return at * parts + k;
}

// One (row, KV head) item. acc [M, H], m, l [M] are the caller's scratch (M = T * G).
template <bool kInt8>
__attribute__((always_inline)) inline void item(const Rows& r, int64_t b, int64_t kh, float* acc, float* qm,
                                                float* mx, float* sum) {
  const int64_t T = r.T, H = r.H, ps = r.ps, G = r.N / r.K, M = T * G;
  const int32_t* qpos = r.qpos + b * T;
  int64_t qmin, qmax;
  load_queries(r, b, kh, kh + 1, qm, &qmin, &qmax);
  start_softmax(acc, mx, sum, M, H);
  const int64_t lim = std::min<int64_t>(r.end[b], qmax + 1);  // no position at or past lim is read
  const int64_t start = r.window > 0 ? std::max<int64_t>(0, qmin - r.window + 1) : 0;
  const int64_t page0 = r.base[b];
  float s[kMaxPage], p[kMaxPage];
  for (int64_t c = 0; c < r.n; ++c) {
    const int64_t pos0 = (page0 + c) * ps;
    if (pos0 >= lim) break;
    if (pos0 + ps <= start) continue;
    const int64_t page = std::clamp<int64_t>(r.table[b * r.n + c], 0, r.P - 1);
    const int64_t at = (page * r.K + kh) * H * ps;
    const float* kf = static_cast<const float*>(r.k) + at;
    const float* vf = static_cast<const float*>(r.v) + at;
    const int8_t* k8 = static_cast<const int8_t*>(r.k) + at;
    const int8_t* v8 = static_cast<const int8_t*>(r.v) + at;
    const float* kscale = kInt8 ? r.ks + (page * r.K + kh) * ps : nullptr;
    const float* vscale = kInt8 ? r.vs + (page * r.K + kh) * ps : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t qp = qpos[m / G];
      const int64_t hi = std::min<int64_t>(std::min<int64_t>(ps, lim - pos0), qp - pos0 + 1);
      const int64_t lo = r.window > 0 ? std::max<int64_t>(0, qp - r.window + 1 - pos0) : 0;
      if (hi <= lo) continue;
      const float* qv = qm + m * H;
      for (int64_t o = 0; o < ps; ++o) s[o] = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const float qh = qv[h];
        if constexpr (kInt8) {
          const int8_t* kr = k8 + h * ps;
          for (int64_t o = 0; o < ps; ++o) s[o] += qh * static_cast<float>(kr[o]);
        } else {
          const float* kr = kf + h * ps;
          for (int64_t o = 0; o < ps; ++o) s[o] += qh * kr[o];
        }
      }
      if constexpr (kInt8) {
        for (int64_t o = 0; o < ps; ++o) s[o] *= kscale[o];
      }
      if (r.softcap > 0.0f) {
        for (int64_t o = lo; o < hi; ++o) s[o] = r.softcap * std::tanh(s[o] / r.softcap);
      }
      float top = mx[m];
      for (int64_t o = lo; o < hi; ++o) top = s[o] > top ? s[o] : top;
      const float a = exp_nonpos(mx[m] - top);
      for (int64_t o = 0; o < ps; ++o) p[o] = exp_nonpos(s[o] - top);  // every lane: vectorized
      float add = 0.0f;
      for (int64_t o = lo; o < hi; ++o) add += p[o];
      sum[m] = sum[m] * a + add;
      mx[m] = top;
      float* am = acc + m * H;
      if (a != 1.0f) {
        for (int64_t h = 0; h < H; ++h) am[h] *= a;
      }
      for (int64_t o = lo; o < hi; ++o) {
        if constexpr (kInt8) {
          const float w = p[o] * vscale[o];
          const int8_t* vr = v8 + o * H;
          for (int64_t h = 0; h < H; ++h) am[h] += w * static_cast<float>(vr[h]);
        } else {
          const float w = p[o];
          const float* vr = vf + o * H;
          for (int64_t h = 0; h < H; ++h) am[h] += w * vr[h];
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) finish(acc + m * H, sum + m, r.out + ((b * T + m / G) * r.N + kh * G + m % G) * H, H);
}


// Across the 16 lanes, in four halving steps.
__attribute__((always_inline)) inline float hmax16(v16f v) {
  v16f t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  v = v > t ? v : t;
  return v[0];
}
__attribute__((always_inline)) inline float hsum16(v16f v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Sixteen key positions: key row h (16 lanes) at k + h * kstride, value row o at v + o * vstride
// (elements), with per-position scales for int8.
struct Keys16 {
  const void* k;
  const void* v;
  const float* kscale;
  const float* vscale;
  int64_t kstride, vstride;
  v16i pos;       // the lanes' positions
  int64_t rows;   // value rows [0, rows) may be read (past them: unwritten, maybe NaN)
  v16i ok;        // lanes any query may see (written, in the row's segment, ...)
  bool segments;  // a query sees only lanes of its own segment (kseg)
  v16i kseg;
  const char* pfk = nullptr;  // bytes [0, pf_bytes) at each are asked for (spread through the scores)
  const char* pfv = nullptr;
  int64_t pf_bytes = 0;
};

// The queries of one item: scaled queries qm [M, H], running max mx, sum and accumulators acc
// [M, H]; query m is token m / G at position qpos[m / G] in segment qseg[m / G].
struct Queries {
  const float* qm;
  float* acc;
  float* mx;
  float* sum;
  const int32_t* qpos;
  const int32_t* qseg;
  int64_t G, H, window;  // window 0: none
  float softcap;         // 0: none
};

// Chunks of the head dim whose value accumulators one pass keeps in registers: four (64
// floats) in AVX-512's 32 registers, one in AVX2's 16.
constexpr int kWideChunks = kAvx512 ? 4 : 1;

// ---------------------------------------------------------------- AVX2's hot loops
// GCC 12 keeps a v16f (two ymm registers under AVX2) of a loop's accumulators in the stack
// and moves it through general registers on every step (vmovq / vpinsrq around each FMA), so
// the AVX2 variant runs its score and value loops on explicit __m256 halves instead. int8 keys
// and values widen to float32 in registers, 8 at a time (vpmovsxbd from memory, vcvtdq2ps),
// and every widened vector serves all QG queries; their scales apply once per block to the
// scores and to the softmax weights (Keys16::kscale, vscale), never per element.

// Lanes [at, at + 16) of a key or value row, float32 or int8, as two 8-lane halves.
template <bool kInt8>
__attribute__((always_inline)) inline void load8x2(const void* p, int64_t at, __m256* lo, __m256* hi) {
  if constexpr (kInt8) {
    const int8_t* b = static_cast<const int8_t*>(p) + at;
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))));
  } else {
    const float* f = static_cast<const float*>(p) + at;
    *lo = _mm256_loadu_ps(f);
    *hi = _mm256_loadu_ps(f + 8);
  }
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

template <typename V>
__attribute__((always_inline)) inline V half8(const void* p, int l) {  // lanes [8 l, 8 l + 8) of 16
  V v;
  std::memcpy(&v, static_cast<const char*>(p) + 32 * l, sizeof v);
  return v;
}
__attribute__((always_inline)) inline float hmax8(v8f v) {
  v8f t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  v = v > t ? v : t;
  return v[0];
}
__attribute__((always_inline)) inline float hsum8(v8f v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

// Chains per (query, half) the AVX2 loops keep: two (even and odd steps) while the QG x 2 x 2
// accumulators, a loaded pair and a broadcast fit AVX2's 16 registers (QG <= 3), else one.
template <int QG>
constexpr int kChains = QG <= 3 ? 2 : 1;

// The QG queries' scores (qm rows from q0, H wide) against the block's 16 keys, into s[QG]
// (lanes 0-7, 8-15).
template <int QG, bool kInt8>
__attribute__((always_inline)) inline void scores_avx2(const Keys16& kb, const float* q0, int64_t H, v8f (*s)[2]) {
  constexpr int E = kChains<QG>;
  const int64_t ks = kb.kstride;
  __m256 a[E][QG][2];
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < QG; ++j) a[e][j][0] = a[e][j][1] = _mm256_setzero_ps();
  const int64_t per = (kb.pf_bytes + 32 * H - 1) / (32 * H);  // as block16: spread over H / 2 steps
  int64_t pf = 0;
  for (int64_t h = 0; h < H; h += 2) {
    for (int64_t u = 0; u < per && pf < kb.pf_bytes; ++u, pf += 64) {
      __builtin_prefetch(kb.pfk + pf);
      __builtin_prefetch(kb.pfv + pf);
    }
    for (int d = 0; d < 2; ++d) {
      __m256 lo, hi;
      load8x2<kInt8>(kb.k, (h + d) * ks, &lo, &hi);
      const int e = d % E;
      for (int j = 0; j < QG; ++j) {
        const __m256 b = _mm256_broadcast_ss(q0 + j * H + h + d);
        a[e][j][0] = _mm256_fmadd_ps(b, lo, a[e][j][0]);
        a[e][j][1] = _mm256_fmadd_ps(b, hi, a[e][j][1]);
      }
    }
  }
  for (int j = 0; j < QG; ++j) {
    for (int l = 0; l < 2; ++l) s[j][l] = E == 2 ? _mm256_add_ps(a[0][j][l], a[E - 1][j][l]) : a[0][j][l];
  }
}

// Columns [c, c + 16) of the QG queries' accumulators from m0: rescaled by alpha, plus the
// block's values weighted by pw.
template <int QG, bool kInt8>
__attribute__((always_inline)) inline void values_avx2(const Keys16& kb, const Queries& qs, int64_t m0, int64_t c,
                                                       const float (*pw)[16], const float* alpha) {
  constexpr int E = kChains<QG>;
  const int64_t H = qs.H;
  __m256 a[E][QG][2];
  for (int j = 0; j < QG; ++j) {
    const __m256 al = _mm256_set1_ps(alpha[j]);
    float* at = qs.acc + (m0 + j) * H + c;
    a[0][j][0] = _mm256_mul_ps(_mm256_loadu_ps(at), al);
    a[0][j][1] = _mm256_mul_ps(_mm256_loadu_ps(at + 8), al);
    for (int e = 1; e < E; ++e) a[e][j][0] = a[e][j][1] = _mm256_setzero_ps();
  }
  int64_t o = 0;
  for (; o + E <= kb.rows; o += E) {
    for (int e = 0; e < E; ++e) {
      __m256 lo, hi;
      load8x2<kInt8>(kb.v, (o + e) * kb.vstride + c, &lo, &hi);
      for (int j = 0; j < QG; ++j) {
        const __m256 w = _mm256_broadcast_ss(&pw[j][o + e]);
        a[e][j][0] = _mm256_fmadd_ps(w, lo, a[e][j][0]);
        a[e][j][1] = _mm256_fmadd_ps(w, hi, a[e][j][1]);
      }
    }
  }
  for (; o < kb.rows; ++o) {
    __m256 lo, hi;
    load8x2<kInt8>(kb.v, o * kb.vstride + c, &lo, &hi);
    for (int j = 0; j < QG; ++j) {
      const __m256 w = _mm256_broadcast_ss(&pw[j][o]);
      a[0][j][0] = _mm256_fmadd_ps(w, lo, a[0][j][0]);
      a[0][j][1] = _mm256_fmadd_ps(w, hi, a[0][j][1]);
    }
  }
  for (int j = 0; j < QG; ++j) {
    float* at = qs.acc + (m0 + j) * H + c;
    if constexpr (E == 2) {
      _mm256_storeu_ps(at, _mm256_add_ps(a[0][j][0], a[1][j][0]));
      _mm256_storeu_ps(at + 8, _mm256_add_ps(a[0][j][1], a[1][j][1]));
    } else {
      _mm256_storeu_ps(at, a[0][j][0]);
      _mm256_storeu_ps(at + 8, a[0][j][1]);
    }
  }
}

// block16 (below) for AVX2: the same steps, on 8-lane halves.
template <int QG, bool kInt8>
__attribute__((always_inline)) inline void block16_avx2(const Keys16& kb, const Queries& qs, int64_t m0) {
  const int64_t H = qs.H;
  v8f s[QG][2];
  scores_avx2<QG, kInt8>(kb, qs.qm + m0 * H, H, s);
  alignas(64) float pw[QG][16];
  float alpha[QG];
  for (int j = 0; j < QG; ++j) {
    const int64_t m = m0 + j;
    const int32_t qp = qs.qpos[m / qs.G];
    v8f sj[2];
    v8i ok[2];
    for (int l = 0; l < 2; ++l) {
      const v8i kpos = half8<v8i>(&kb.pos, l);
      ok[l] = half8<v8i>(&kb.ok, l) & (kpos <= qp);
      if (qs.window > 0) ok[l] &= (qp - kpos) < static_cast<int32_t>(qs.window);
      if (kb.segments) ok[l] &= half8<v8i>(&kb.kseg, l) == qs.qseg[m / qs.G];
      sj[l] = kInt8 ? s[j][l] * half8<v8f>(kb.kscale, l) : s[j][l];
    }
    if (qs.softcap > 0.0f) {
      alignas(64) float t[16];
      std::memcpy(t, sj, sizeof t);
      for (int o = 0; o < 16; ++o) t[o] = qs.softcap * std::tanh(t[o] / qs.softcap);
      std::memcpy(sj, t, sizeof t);
    }
    for (int l = 0; l < 2; ++l) sj[l] = ok[l] ? sj[l] : v8f{} + kNeg;
    const float top = std::max(qs.mx[m], hmax8(sj[0] > sj[1] ? sj[0] : sj[1]));
    alpha[j] = exp_nonpos(qs.mx[m] - top);
    v8f p[2];
    for (int l = 0; l < 2; ++l) {
      p[l] = exp_poly<v8f, v8i>(sj[l] - top);
      p[l] = ok[l] ? p[l] : v8f{};
    }
    qs.sum[m] = qs.sum[m] * alpha[j] + hsum8(p[0] + p[1]);
    qs.mx[m] = top;
    for (int l = 0; l < 2; ++l) {
      const v8f w = kInt8 ? p[l] * half8<v8f>(kb.vscale, l) : p[l];
      std::memcpy(&pw[j][8 * l], &w, sizeof w);
    }
  }
  for (int64_t c = 0; c < H; c += 16) values_avx2<QG, kInt8>(kb, qs, m0, c, pw, alpha);
}

// Columns [c, c + 16 CW) of the QG queries' accumulators from m0: rescaled by alpha, plus the
// block's values weighted by pw.
template <int QG, int CW, bool kInt8>
__attribute__((always_inline)) inline void values16(const Keys16& kb, const Queries& qs, int64_t m0, int64_t c,
                                                    const float (*pw)[16], const float* alpha) {
  const int64_t H = qs.H;
  v16f a[QG][CW];
  for (int j = 0; j < QG; ++j)
    for (int w = 0; w < CW; ++w) a[j][w] = load16(qs.acc + (m0 + j) * H + c + 16 * w) * alpha[j];
  for (int64_t o = 0; o < kb.rows; ++o) {
    for (int w = 0; w < CW; ++w) {
      const v16f vv = kInt8 ? load16(static_cast<const int8_t*>(kb.v) + o * kb.vstride + c + 16 * w)
                            : load16(static_cast<const float*>(kb.v) + o * kb.vstride + c + 16 * w);
      for (int j = 0; j < QG; ++j) a[j][w] += pw[j][o] * vv;
    }
  }
  for (int j = 0; j < QG; ++j)
    for (int w = 0; w < CW; ++w) store16(qs.acc + (m0 + j) * H + c + 16 * w, a[j][w]);
}

// One block of 16 keys for the QG queries from m0: fold its scores into their running softmax
// and accumulators.
template <int QG, bool kInt8>
__attribute__((always_inline)) inline void block16(const Keys16& kb, const Queries& qs, int64_t m0) {
  if constexpr (!kAvx512) {
    block16_avx2<QG, kInt8>(kb, qs, m0);
    return;
  }
  const int64_t H = qs.H, ks = kb.kstride;
  // two partial sums per query (even and odd h), named so they stay in registers
  const float* q0 = qs.qm + m0 * H;
  v16f s0a{}, s0b{}, s1a{}, s1b{}, s2a{}, s2b{}, s3a{}, s3b{};
  // the page ahead's lines, a few per step of h: no burst of prefetches waits on the fill buffers
  const int64_t per = (kb.pf_bytes + 32 * H - 1) / (32 * H);  // lines per step, H / 2 steps
  int64_t pf = 0;
  for (int64_t h = 0; h < H; h += 2) {
    for (int64_t u = 0; u < per && pf < kb.pf_bytes; ++u, pf += 64) {
      __builtin_prefetch(kb.pfk + pf);
      __builtin_prefetch(kb.pfv + pf);
    }
    const v16f ka = kInt8 ? load16(static_cast<const int8_t*>(kb.k) + h * ks)
                          : load16(static_cast<const float*>(kb.k) + h * ks);
    const v16f kz = kInt8 ? load16(static_cast<const int8_t*>(kb.k) + (h + 1) * ks)
                          : load16(static_cast<const float*>(kb.k) + (h + 1) * ks);
    s0a += q0[h] * ka;
    s0b += q0[h + 1] * kz;
    if constexpr (QG > 1) {
      s1a += q0[H + h] * ka;
      s1b += q0[H + h + 1] * kz;
    }
    if constexpr (QG > 2) {
      s2a += q0[2 * H + h] * ka;
      s2b += q0[2 * H + h + 1] * kz;
    }
    if constexpr (QG > 3) {
      s3a += q0[3 * H + h] * ka;
      s3b += q0[3 * H + h + 1] * kz;
    }
  }
  const v16f s[4] = {s0a + s0b, s1a + s1b, s2a + s2b, s3a + s3b};
  const v16i kpos = kb.pos;
  alignas(64) float pw[QG][16];
  float alpha[QG];
  for (int j = 0; j < QG; ++j) {
    const int64_t m = m0 + j;
    const int32_t qp = qs.qpos[m / qs.G];
    v16i ok = kb.ok & (kpos <= qp);
    if (qs.window > 0) ok &= (qp - kpos) < static_cast<int32_t>(qs.window);
    if (kb.segments) ok &= kb.kseg == qs.qseg[m / qs.G];
    v16f sj = kInt8 ? s[j] * load16(kb.kscale) : s[j];
    if (qs.softcap > 0.0f) {
      alignas(64) float t[16];
      store16(t, sj);
      for (int o = 0; o < 16; ++o) t[o] = qs.softcap * std::tanh(t[o] / qs.softcap);
      sj = load16(t);
    }
    sj = ok ? sj : splat(kNeg);
    const float top = std::max(qs.mx[m], hmax16(sj));
    alpha[j] = exp_nonpos(qs.mx[m] - top);
    v16f p = exp16(sj - top);
    p = ok ? p : v16f{};
    qs.sum[m] = qs.sum[m] * alpha[j] + hsum16(p);
    qs.mx[m] = top;
    store16(pw[j], kInt8 ? p * load16(kb.vscale) : p);
  }
  // The values: CW 16-wide chunks of the head dim at a time, so that QG x CW multiply-add
  // chains run side by side (one chunk's QG chains alone wait on the FMA latency).
  int64_t c = 0;
  if constexpr (kWideChunks > 1) {
    for (; c + 16 * kWideChunks <= H; c += 16 * kWideChunks) values16<QG, kWideChunks, kInt8>(kb, qs, m0, c, pw, alpha);
  }
  for (; c < H; c += 16) values16<QG, 1, kInt8>(kb, qs, m0, c, pw, alpha);
}

// block16 for queries [0, M), in register groups of at most kMaxGroup, as even as possible.
template <bool kInt8>
__attribute__((always_inline)) inline void block16_all(const Keys16& kb, const Queries& qs, int64_t M) {
  const int64_t groups = (M + kMaxGroup - 1) / kMaxGroup;
  Keys16 b = kb;  // the first group asks for the lines ahead, the others need not again
  for (int64_t gi = 0, m0 = 0; gi < groups; ++gi) {
    const int64_t size = (M - m0) / (groups - gi);
    switch (size) {
      case 1:
        block16<1, kInt8>(b, qs, m0);
        break;
      case 2:
        block16<2, kInt8>(b, qs, m0);
        break;
      case 3:
        block16<3, kInt8>(b, qs, m0);
        break;
      default:
        block16<4, kInt8>(b, qs, m0);
        break;
    }
    b.pf_bytes = 0;
    m0 += size;
  }
}

// Positions [pos, pos + 16) of a page: sub-block sb of page `page`, KV head kh, of the pools k
// [P, K, H, ps] and v [P, K, ps, H] (and int8 scales ks, vs [P, K, ps]); positions at or past
// lim are unwritten.
template <bool kInt8>
__attribute__((always_inline)) inline Keys16 page_block(const void* k, const void* v, const float* ks,
                                                        const float* vs, int64_t page, int64_t K, int64_t kh,
                                                        int64_t H, int64_t ps, int64_t sb, int64_t pos,
                                                        int64_t lim) {
  const int64_t at = (page * K + kh) * H * ps, koff = at + sb, voff = at + sb * H;
  const v16i kpos = v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + static_cast<int32_t>(pos);
  return Keys16{kInt8 ? static_cast<const void*>(static_cast<const int8_t*>(k) + koff)
                      : static_cast<const void*>(static_cast<const float*>(k) + koff),
                kInt8 ? static_cast<const void*>(static_cast<const int8_t*>(v) + voff)
                      : static_cast<const void*>(static_cast<const float*>(v) + voff),
                kInt8 ? ks + (page * K + kh) * ps + sb : nullptr,
                kInt8 ? vs + (page * K + kh) * ps + sb : nullptr,
                ps, H, kpos, std::min<int64_t>(16, lim - pos), kpos < static_cast<int32_t>(lim), false, v16i{}};
}

// A page of the pool holds its keys [K, H, ps] and values [K, ps, H] for all KV heads, a few
// KB each, at a random place: the hardware prefetchers do not cross into the next page, so
// without help every page starts with a wait on memory (most of the kernel's time in a running
// engine's step, by perf). A row's work walks its pages in order, all heads of one page
// together, and asks for the page kAheadPages ahead while it works: each 16-key block asks for
// its share of that page (its head's keys and values), a few lines per step of its score loop
// (Keys16::pfk). Asking for a whole page at once (as prefetch_page does for a row's first
// pages) queues hundreds of prefetches behind the core's few line-fill buffers, and the work
// waits behind them: spread out, the 64-row decode attention over scattered pages ran 11%
// (float32) and 14% (int8) faster in a standalone harness.
constexpr int64_t kAheadPages = 2;

template <bool kInt8>
__attribute__((always_inline)) inline void prefetch_page(const Rows& r, int64_t b, int64_t c) {
  const int64_t page = std::clamp<int64_t>(r.table[b * r.n + c], 0, r.P - 1);
  const int64_t bytes = r.K * r.H * r.ps * (kInt8 ? 1 : 4), at = page * bytes;
  const char* k = static_cast<const char*>(r.k) + at;
  const char* v = static_cast<const char*>(r.v) + at;
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(k + i);
    __builtin_prefetch(v + i);
  }
  if constexpr (kInt8) {
    for (int64_t i = 0; i < r.K * r.ps; i += 16) {
      __builtin_prefetch(r.ks + page * r.K * r.ps + i);
      __builtin_prefetch(r.vs + page * r.K * r.ps + i);
    }
  }
}

// Row b, every KV head: acc [K * M, H], qm [K * M, H], mx and sum [K * M] (M = T * G queries
// per head) are the caller's scratch.
template <bool kInt8>
__attribute__((always_inline)) inline void row16(const Rows& r, int64_t b, float* acc, float* qm, float* mx,
                                                 float* sum) {
  const int64_t T = r.T, H = r.H, ps = r.ps, K = r.K, G = r.N / K, M = T * G;
  const int32_t* qpos = r.qpos + b * T;
  int64_t qmin, qmax;
  load_queries(r, b, 0, K, qm, &qmin, &qmax);
  start_softmax(acc, mx, sum, K * M, H);
  const int64_t lim = std::min<int64_t>(r.end[b], qmax + 1);
  const int64_t start = r.window > 0 ? std::max<int64_t>(0, qmin - r.window + 1) : 0;
  for (int64_t c = 0; c < r.n; ++c) {
    const int64_t pos0 = (r.base[b] + c) * ps;
    if (pos0 >= lim) break;
    if (pos0 + ps <= start) continue;
    const int64_t page = std::clamp<int64_t>(r.table[b * r.n + c], 0, r.P - 1);
    const bool ahead = c + kAheadPages < r.n && pos0 + kAheadPages * ps < lim;
    const int64_t pa = ahead ? std::clamp<int64_t>(r.table[b * r.n + c + kAheadPages], 0, r.P - 1) : 0;
    const int64_t hb = H * ps * (kInt8 ? 1 : 4), share = hb / (ps / 16);
    for (int64_t kh = 0; kh < K; ++kh) {
      if (ahead && kInt8) {
        for (int64_t i = 0; i < ps; i += 16) {
          __builtin_prefetch(r.ks + (pa * K + kh) * ps + i);
          __builtin_prefetch(r.vs + (pa * K + kh) * ps + i);
        }
      }
      const Queries qs{qm + kh * M * H, acc + kh * M * H, mx + kh * M, sum + kh * M, qpos, nullptr, G, H,
                       r.window, r.softcap};
      for (int64_t sb = 0; sb < ps && pos0 + sb < lim; sb += 16) {
        if (pos0 + sb + 16 <= start) continue;
        Keys16 kb = page_block<kInt8>(r.k, r.v, r.ks, r.vs, page, K, kh, H, ps, sb, pos0 + sb, lim);
        if (ahead) {
          kb.pfk = static_cast<const char*>(r.k) + (pa * K + kh) * hb + sb / 16 * share;
          kb.pfv = static_cast<const char*>(r.v) + (pa * K + kh) * hb + sb / 16 * share;
          kb.pf_bytes = share;
        }
        block16_all<kInt8>(kb, qs, M);
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t kh = 0; kh < K; ++kh) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = kh * M + t * G + g;
        finish(acc + m * H, sum + m, r.out + ((b * T + t) * r.N + kh * G + g) * H, H);
      }
    }
  }
}

// Rows [c0, c1) of a job, in the order interleaved() gives, so long and short rows mix.
template <bool kInt8>
__attribute__((always_inline)) inline void run_items(const Job& j) {
  const Rows& r = *static_cast<const Rows*>(j.x);
  const int64_t KM = r.K * r.T * (r.N / r.K);
  std::vector<float> scratch(KM * r.H * 2 + 2 * KM);
  float *acc = scratch.data(), *qm = acc + KM * r.H, *mx = qm + KM * r.H, *sum = mx + KM;
  const bool fast = r.ps % 16 == 0 && r.H % 16 == 0;
  for (int64_t i = j.c0; i < j.c1; ++i) {
    const int64_t b = interleaved(i, r.B, j.parts);
    if (fast && i + 1 < j.c1) {  // the next row's first pages (within a row, row16 runs ahead)
      for (int64_t c = 0; c < std::min(kAheadPages, r.n); ++c) prefetch_page<kInt8>(r, interleaved(i + 1, r.B, j.parts), c);
    }
    if (fast) {
      row16<kInt8>(r, b, acc, qm, mx, sum);
    } else {
      for (int64_t kh = 0; kh < r.K; ++kh) item<kInt8>(r, b, kh, acc, qm, mx, sum);
    }
  }
}

void run_f32(const Job& j) { run_items<false>(j); }
void run_i8(const Job& j) { run_items<true>(j); }

// ---------------------------------------------------------------- the packed prefill row
// Item (query block of 16 tokens, KV head). Its queries see the row's own keys of their segment
// up to their position (the segment's key blocks, transposed 16 at a time into kt [H, 16]), and
// segment-0 queries also the history pages before hist_end. Segments lie one after another and
// padding (segment -1) comes last, so a block's segment-0 tokens come first. Scratch: acc and
// qm [16 G, H], mx and sum [16 G], kt [H, 16].
template <bool kInt8>
__attribute__((always_inline)) inline void prefill_item(const Prefill& r, int64_t qb, int64_t kh, float* acc,
                                                        float* qm, float* mx, float* sum, float* kt) {
  const int64_t H = r.H, K = r.K, N = r.N, G = N / K, t0 = qb * 16;
  const int64_t t1 = std::min<int64_t>(t0 + 16, r.valid);  // the block's tokens that are not padding
  for (int64_t t = t0; t < t0 + 16; ++t) {  // padding queries see nothing: 0
    if (t < t1) continue;
    for (int64_t g = 0; g < G; ++g) std::fill_n(r.out + (t * N + kh * G + g) * H, H, 0.0f);
  }
  if (t1 <= t0) return;
  const int64_t M = (t1 - t0) * G;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = r.q + ((t0 + m / G) * N + kh * G + m % G) * H;
    for (int64_t h = 0; h < H; ++h) qm[m * H + h] = src[h] * r.scale;
  }
  start_softmax(acc, mx, sum, M, H);
  const Queries qs{qm, acc, mx, sum, r.pos + t0, r.seg + t0, G, H, r.window, r.softcap};
  const v16i lanes = v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int32_t s0 = r.seg[t0];
  const int64_t start = r.window > 0 ? std::max<int64_t>(0, r.pos[t0] - r.window + 1) : 0;
  if (s0 == 0 && r.hist_end > 0) {  // segment 0's earlier positions, from its pages
    int64_t t0_end = t0;
    while (t0_end < t1 && r.seg[t0_end] == 0) ++t0_end;
    const int64_t M0 = (t0_end - t0) * G, ps = r.ps;
    for (int64_t c = 0; c < r.n; ++c) {
      const int64_t pos0 = (r.base0 + c) * ps;
      if (pos0 >= r.hist_end) break;
      if (pos0 + ps <= start) continue;
      const int64_t page = std::clamp<int64_t>(r.table[c], 0, r.P - 1);
      for (int64_t sb = 0; sb < ps && pos0 + sb < r.hist_end; sb += 16) {
        if (pos0 + sb + 16 <= start) continue;
        block16_all<kInt8>(page_block<kInt8>(r.kp, r.vp, r.ks, r.vs, page, K, kh, H, ps, sb, pos0 + sb, r.hist_end),
                           qs, M0);
      }
    }
  }
  int64_t first = t0;  // the first token of the block's first segment
  while (first > 0 && r.seg[first - 1] == s0) --first;
  for (int64_t j = first / 16 * 16; j < t1; j += 16) {
    const int64_t rows = std::min<int64_t>(16, r.valid - j);
    for (int64_t o = 0; o < 16; ++o) {
      const float* src = r.k + ((j + std::min(o, rows - 1)) * K + kh) * H;  // past rows: a copy (masked)
      for (int64_t h = 0; h < H; ++h) kt[h * 16 + o] = src[h];
    }
    v16i kpos, kseg;
    std::memcpy(&kpos, r.pos + j, sizeof kpos);
    std::memcpy(&kseg, r.seg + j, sizeof kseg);
    const Keys16 kb{kt, r.v + (j * K + kh) * H, nullptr, nullptr, 16, K * H, kpos, rows,
                    (kseg >= 0) & (lanes < static_cast<int32_t>(rows)), true, kseg};
    block16_all<false>(kb, qs, M);
  }
  for (int64_t m = 0; m < M; ++m) {
    finish(acc + m * H, sum + m, r.out + ((t0 + m / G) * N + kh * G + m % G) * H, H);
  }
}

// Items [c0, c1) of a prefill job: (query block, KV head) pairs in the order interleaved() gives
// (later blocks see more keys).
template <bool kInt8>
__attribute__((always_inline)) inline void run_prefill(const Job& j) {
  const Prefill& r = *static_cast<const Prefill*>(j.x);
  const int64_t G = r.N / r.K;
  std::vector<float> scratch(16 * G * r.H * 2 + 2 * 16 * G + 16 * r.H);
  float *acc = scratch.data(), *qm = acc + 16 * G * r.H, *mx = qm + 16 * G * r.H, *sum = mx + 16 * G;
  float* kt = sum + 16 * G;
  for (int64_t i = j.c0; i < j.c1; ++i) {
    const int64_t w = interleaved(i, r.T / 16 * r.K, j.parts);
    prefill_item<kInt8>(r, w / r.K, w % r.K, acc, qm, mx, sum, kt);
  }
}

void prefill_f32(const Job& j) { run_prefill<false>(j); }
void prefill_i8(const Job& j) { run_prefill<true>(j); }
