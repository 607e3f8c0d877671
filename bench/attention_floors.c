/* The floors under a decode step's attention at the 82m shape (12 query heads, 4 KV heads,
   head_dim 64, 16-token blocks, 300 positions a sequence): the tree's kernel
   (appliance/engines/cpu_kernels/paged_decode.c, included as it is built) against
   - a plain read of the same K and V blocks in the same order, no arithmetic: what one
     core's memory gives this access pattern (the kernel cannot beat it from memory);
   - the same kernel with K stored dimension-pair-major inside each block
     ([KVH][head_dim/2][16 positions][2]), so that a vector holds 16 positions' scores and
     no reduction across lanes is needed: a probe of the pool layout change that session
     56 left out, with the scores on VDPBF16PS ("kdm dp") or widened to fp32 and FMA'd
     ("kdm fma"); its softmax and values are the tree's. It prefetches the next block of
     K and V, and the next sequence's first block, as the tree's kernel does.

   Each line: B sequences over L layers' pools (L = 1 with a small B: the pools stay in
   L2, so the kernels' own rate; L = 12: from memory, as a served step), the best of five
   runs, ns per (position, query head) and GB/s of K and V, and whether the output is the
   tree kernel's byte for byte. Not built by the project: a probe for docs/benchmarks.md
   (session 57). Needs AVX512-BF16.

       gcc -O3 -march=native -o /tmp/attention_floors bench/attention_floors.c -lm
       taskset -c 1 /tmp/attention_floors */
#define _GNU_SOURCE
#include "../appliance/engines/cpu_kernels/paged_decode.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef __AVX512BF16__
#error "attention_floors needs AVX512-BF16 (-march=native on such a CPU)"
#endif

enum { H = 12, KVH = 4, HD = 64, BS = 16, CTX = 300 };
#define BLOCK_ELEMS ((int64_t)BS * KVH * HD)

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t* huge_alloc(size_t bytes) {
    bytes = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    uint16_t* p = aligned_alloc(2u << 20, bytes);
    if (!p) { perror("attention_floors"); exit(1); }
    madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

static uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* One KV head's 16 positions against its G query heads, K dimension-pair-major: the pair
   (2d, 2d+1) of 16 positions is one vector; its low halves (dim 2d) and high halves (dim
   2d+1) widened to fp32 by a shift and a mask, each multiplied by q's broadcast dims. */
INLINE void kdm_scores_fma(const uint16_t* kb, const float* qf, __m512* out, const int G) {
    __m512 a[4][2];
    for (int j = 0; j < G; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 32
    for (int d = 0; d < HD / 2; d++) {
        const __m512i kv = _mm512_load_si512(kb + 32 * d);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(kv, 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(kv, hi_mask));
#pragma GCC unroll 4
        for (int j = 0; j < G; j++) {
            a[j][0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(qf[j * HD + 2 * d]), a[j][0]);
            a[j][1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(qf[j * HD + 2 * d + 1]), a[j][1]);
        }
    }
    for (int j = 0; j < G; j++) out[j] = _mm512_add_ps(a[j][0], a[j][1]);
}

/* The same on VDPBF16PS: q's pair broadcast, two accumulators for the latency */
INLINE __m512 kdm_scores_dp(const uint16_t* kb, const uint16_t* qh) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    const uint32_t* q2 = (const uint32_t*)qh;
#pragma GCC unroll 16
    for (int d = 0; d < HD / 2; d += 2) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_load_si512(kb + 32 * d),
                              (__m512bh)_mm512_set1_epi32((int)q2[d]));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_load_si512(kb + 32 * (d + 1)),
                              (__m512bh)_mm512_set1_epi32((int)q2[d + 1]));
    }
    return _mm512_add_ps(a0, a1);
}

