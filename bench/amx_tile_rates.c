/* How fast one core's AMX tiles multiply where their operands lie, and what a prompt-sized
   matmul in linear_bf16.c's order loses to storing its accumulators: the probe behind
   docs/benchmarks.md's session 39 (why the prompt matmuls run at ~1 TFLOP/s).

   ring KB: 32 x 32 blocks of TDPBF16PS (two A tiles, two B tiles, four accumulators, as
   the kernel multiplies), the A tiles in L1, the B tiles streamed through a ring of KB
   kilobytes (2 KB a k-step, prefetched 4 KB ahead): ~32 is L1, up to ~1,500 is L2, more
   comes from L3 or memory.

   gemm M N K COPIES: y = x @ W^T, x [M, K] bf16, over COPIES weights [N, K] in the
   kernel's layout (groups of 32 output rows, k-pair after k-pair), each a separate
   allocation so that more copies than L2 holds come from beyond it, three ways:
   - kernel: linear_bf16.c's AMX order for prompt-sized calls (under each weight group,
     32 rows at a time over all of K, the four accumulator tiles stored, then rounded to
     bf16 and written);
   - deferred: the same products, a chunk's rounding and writing spread over the next
     chunk's k-steps (the same output, checked);
   - nostore: the products without any accumulator store, an upper bound (no output).
   Prints the best of 15 passes in TFLOP/s. Not built by the project; needs AMX and
   Linux >= 5.16.

       cc -O3 -march=native bench/amx_tile_rates.c -o /tmp/amx_tile_rates
       for kb in 32 256 1024 8192; do taskset -c 1 /tmp/amx_tile_rates ring $kb; done
       taskset -c 1 /tmp/amx_tile_rates gemm 256 4096 768 4     # the 82m model's gate_up
       taskset -c 1 /tmp/amx_tile_rates gemm 256 768 2048 4     # its down
*/
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* huge(size_t bytes) {
    bytes = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 0, bytes);
    return p;
}

static void fill(uint16_t* p, size_t n) {   /* bf16 values in [1, 2) */
    for (size_t i = 0; i < n; i++) p[i] = 0x3f80 + (rand() & 0x7f);
}

/* the four products of one k-step: x0/x1 rows 0-15/16-31 at column k, wk the group's
   2 KB of this k-step (block 0's B tile, then block 1's 64 bytes on) */
#define KSTEP(x0, x1, k, K, wk)                                                          \
    do {                                                                                 \
        _tile_loadd(4, (x0) + (k), (K) * 2); _tile_loadd(6, (wk), 128);                 \
        _tile_dpbf16ps(0, 4, 6);                                                         \
        _tile_loadd(7, (wk) + 32, 128); _tile_dpbf16ps(1, 4, 7);                         \
        _tile_loadd(5, (x1) + (k), (K) * 2); _tile_dpbf16ps(2, 5, 6);                    \
        _tile_dpbf16ps(3, 5, 7);                                                         \
    } while (0)

static void ahead(const uint16_t* wk) {
    for (int l = 0; l < 2048; l += 64) _mm_prefetch((const char*)wk + 2048 + l, _MM_HINT_T0);
}

