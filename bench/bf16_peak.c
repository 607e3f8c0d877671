/* One core's bf16 multiply-add peak on AVX512-BF16, at the clock it runs right now.

   Why: the CPU cells against vLLM are bound by arithmetic on both cores, and a host's
   clock decides how far any engine can go. This gives the ceiling to read a served
   figure against: a request of the 82m model is ~48.6 GFLOP of matmuls (319 tokens x
   151 MFLOP, plus the LM head on 64 rows), so a server's effective GFLOPS per core is
   48.6 / its CPU seconds per request, and the peak here is what no kernel passes.

   Twelve independent accumulators (more than VDPBF16PS's latency times its issue rate
   on any core measured here), register operands only: no loads, so no cache or memory
   in the figure. Each VDPBF16PS on zmm is 16 lanes x 2 products x 2 FLOP = 64 FLOP.

       gcc -O2 -mavx512f -mavx512bf16 -o /tmp/bf16_peak bench/bf16_peak.c
       taskset -c 1 /tmp/bf16_peak          # prints 5 rounds and the best, GFLOPS */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define STEP(a) a = _mm512_dpbf16_ps(a, w, x)

int main(void) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    const __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* 1.0 pairs */
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3c003c00); /* 2^-7 pairs */
    const long n = 200000000;
    double best = 0;
    for (int r = 0; r < 5; r++) {
        const double t0 = now();
        for (long i = 0; i < n; i++) {
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
            STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
            /* keep every chain live without a store in the loop */
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        const double dt = now() - t0, gflops = n * 12.0 * 64 / dt / 1e9;
        if (gflops > best) best = gflops;
        printf("%.1f GFLOPS (%.2f G VDPBF16PS/s)\n", gflops, n * 12.0 / dt / 1e9);
    }
    /* the sums, so that nothing above is dead code to the compiler */
    float sink[16];
    _mm512_storeu_ps(sink, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                         _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))));
    printf("best %.1f GFLOPS (checksum %g)\n", best, (double)sink[0] + (double)_mm512_reduce_add_ps(
               _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
    return 0;
}