/* paged_decode's step with K dimension-pair-major (kpool) and V as the pool keeps it */
static void decode_kdm(const uint16_t* q, const uint16_t* kpool, const uint16_t* vpool,
                       const int64_t* tables, int64_t stride, int B, float scale, float* sc,
                       uint16_t* out, int fma) {
    const int g = H / KVH;
    float qf[H * HD] __attribute__((aligned(64)));
    for (int b = 0; b < B; b++) {
        const int n = CTX, nblk = (n + BS - 1) / BS;
        const int64_t* tab = tables + (int64_t)b * stride;
        const uint16_t* qb = q + (int64_t)b * H * HD;
        for (int i = 0; i < H * HD; i++) {
            const uint32_t u = (uint32_t)qb[i] << 16;
            memcpy(qf + i, &u, 4);
        }
        for (int k = 0; k < nblk; k++) {
            const int t0 = BS * k, nt = n - t0 < BS ? n - t0 : BS;
            const uint16_t* kb = kpool + tab[k] * BLOCK_ELEMS;
            const char* nk = k + 1 < nblk ? (const char*)(kpool + tab[k + 1] * BLOCK_ELEMS) : NULL;
            const char* nv = k + 1 < nblk ? (const char*)(vpool + tab[k + 1] * BLOCK_ELEMS) : NULL;
            const int64_t lines = BLOCK_ELEMS * 2 / 64;
            for (int kh = 0; kh < KVH; kh++) {
                if (nk)
                    for (int64_t l = lines * kh / KVH; l < lines * (kh + 1) / KVH; l++) {
                        _mm_prefetch(nk + 64 * l, _MM_HINT_T1);
                        _mm_prefetch(nv + 64 * l, _MM_HINT_T1);
                    }
                const uint16_t* kbh = kb + (int64_t)kh * HD * BS;
                __m512 s[4];
                if (fma)
                    kdm_scores_fma(kbh, qf + kh * g * HD, s, 3);
                else
                    for (int j = 0; j < g; j++) s[j] = kdm_scores_dp(kbh, qb + (kh * g + j) * HD);
                for (int j = 0; j < g; j++)
                    _mm512_mask_storeu_ps(sc + (int64_t)(kh * g + j) * n + t0, first(nt),
                                          _mm512_mul_ps(round_bf16(s[j]), _mm512_set1_ps(scale)));
            }
        }
        if (b + 1 < B) {   /* the next sequence's first block, as the tree's kernel does */
            const char* k1 = (const char*)(kpool + tables[(int64_t)(b + 1) * stride] * BLOCK_ELEMS);
            const char* v1 = (const char*)(vpool + tables[(int64_t)(b + 1) * stride] * BLOCK_ELEMS);
            for (int64_t l = 0; l < BLOCK_ELEMS * 2; l += 64) {
                _mm_prefetch(k1 + l, _MM_HINT_T1);
                _mm_prefetch(v1 + l, _MM_HINT_T1);
            }
        }
        softmax_rows(sc, H, n, 1);
        const rows_t vat = rows_from(vpool, tab, 0, BS, (int64_t)KVH * HD);
        for (int h = 0; h < KVH; h++)
            values_pairs(vat, n, h * HD, (const uint32_t*)(sc + (int64_t)h * g * n), n,
                         out + ((int64_t)b * H + h * g) * HD, HD, HD / 32, 3);
    }
}

static volatile float sink;   /* keeps the plain read's loads */

/* every line of the B sequences' K and V blocks, in the kernel's order */
static void plain_read(const uint16_t* kpool, const uint16_t* vpool, const int64_t* tables,
                       int64_t stride, int B) {
    __m512 a = _mm512_setzero_ps(), c = a;
    for (int b = 0; b < B; b++)
        for (int k = 0; k < (CTX + BS - 1) / BS; k++) {
            const __m512i* kb = (const __m512i*)(kpool + tables[(int64_t)b * stride + k] * BLOCK_ELEMS);
            const __m512i* vb = (const __m512i*)(vpool + tables[(int64_t)b * stride + k] * BLOCK_ELEMS);
            for (int l = 0; l < BLOCK_ELEMS / 32; l++) {
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_load_si512(kb + l)));
                c = _mm512_add_ps(c, _mm512_castsi512_ps(_mm512_load_si512(vb + l)));
            }
        }
    sink = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
}

