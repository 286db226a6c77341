// Sustained throughput of the vector instructions an int8 or float32 matmul kernel is built
// from, on one thread of this CPU, timed by the thread's CPU time (best of 5 runs of 20 M
// iterations, 6 or 12 independent chains each): the ceilings the kernels are measured against
// (RESULTS.md, "w8a8 on AVX2: packed weights"). Multiply-adds per instruction: vfmadd231ps 8,
// vpmaddwd 16, vpmaddubsw 32. A mix is counted per its first instruction.
//   g++ -O2 -mavx2 -mfma -std=c++17 benchmarks/isa_throughput.cc -o /tmp/isa && /tmp/isa
#include <immintrin.h>
#include <time.h>
#include <cstdio>
#include <cstdint>
#include <algorithm>
static double now(){timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
template<class F> double bench(const char* name, int ops_per_iter, F f){
  double best=1e9; const long N=20000000;
  for(int r=0;r<5;r++){double t=now(); f(N); best=std::min(best,now()-t);}
  double gops = N*ops_per_iter/best/1e9;
  std::printf("%-40s %.2f G instr/s\n", name, gops); return gops;
}
int main(){
  bench("vfmadd231ps ymm (12 chains)",12,[](long n){
    __m256 a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11; __m256 b=_mm256_set1_ps(1.0001f),c=_mm256_set1_ps(1e-9f);
#define I(i) a##i=_mm256_set1_ps(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vfmadd231ps %1, %2, %0":"+x"(a##i):"x"(b),"x"(c));
      R12(F)
#undef F
    }
  });
  bench("vpmaddwd ymm (12 chains)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11; __m256i b=_mm256_set1_epi16(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddwd %1, %0, %0":"+x"(a##i):"x"(b));
      R12(F)
#undef F
    }
  });
  bench("vpmaddubsw ymm (12 chains)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11; __m256i b=_mm256_set1_epi8(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddubsw %1, %0, %0":"+x"(a##i):"x"(b));
      R12(F)
#undef F
    }
  });
  bench("vpaddd ymm (12 chains)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11; __m256i b=_mm256_set1_epi16(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpaddd %1, %0, %0":"+x"(a##i):"x"(b));
      R12(F)
#undef F
    }
  });
  bench("vpmaddwd+vpaddd (6 chains)",6,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,t0,t1,t2,t3,t4,t5; __m256i b=_mm256_set1_epi16(1),c=_mm256_set1_epi16(2);
#define I(i) a##i=_mm256_set1_epi32(i);
    I(0)I(1)I(2)I(3)I(4)I(5)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0":"+x"(a##i),"=&x"(t##i):"x"(b),"x"(c));
      F(0)F(1)F(2)F(3)F(4)F(5)
#undef F
    }
  });
  bench("vpmaddubsw+vpmaddwd+vpaddd (6 chains)",6,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,t0,t1,t2,t3,t4,t5; __m256i b=_mm256_set1_epi8(1),c=_mm256_set1_epi8(2),one=_mm256_set1_epi16(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    I(0)I(1)I(2)I(3)I(4)I(5)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddubsw %2, %3, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0":"+x"(a##i),"=&x"(t##i):"x"(b),"x"(c),"x"(one));
      F(0)F(1)F(2)F(3)F(4)F(5)
#undef F
    }
  });
  bench("vpmaddubsw+vpaddw (6 chains)",6,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,t0,t1,t2,t3,t4,t5; __m256i b=_mm256_set1_epi8(1),c=_mm256_set1_epi8(2);
#define I(i) a##i=_mm256_set1_epi32(i);
    I(0)I(1)I(2)I(3)I(4)I(5)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddubsw %2, %3, %1\n\tvpaddw %1, %0, %0":"+x"(a##i),"=&x"(t##i):"x"(b),"x"(c));
      F(0)F(1)F(2)F(3)F(4)F(5)
#undef F
    }
  });
  bench("vpsignb ymm (12 chains)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11; __m256i b=_mm256_set1_epi8(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpsignb %1, %0, %0":"+x"(a##i):"x"(b));
      R12(F)
#undef F
    }
  });
  bench("vpmovsxbw ymm<-m128 (12)",12,[](long n){
    alignas(64) static int8_t buf[256]={};
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11;
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmovsxbw %1, %0":"=x"(a##i):"m"(*(const __m128i*)(buf+16*i)));
      R12(F)
#undef F
    }
  });

  bench("vpmaddwd+vpaddd (12 chains)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,t; __m256i b=_mm256_set1_epi16(1),c=_mm256_set1_epi16(2);
#define I(i) a##i=_mm256_set1_epi32(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0":"+x"(a##i),"=&x"(t):"x"(b),"x"(c));
      R12(F)
#undef F
    }
  });
  bench("vpsignb+vpmaddubsw+vpmaddwd+vpaddd (6)",6,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,t0,t1,t2,t3,t4,t5; __m256i b=_mm256_set1_epi8(1),c=_mm256_set1_epi8(2),one=_mm256_set1_epi16(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    I(0)I(1)I(2)I(3)I(4)I(5)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpsignb %3, %2, %1\n\tvpmaddubsw %1, %3, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0":"+x"(a##i),"=&x"(t##i):"x"(b),"x"(c),"x"(one));
      F(0)F(1)F(2)F(3)F(4)F(5)
#undef F
    }
  });
  bench("2 vpmaddubsw+vpaddw+vpmaddwd+vpaddd (6)",12,[](long n){
    __m256i a0,a1,a2,a3,a4,a5,t0,t1,t2,t3,t4,t5,u; __m256i b=_mm256_set1_epi8(1),c=_mm256_set1_epi8(2),one=_mm256_set1_epi16(1);
#define I(i) a##i=_mm256_set1_epi32(i);
    I(0)I(1)I(2)I(3)I(4)I(5)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vpmaddubsw %2, %3, %1\n\tvpmaddubsw %3, %2, %5\n\tvpaddw %5, %1, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0":"+x"(a##i),"=&x"(t##i):"x"(b),"x"(c),"x"(one),"x"(u));
      F(0)F(1)F(2)F(3)F(4)F(5)
#undef F
    }
  });
  bench("vcvtdq2ps+vfmadd231ps (12 chains)",12,[](long n){
    __m256 a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,t; __m256i b=_mm256_set1_epi32(1); __m256 c=_mm256_set1_ps(2);
#define I(i) a##i=_mm256_set1_ps(i);
    R12(I)
#undef I
    for(long k=0;k<n;k++){
#define F(i) asm volatile("vcvtdq2ps %2, %1\n\tvfmadd231ps %1, %3, %0":"+x"(a##i),"=&x"(t):"x"(b),"x"(c));
      R12(F)
#undef F
    }
  });
}