static int ring(long kb) {
    static uint16_t a[32 * 512] __attribute__((aligned(64)));
    const long chunks = kb * 1024 / 2048, iters = 4000000;
    uint16_t* b = huge((size_t)kb * 1024 + 8192);
    fill(a, 32 * 512);
    fill(b, (size_t)kb * 512 + 4096);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    double t = now();
    for (long i = 0, j = 0; i < iters; i++) {
        const uint16_t* wk = b + j * 1024;
        const char* p = (const char*)wk + 4096;
        for (int l = 0; l < 2048; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
        KSTEP(a, a + 16 * 512, (i & 7) * 32, 512, wk);
        if (++j == chunks) j = 0;
    }
    t = now() - t;
    printf("ring %ld KB: %.2f TFLOP/s, B read at %.0f GB/s\n", kb,
           iters * 4.0 * 16 * 16 * 32 * 2 / t / 1e12, iters * 2048.0 / t / 1e9);
    return 0;
}

/* a chunk's 32 x 32 fp32 accumulators (4 tiles of 16 x 16) -> bf16 rows r0..r1-1 of the
   64 (tile t's row m: y row (t / 2) * 16 + m, columns n + (t % 2) * 16) */
static void write_rows(const float* acc, int r0, int r1, uint16_t* y, int64_t ldy, int64_t n) {
    for (int r = r0; r < r1; r++) {
        const int t = r >> 4, m = r & 15;
        const __m256bh o = _mm512_cvtneps_pbh(_mm512_load_ps(acc + t * 256 + m * 16));
        _mm256_storeu_si256((__m256i*)(y + ((t >> 1) * 16 + m) * ldy + n + (t & 1) * 16),
                            (__m256i)o);
    }
}

static float accs[2][1024] __attribute__((aligned(64)));

/* mode 0 kernel, 1 deferred, 2 nostore; M, N multiples of 32, K of 32 */
static void gemm(int mode, const uint16_t* w, int64_t N, int64_t K, const uint16_t* x,
                 int64_t M, uint16_t* y) {
    const int64_t steps = K / 32, per = (64 + steps - 1) / steps;
    const float* pend = NULL;       /* deferred: the previous chunk's accumulators */
    uint16_t* py = NULL;
    int64_t pn = 0;
    int cur = 0;
    for (int64_t g = 0; g < N / 32; g++) {
        const uint16_t* wt = w + g * K * 32;
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const uint16_t* x0 = x + m0 * K, *x1 = x0 + 16 * K;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            int64_t done = 0;
            for (int64_t k = 0; k < K; k += 32) {
                const uint16_t* wk = wt + (k / 2) * 64;
                ahead(wk);
                KSTEP(x0, x1, k, K, wk);
                if (pend && done < 64) {
                    const int64_t e = done + per < 64 ? done + per : 64;
                    write_rows(pend, (int)done, (int)e, py, N, pn);
                    done = e;
                }
            }
            if (mode == 2) continue;
            float* acc = accs[cur];
            cur ^= 1;
            _tile_stored(0, acc, 64); _tile_stored(1, acc + 256, 64);
            _tile_stored(2, acc + 512, 64); _tile_stored(3, acc + 768, 64);
            if (mode == 0) {
                write_rows(acc, 0, 64, y + m0 * N, N, g * 32);
            } else {
                if (pend && done < 64) write_rows(pend, (int)done, 64, py, N, pn);
                pend = acc, py = y + m0 * N, pn = g * 32;
            }
        }
    }
    if (pend) write_rows(pend, 0, 64, py, N, pn);
}

int main(int argc, char** argv) {
    if (argc < 3 || (strcmp(argv[1], "gemm") == 0 && argc < 6)) {
        fprintf(stderr, "usage: %s ring KB | gemm M N K COPIES\n", argv[0]);
        return 2;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        fprintf(stderr, "no AMX tiles for this process\n");
        return 1;
    }
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
    if (strcmp(argv[1], "ring") == 0) return ring(atol(argv[2]));
    const int64_t M = atol(argv[2]), N = atol(argv[3]), K = atol(argv[4]);
    const int copies = atoi(argv[5]);
    if (M % 32 || N % 32 || K % 32 || copies < 1 || copies > 64) {
        fprintf(stderr, "M, N and K multiples of 32, 1-64 copies\n");
        return 2;
    }
    uint16_t* ws[64];
    for (int i = 0; i < copies; i++) fill(ws[i] = huge((size_t)N * K * 2), (size_t)N * K);
    uint16_t* x = huge((size_t)M * K * 2), *y[3];
    fill(x, (size_t)M * K);
    for (int m = 0; m < 3; m++) y[m] = huge((size_t)M * N * 2);
    const char* names[3] = {"kernel", "deferred", "nostore"};
    double best[3] = {1e9, 1e9, 1e9};
    for (int r = 0; r < 15; r++)
        for (int m = 0; m < 3; m++) {
            const double t = now();
            for (int i = 0; i < copies; i++) gemm(m, ws[i], N, K, x, M, y[m]);
            const double dt = now() - t;
            if (dt < best[m]) best[m] = dt;
        }
    const double flops = 2.0 * M * N * K * copies;
    printf("M=%ld N=%ld K=%ld x%d (%.1f MB of weights):", (long)M, (long)N, (long)K, copies,
           copies * N * K * 2 / 1e6);
    for (int m = 0; m < 3; m++) printf(" %s %.2f TFLOP/s%s", names[m], flops / best[m] / 1e12,
                                       m < 2 ? "," : "\n");
    printf("deferred wrote the kernel's output: %s\n",
           memcmp(y[0], y[1], (size_t)M * N * 2) == 0 ? "yes" : "NO");
    return 0;
}
