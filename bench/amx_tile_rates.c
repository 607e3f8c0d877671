/* How fast one core's AMX tiles multiply where their operands lie, and what a prompt-sized
   matmul in linear_bf16.c's order loses to storing its accumulators: the probe behind
   docs/benchmarks.md's sessions 39 (why the prompt matmuls run at ~1 TFLOP/s) and 58 (the
   ceiling a block's stores leave, and an order that places the operands).

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
   - blocked (session 58): N in chunks of 128 columns whose weights stay in L2 over all
     rows (the next chunk asked into L2 meanwhile), rows 32 at a time, K in slices of 256
     so that a block's slice of x (packed into 1 KB tiles first) stays in L1 across the
     chunk's groups, the accumulators kept between K slices in an fp32 buffer (the same
     output, checked).
   Prints the best of 15 passes in TFLOP/s. Not built by the project; needs AMX and
   Linux >= 5.16.

   blocks KB P STORE [OFFSET] (session 58): the ring, but every P k-steps the accumulators
   are stored (STORE 1) or not (0) and zeroed, as at a GEMM block's end: what a block
   boundary costs with the operands where the ring keeps them. The stores go to a buffer
   OFFSET bytes (default 0) into a 4 KB page, the A tiles starting on one: some offsets
   make the next block's loads wait on the stores (4K aliasing).

       cc -O3 -march=native bench/amx_tile_rates.c -o /tmp/amx_tile_rates
       for kb in 32 256 1024 8192; do taskset -c 1 /tmp/amx_tile_rates ring $kb; done
       taskset -c 1 /tmp/amx_tile_rates gemm 256 4096 768 4     # the 82m model's gate_up
       taskset -c 1 /tmp/amx_tile_rates gemm 256 768 2048 4     # its down
       for o in 0 1024 2048 3072; do taskset -c 1 /tmp/amx_tile_rates blocks 256 24 1 $o; done
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

/* the ring; with P > 0, every P k-steps the accumulators are stored (store) or not, and
   zeroed, as at a GEMM block's end. The buffer they are stored to starts `off` bytes into
   a 4 KB page (the A tiles start on one): where a store and a later load share their
   address's low 12 bits the load may wait for the store (4K aliasing). */
static int ring(long kb, long P, int store, long off) {
    static uint16_t a[32 * 512] __attribute__((aligned(4096)));
    static float accbuf[1024 + 1024] __attribute__((aligned(4096)));
    float* acc = accbuf + off / 4;
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
        if (P > 0 && (i + 1) % P == 0) {
            if (store) {
                _tile_stored(0, acc, 64); _tile_stored(1, acc + 256, 64);
                _tile_stored(2, acc + 512, 64); _tile_stored(3, acc + 768, 64);
            }
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
    }
    t = now() - t;
    printf("ring %ld KB", kb);
    if (P > 0) printf(", blocks of %ld k-steps, accumulators %s", P, store ? "stored" : "not stored");
    if (P > 0 && store) printf(" %ld bytes into a page", off);
    printf(": %.2f TFLOP/s, B read at %.0f GB/s\n", iters * 4.0 * 16 * 16 * 32 * 2 / t / 1e12,
           iters * 2048.0 / t / 1e9);
    return acc[3] == 12345.0f;
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

#define NC 128  /* blocked: columns whose weights stay in L2 over all rows */
#define KC 256  /* blocked: the slice of K whose x stays in L1 across a chunk's groups */
static float part[NC / 32][1024] __attribute__((aligned(64)));
static uint16_t* xtiles;

/* mode 3: see the header; x [M][K] is first packed into tiles of 16 rows x 32 columns
   (1 KB each; tile (r, c) at (r * K / 32 + c) * 512) */
static void gemm_blocked(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x,
                         int64_t M, uint16_t* y) {
    const int64_t kt = K / 32;
    for (int64_t r = 0; r < M / 16; r++)
        for (int64_t c = 0; c < kt; c++)
            for (int i = 0; i < 16; i++)
                memcpy(xtiles + (r * kt + c) * 512 + i * 32, x + (r * 16 + i) * K + c * 32, 64);
    for (int64_t n0 = 0; n0 < N; n0 += NC) {
        const int64_t groups = (N - n0 < NC ? N - n0 : NC) / 32;
        const char* next = (const char*)(w + (n0 + NC) * K);
        const int64_t next_bytes = n0 + NC < N ? (N - n0 - NC < NC ? N - n0 - NC : NC) * K * 2 : 0;
        const int64_t per = next_bytes / ((M / 32) * ((K + KC - 1) / KC) * groups) / 64 + 1;
        int64_t pf = 0;
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const uint16_t* a0 = xtiles + (m0 / 16) * kt * 512, *a1 = a0 + kt * 512;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t k1 = k0 + KC < K ? k0 + KC : K;
                for (int64_t g = 0; g < groups; g++) {
                    const uint16_t* wt = w + (n0 / 32 + g) * K * 32;
                    float* acc = part[g];
                    if (k0 == 0) {
                        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    } else {
                        _tile_loadd(0, acc, 64); _tile_loadd(1, acc + 256, 64);
                        _tile_loadd(2, acc + 512, 64); _tile_loadd(3, acc + 768, 64);
                    }
                    for (int64_t k = k0; k < k1; k += 32) {
                        const uint16_t* wk = wt + (k / 2) * 64;
                        ahead(wk);
                        _tile_loadd(4, a0 + (k / 32) * 512, 64); _tile_loadd(6, wk, 128);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_loadd(7, wk + 32, 128); _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, a1 + (k / 32) * 512, 64); _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    for (int64_t i = 0; i < per && pf < next_bytes; i++, pf += 64)
                        _mm_prefetch(next + pf, _MM_HINT_T1);
                    _tile_stored(0, acc, 64); _tile_stored(1, acc + 256, 64);
                    _tile_stored(2, acc + 512, 64); _tile_stored(3, acc + 768, 64);
                    if (k1 == K) write_rows(acc, 0, 64, y + m0 * N, N, n0 + g * 32);
                }
            }
        }
    }
}

