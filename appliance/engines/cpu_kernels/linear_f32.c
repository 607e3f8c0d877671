/* y = x @ W^T (+ bias) in fp32 for the few rows of a decode step, with AVX2 and FMA: the
   matmul kernel of a CPU without AVX-512 (AMD Zen 2/3, Intel client cores), where the
   bf16 kernels beside this one do not build and a worker holds its weights in fp32.

   Why a kernel: there, oneDNN's fp32 linear (packed or not) multiplies a decode step's few
   rows far below what the core can read or compute. Measured on an AMD EPYC Zen 3 core, the
   82m model's layer weights (302 MB fp32) at 8 rows took 76 ms packed, 4.0 GB/s and 16
   GFLOPS, where one core reads ~12-20 GB/s and its two FMA pipes reach ~100 GFLOPS.

   The weight stays in its ordinary [N, K] row-major layout, so torch's own linear still
   takes the calls this kernel is not made for (prompts: oneDNN blocks them for its caches
   and runs near the FMA peak) with no second copy of the weight. A tile multiplies NR
   weight rows by MR input rows: NR * MR accumulators of 8 lanes along K, one load of each
   weight row's next 8 values feeding MR FMAs, the sums reduced across lanes once at the
   end. The first tile of rows reads the weight rows from memory; the next ones find them
   in L1/L2 (NR rows of K floats: 9 KB at K = 768). That first tile also prefetches the
   next NR weight rows into L2, each line as far ahead as a tile's rows are long: without
   it the stream stalls while the core computes the other tiles (82m layer weights on the
   Zen 3 core, 1/4/8 rows: 33.0/36.4/45.8 ms without, 22.8-24.4/23.4-25.5/31.3-39.4 with;
   prefetching from the second row on, or 4 KB further, was slower at 1 row). Tiles of
   1 x 8, 2 x 6 and 2 x 4 weight x input rows measured slower than 3 x 4 at every size
   (8 rows: 51.7, 38.4, 51.4 ms against 31.3).

   Loads: with NR weights and all NR * MR accumulators in registers, one is left for the
   input row; gcc would rather fold the input's load into each FMA (NR loads of it where
   one does: 15 loads per 12 FMAs, past the core's two 256-bit loads a cycle). An empty
   asm on the loaded vector keeps it in that register: 7 loads per 12 FMAs, and against
   oneDNN's packed fp32 in the same run (bench/bench_f32_kernels.py) 8 rows x1.48 -> x2.09,
   16 x1.12 -> x1.49, 32 x0.85 -> x1.13 (the host ran slower during this comparison than
   for the figures above).

   Layout: w [N, K] fp32 row-major, K a multiple of 8; x [M, ldx] fp32 (K columns used);
   bias [N] fp32 or NULL; y [M, ldy] fp32.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <stdint.h>

#define NR 3 /* weight rows per tile */
#define MR 4 /* input rows per tile: NR * MR accumulators + NR weights + 1 input = 16 ymm */

static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 d = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

static inline __attribute__((always_inline)) void tile(const float* w, int64_t K, int nr,
                                                       const float* x, int64_t ldx, int mr,
                                                       const float* bias, int64_t n0,
                                                       float* y, int64_t ldy,
                                                       int ahead /* prefetch the next tile's rows */) {
    __m256 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[NR];
        if (ahead)
            for (int j = 0; j < nr; j++) _mm_prefetch((const char*)(w + (NR + j) * K + k), _MM_HINT_T1);
        for (int j = 0; j < nr; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int m = 0; m < mr; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            __asm__("" : "+x"(xv)); /* one load, in a register: see "Loads" above */
            for (int j = 0; j < nr; j++) acc[m][j] = _mm256_fmadd_ps(wv[j], xv, acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++)
            y[m * ldy + n0 + j] = hsum(acc[m][j]) + (bias ? bias[n0 + j] : 0.0f);
}

/* the tile at constant row counts, so its loops unroll */
#define TILE(NRC, MRC) tile(wn, K, NRC, xm, ldx, MRC, bias, n, y + m * ldy, ldy, m == 0)
#define ROWS(NRC)                                                     \
    switch (mr) {                                                     \
    case 4: TILE(NRC, 4); break;                                      \
    case 3: TILE(NRC, 3); break;                                      \
    case 2: TILE(NRC, 2); break;                                      \
    default: TILE(NRC, 1); break;                                     \
    }

/* Returns 0, or -1 for a K this kernel does not take. */
int linear_f32(const float* w, int64_t N, int64_t K, const float* x, int64_t M, int64_t ldx,
               const float* bias, float* y, int64_t ldy) {
    if (K % 8) return -1;
    for (int64_t n = 0; n < N; n += NR) {
        const int nr = N - n >= NR ? NR : (int)(N - n);
        const float* wn = w + n * K;
        for (int64_t m = 0; m < M; m += MR) {
            const int mr = M - m >= MR ? MR : (int)(M - m);
            const float* xm = x + m * ldx;
            if (nr == 3) {
                ROWS(3)
            } else if (nr == 2) {
                ROWS(2)
            } else {
                ROWS(1)
            }
        }
    }
    return 0;
}
