/* Is SwiGLU's division what holds silu_mul_bf16 (layer_glue.c)? A probe (session 58),
   not built by the project.

   silu(g) = g / (1 + exp(-g)) divides with VDIVPS. Markstein's correction computes the
   same quotient without it: y = rcp14(d) refined once by Newton-Raphson, q0 = g * y,
   q = q0 + y * (g - q0 * d) with FMAs (an infinite g keeps q0). g is a bf16, so every
   input there is can be checked: the probe compares both for all 65,536 bit patterns, in
   fp32 and after the kernel's rounding to bf16, then times both:
   - in cache: 256 x 2,048 fp32 values in, fp32 out (the arithmetic alone);
   - as the kernel runs in a prompt: [256][4,096] bf16 gate/up in (2 MiB, as oneDNN
     leaves it), [256][2,048] bf16 out, over 12 such buffers in turn (12 layers), so each
     is read from beyond L2 as in a step.

   gcc -O3 -march=native -Iappliance/engines/cpu_kernels -o /tmp/silu_division bench/silu_division.c
   taskset -c 1 /tmp/silu_division */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vec_math.h"

static inline __m512 silu_div(__m512 v) {
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                          exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

static inline __m512 silu_markstein(__m512 v) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 d = _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v)));
    __m512 y = _mm512_rcp14_ps(d);
    y = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y, one), y, y);
    const __m512 q0 = _mm512_mul_ps(v, y);
    const __m512 q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, d, v), y, q0);
    return _mm512_mask_mov_ps(q, _mm512_fpclass_ps_mask(v, 0x18), q0);   /* +-inf */
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define ROWS 256
#define INTER 2048
#define LAYERS 12

static void silu_mul(const uint16_t* gu, uint16_t* out, int markstein) {
    for (int64_t r = 0; r < ROWS; r++) {
        const uint16_t* g = gu + r * 2 * INTER;
        for (int64_t i = 0; i < INTER; i += 16) {
            const __m512 v = load_bf16(g + i);
            const __m512 s = round_bf16(markstein ? silu_markstein(v) : silu_div(v));
            store_bf16(out + r * INTER + i, _mm512_mul_ps(s, load_bf16(g + INTER + i)), 0xffff);
        }
    }
}

int main(void) {
    long diff32 = 0, diff16 = 0;
    for (uint32_t b = 0; b < 65536; b += 16) {
        uint32_t in[16], a[16], c[16], ra[16], rc[16];
        for (int i = 0; i < 16; i++) in[i] = (b + i) << 16;
        const __m512 v = _mm512_loadu_ps((const float*)in);
        _mm512_storeu_ps((float*)a, silu_div(v));
        _mm512_storeu_ps((float*)c, silu_markstein(v));
        _mm512_storeu_ps((float*)ra, round_bf16(silu_div(v)));
        _mm512_storeu_ps((float*)rc, round_bf16(silu_markstein(v)));
        for (int i = 0; i < 16; i++) {
            const int nan_a = (a[i] & 0x7fffffff) > 0x7f800000, nan_c = (c[i] & 0x7fffffff) > 0x7f800000;
            if (nan_a && nan_c) continue;
            if (a[i] != c[i]) {
                float x, fa, fc;
                memcpy(&x, &in[i], 4), memcpy(&fa, &a[i], 4), memcpy(&fc, &c[i], 4);
                printf("  g = %g (bf16 0x%04x): VDIVPS %.9g, Markstein %.9g\n", x, b + i, fa, fc);
                diff32++;
            }
            diff16 += ra[i] != rc[i];
        }
    }
    printf("all 65536 bf16 inputs: %ld differ in fp32, %ld after rounding to bf16\n", diff32, diff16);

    const int64_t n = (int64_t)ROWS * INTER;
    float* x = aligned_alloc(64, n * 4);
    float* y = aligned_alloc(64, n * 4);
    uint16_t* gu[LAYERS];
    uint16_t* out[LAYERS];
    srand(1);
    for (int64_t i = 0; i < n; i++) x[i] = (float)((rand() % 2000) - 1000) / 100.0f;
    for (int l = 0; l < LAYERS; l++) {
        gu[l] = aligned_alloc(64, 2 * n * 2);
        out[l] = aligned_alloc(64, n * 2);
        for (int64_t i = 0; i < 2 * n; i++) gu[l][i] = (uint16_t)(((uint32_t)(rand() % 1600) + 0x3c00u) ^ (rand() & 0x8000));
        memset(out[l], 0, n * 2);
    }
    for (int round = 0; round < 3; round++) {
        for (int m = 0; m < 2; m++) {
            double best = 1e9, best_kernel = 1e9;
            for (int rep = 0; rep < 20; rep++) {
                double t = now();
                for (int64_t i = 0; i < n; i += 16) {
                    const __m512 v = _mm512_load_ps(x + i);
                    _mm512_store_ps(y + i, m ? silu_markstein(v) : silu_div(v));
                }
                t = now() - t;
                if (t < best) best = t;
            }
            for (int rep = 0; rep < 5; rep++) {
                double t = now();
                for (int l = 0; l < LAYERS; l++) silu_mul(gu[l], out[l], m);
                t = (now() - t) / LAYERS;
                if (t < best_kernel) best_kernel = t;
            }
            printf("round %d %-9s in cache %.3f ms (%.2f ns a value); as the kernel, beyond L2 %.3f ms a layer\n",
                   round, m ? "Markstein" : "VDIVPS", best * 1e3, best * 1e9 / n, best_kernel * 1e3);
        }
    }
    return y[3] > 1e30f && out[0][1] == 7;
}
