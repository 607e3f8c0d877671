/* The fp32 decode attention kernel (appliance/engines/cpu_kernels/paged_decode_f32.c) alone,
   called from C: one decode step over 12 layers of the 82m shape (12 heads over 4 KV heads of
   64, blocks of 16), B sequences of CTX positions whose blocks lie scattered through each
   layer's pool. HOT 0: each layer a pool of its own (at least 2048 blocks, 64 MB of K and
   V), so no cache holds the step's reads; 1: every layer the same pool of just the blocks
   read (the CPU time without memory). Prints the best pass and a checksum of the output
   (equal across kernel versions that sum in the same order). Without Python between calls,
   so it separates the kernel's own time from bench_f32_kernels.py's wrapper. Not built by
   the project: a probe for docs/benchmarks.md (session 66).

       cc -O3 -march=native -ffp-contract=off -Iappliance/engines/cpu_kernels \
          bench/paged_decode_loop.c appliance/engines/cpu_kernels/paged_decode_f32.c \
          -lm -o /tmp/pdl
       taskset -c 1 /tmp/pdl 8 290 0      # B CTX HOT [PASSES]
*/
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int paged_decode_f32(const float* q, const float* kpool, const float* vpool,
                     const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                     const int32_t* starts, int B, int H, int KVH, int hd, int bs, float scale,
                     float* scratch, int64_t scratch_elems, float* out);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float* random_floats(size_t n, size_t align) {
    float* p = aligned_alloc(align, (n * sizeof(float) + align - 1) / align * align);
    for (size_t i = 0; i < n; i++) p[i] = (rand() % 1000) * 1e-3f;
    return p;
}

int main(int argc, char** argv) {
    if (argc < 4 || atoi(argv[1]) < 1 || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: %s B CTX HOT [PASSES]\n", argv[0]);
        return 2;
    }
    const int B = atoi(argv[1]), ctx = atoi(argv[2]), hot = atoi(argv[3]);
    const int passes = argc > 4 ? atoi(argv[4]) : 20;
    const int H = 12, KVH = 4, hd = 64, bs = 16, L = 12;
    const int per = (ctx + bs - 1) / bs;
    const int blocks = hot ? B * per : (B * per > 2048 ? B * per : 2048);
    const size_t pool = (size_t)blocks * bs * KVH * hd;
    float *K[12], *V[12];
    srand(1);
    for (int l = 0; l < L; l++) {
        K[l] = hot && l ? K[0] : random_floats(pool, 4096);
        V[l] = hot && l ? V[0] : random_floats(pool, 4096);
    }
    /* each sequence's blocks: distinct, in a random order through the pool */
    int* ids = malloc(blocks * sizeof(int));
    for (int i = 0; i < blocks; i++) ids[i] = i;
    for (int i = blocks - 1; i > 0; i--) {
        const int j = rand() % (i + 1), t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    int64_t* tab = malloc(sizeof(int64_t) * B * per);
    for (int i = 0; i < B * per; i++) tab[i] = ids[i];
    int32_t* lens = malloc(sizeof(int32_t) * B);
    int32_t* starts = calloc(B, sizeof(int32_t));
    for (int b = 0; b < B; b++) lens[b] = ctx;
    float* q = random_floats((size_t)B * H * hd, 64);
    float* out = random_floats((size_t)B * H * hd, 64);
    float* sc = random_floats((size_t)H * ctx, 64);
    double best = 1e9;
    for (int p = 0; p < passes; p++) {
        const double t0 = now();
        for (int l = 0; l < L; l++)
            if (paged_decode_f32(q, K[l], V[l], tab, per, lens, starts, B, H, KVH, hd, bs,
                                 0.125f, sc, (int64_t)H * ctx, out)) {
                fprintf(stderr, "the kernel refused the shape\n");
                return 1;
            }
        const double t = now() - t0;
        if (t < best) best = t;
    }
    const double bytes = 2.0 * L * B * ctx * KVH * hd * sizeof(float);
    double sum = 0;
    for (int i = 0; i < B * H * hd; i++) sum += out[i] * (1 + i % 7);
    printf("[%.6f] B=%d ctx=%d %s: %.2f ms, %.1f GB/s of K and V\n", sum, B, ctx,
           hot ? "hot" : "cold", best * 1e3, bytes / best / 1e9);
    return 0;
}