static void run(int B, int L, int iters) {
    const int per = (CTX + BS - 1) / BS, blocks = B * per + 8;
    const size_t elems = (size_t)blocks * BLOCK_ELEMS;
    uint16_t *k[12], *kd[12], *v[12];
    srand(1);
    for (int l = 0; l < L; l++) {
        k[l] = huge_alloc(elems * 2), kd[l] = huge_alloc(elems * 2), v[l] = huge_alloc(elems * 2);
        for (size_t i = 0; i < elems; i++) {
            k[l][i] = bf16_of((float)rand() / RAND_MAX - 0.5f);
            v[l][i] = bf16_of((float)rand() / RAND_MAX - 0.5f);
        }
        for (int blk = 0; blk < blocks; blk++)   /* [BS][KVH][HD] -> [KVH][HD/2][BS][2] */
            for (int p = 0; p < BS; p++)
                for (int h = 0; h < KVH; h++)
                    for (int d = 0; d < HD; d++)
                        kd[l][blk * BLOCK_ELEMS + ((int64_t)(h * HD / 2 + d / 2) * BS + p) * 2 + (d & 1)] =
                            k[l][blk * BLOCK_ELEMS + ((int64_t)p * KVH + h) * HD + d];
    }
    int* order = malloc(sizeof(int) * blocks);
    for (int i = 0; i < blocks; i++) order[i] = i;
    for (int i = blocks - 1; i > 0; i--) {   /* scattered, as a pool's blocks are */
        const int j = rand() % (i + 1), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    int64_t* tab = malloc(sizeof(int64_t) * B * per);
    for (int i = 0; i < B * per; i++) tab[i] = order[i];
    int32_t *ctx = malloc(sizeof(int32_t) * B), *starts = calloc(B, sizeof(int32_t));
    for (int b = 0; b < B; b++) ctx[b] = CTX;
    uint16_t* q = malloc(2 * (size_t)B * H * HD);
    uint16_t *ref = malloc(2 * (size_t)B * H * HD), *out = malloc(2 * (size_t)B * H * HD);
    for (int i = 0; i < B * H * HD; i++) q[i] = bf16_of((float)rand() / RAND_MAX - 0.5f);
    float* sc = aligned_alloc(64, sizeof(float) * H * (CTX + 16));
    const char* names[] = {"tree kernel", "plain read", "kdm dp", "kdm fma"};
    const double pos_heads = (double)L * B * CTX * H, bytes = (double)L * 2 * B * CTX * KVH * HD * 2;
    for (int m = 0; m < 4; m++) {
        double best = 1e30;
        for (int r = 0; r < 5; r++) {
            const double t0 = seconds();
            for (int it = 0; it < iters; it++)
                for (int l = 0; l < L; l++) {
                    if (m == 0)
                        paged_decode_bf16(q, k[l], v[l], tab, per, ctx, starts, B, H, KVH, HD, BS,
                                          0.125f, sc, (int64_t)H * (CTX + 16), ref);
                    else if (m == 1)
                        plain_read(k[l], v[l], tab, per, B);
                    else
                        decode_kdm(q, kd[l], v[l], tab, per, B, 0.125f, sc, out, m == 3);
                }
            const double t = (seconds() - t0) / iters;
            if (t < best) best = t;
        }
        printf("B=%2d, %2d layers: %-11s %7.3f ms, %5.2f ns a position-head, %5.1f GB/s%s\n", B, L,
               names[m], best * 1e3, best / pos_heads * 1e9, bytes / best / 1e9,
               m < 2 ? "" : memcmp(out, ref, 2 * (size_t)B * H * HD) ? ", output differs"
                                                                   : ", same output");
    }
    for (int l = 0; l < L; l++) free(k[l]), free(kd[l]), free(v[l]);
    free(order), free(tab), free(ctx), free(starts), free(q), free(ref), free(out), free(sc);
}

int main(void) {
    run(4, 1, 2000);   /* in L2 */
    run(8, 12, 50);    /* from memory */
    run(32, 12, 20);
    return 0;
}