int main(int argc, char** argv) {
    if (argc < 3 || (strcmp(argv[1], "gemm") == 0 && argc < 6) ||
        (strcmp(argv[1], "blocks") == 0 && argc < 5)) {
        fprintf(stderr, "usage: %s ring KB | blocks KB P STORE [OFFSET] | gemm M N K COPIES\n",
                argv[0]);
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
    if (strcmp(argv[1], "ring") == 0) return ring(atol(argv[2]), 0, 0, 0);
    if (strcmp(argv[1], "blocks") == 0) {
        const long off = argc > 5 ? atol(argv[5]) : 0;
        if (atol(argv[3]) < 1 || off < 0 || off > 4096 - 64 || off % 64) {
            fprintf(stderr, "P: 1 or more k-steps; OFFSET: a multiple of 64 below 4096\n");
            return 2;
        }
        return ring(atol(argv[2]), atol(argv[3]), atoi(argv[4]), off);
    }
    const int64_t M = atol(argv[2]), N = atol(argv[3]), K = atol(argv[4]);
    const int copies = atoi(argv[5]);
    if (M % 32 || N % 32 || K % 32 || copies < 1 || copies > 64) {
        fprintf(stderr, "M, N and K multiples of 32, 1-64 copies\n");
        return 2;
    }
    uint16_t* ws[64];
    for (int i = 0; i < copies; i++) fill(ws[i] = huge((size_t)N * K * 2), (size_t)N * K);
    uint16_t* x = huge((size_t)M * K * 2), *y[4];
    xtiles = huge((size_t)M * K * 2);
    fill(x, (size_t)M * K);
    for (int m = 0; m < 4; m++) y[m] = huge((size_t)M * N * 2);
    const char* names[4] = {"kernel", "deferred", "nostore", "blocked"};
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int r = 0; r < 15; r++)
        for (int m = 0; m < 4; m++) {
            const double t = now();
            for (int i = 0; i < copies; i++) {
                if (m == 3) gemm_blocked(ws[i], N, K, x, M, y[m]);
                else gemm(m, ws[i], N, K, x, M, y[m]);
            }
            const double dt = now() - t;
            if (dt < best[m]) best[m] = dt;
        }
    const double flops = 2.0 * M * N * K * copies;
    printf("M=%ld N=%ld K=%ld x%d (%.1f MB of weights):", (long)M, (long)N, (long)K, copies,
           copies * N * K * 2 / 1e6);
    for (int m = 0; m < 4; m++) printf(" %s %.2f TFLOP/s%s", names[m], flops / best[m] / 1e12,
                                       m < 3 ? "," : "\n");
    printf("deferred wrote the kernel's output: %s; blocked: %s\n",
           memcmp(y[0], y[1], (size_t)M * N * 2) == 0 ? "yes" : "NO",
           memcmp(y[0], y[3], (size_t)M * N * 2) == 0 ? "yes" : "NO");
    return 0;
}
