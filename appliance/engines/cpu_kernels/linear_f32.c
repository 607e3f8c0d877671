/* y = x @ W^T (+ bias) in fp32 with AVX2 and FMA: the matmul kernel of a CPU without
   AVX-512 (AMD Zen 2/3, Intel client cores, a VM that hides it), where the bf16 kernels
   beside this one do not build and a worker holds its weights in fp32.

   Why a kernel: there, oneDNN's fp32 linear (packed or not) multiplies a decode step's few
   rows far below what the core can read or compute. Measured on an AMD EPYC Zen 3 core, the
   82m model's layer weights (302 MB fp32) at 8 rows took 76 ms packed, 4.0 GB/s and 16
   GFLOPS, where one core reads ~11 GB/s and its two FMA pipes reach ~85-90 GFLOPS.

   Layout: the weight is packed once into panels of 16 output columns, each panel K lines
   of 64 bytes ([ceil(N/16)][K][16], the last panel zero-padded), so a step streams it in
   one sequential pass. A tile multiplies up to 6 input rows by one panel: 6 x 2
   accumulators of 8 columns, per k two loads of the panel's line and one broadcast of each
   row's x[k]. A call packs its input rows first ([K][rows] per group of rows, into a
   256 KB buffer L2 holds), so the broadcasts read one contiguous stream; rows are grouped
   evenly (8 rows: 4 + 4, not 6 + 2). Panels go in order, K in blocks of 256 (a panel's
   block is 16 KB: L1 holds it while each group of rows multiplies it). More rows than the
   buffer holds at this K (85 at K = 768, 32 at K = 2048) are done in blocks of even size,
   each streaming the weight again.

   Prefetches (one and two groups now read four streams: below): with one to six groups
   (1-36 rows, a decode step) the stream is asked for 64 KB ahead into L2 all the time, each
   group a share of a block's lines (n groups: a line every n-th k); with more (a prompt,
   whose rows reuse each block from L1 long enough for the hardware's prefetcher), the first
   group 4 KB ahead. Before, the first group alone asked, 4 KB ahead, and at 8 rows (4 + 4)
   the core read the weight while the first group ran and multiplied without reading while
   the second did: the two times added up. The panel's line is held in two registers per k
   (gcc folded its loads into every FMA: 12 loads a k for 4 rows, not 6). Together,
   alternating with the kernel before on an AMD EPYC Zen 4 core with AVX-512 hidden (12
   layers of the 82m model from memory, best of 6): 1 row 15-17 -> 13-15 ms, 4 rows 15-18 ->
   13-15, 6 rows 16-17 -> 13, 8 rows 27-28 -> 17 (44 -> 72 GFLOPS, in quiet stretches).
   Sharing among three to six groups came later (session 63, an AMD EPYC Zen 3 core, the
   same measure, two runs alternating): 16 rows 35-37 -> 29 ms (65-69 -> 82-83 GFLOPS), 24
   rows 49 -> 41-43, 32 rows 62-80 -> 56-57, 48 rows 91-98 -> 88; 1-12 rows, whose code is
   the same, within the noise. Without any prefetch 8 rows took 27-30 ms there against
   18-19.

   Four streams (session 67, the Zen 3 core): one core there reads one sequential stream at
   ~16-18 GB/s and four side by side at ~24 (bench/read_streams.c). So one or two groups of
   rows (1-12, a decode step of few sequences) take the panels in four runs of a quarter
   each, a block of each run in turn, and spread their prefetches over the four streams'
   next blocks (`streams`). Alternating with the single stream (bench/linear_f32_loop.c,
   the same 12 layers, best of 15): 1-6 rows 18-22 -> 13.4-14.9 ms, 7-11 rows 18.4-23.4 ->
   16.2-20.4, 12 rows 22.7-23.0 -> 21.6-22.3; from 13 rows on (three groups and more) the
   single stream, level with four there. The same layout, so a worker packs nothing new.
   Tried before and lost at 8 rows: four slabs of the weight (session 65), and this order
   with prefetches further ahead and each group asking for its own (session 66); here each
   stream is asked for one block ahead, and two groups split the asking.

   Before this layout the weight stayed [N, K] row-major and a tile was 3 weight rows by 4
   input rows, dot products along K reduced across lanes at the end: the same at 1-8 rows,
   but at 16-48 rows its input rows came from L2 for every tile. Against it, alternating
   call by call on the Zen 3 core (12 layers of the 82m model, best of 8; noisy host):
   1/4/8 rows x1.00/1.04/0.99, 16 rows x1.19-1.43, 32 x1.11-1.17, 48 x1.44-1.52. At a
   prompt's rows (64-512) it ran at 53-80 GFLOPS there, within that host's noise of
   oneDNN's packed fp32 (x0.7-1.17 across runs). On session 63's quieter Zen 3 core it ran
   at 82-89 GFLOPS from 128 rows on (the core's FMA peak) against oneDNN's 72-77, x1.12-1.16
   in every run, so prefill workers take it too (a 256-token prompt's step 517 -> 465-505
   ms, 4 prompts 2043-2117 -> 1755-1801).

   The numbers: each output is bias + sum over k of x[k] * w[k] in fp32, in order of k
   (one FMA each, so products are not rounded apart from the sum): within fp32 summation
   order of a float64 reference.

   Layout of the arguments: packed as above; x [M, ldx] fp32 (K columns used); bias [N]
   fp32 or NULL; y [M, ldy] fp32, not overlapping x.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <stdint.h>

#define NR 16                  /* output columns of a panel: two vectors */
#define MR 6                   /* input rows of a tile at most: 12 accumulators */
#define KC 256                 /* k per block: a panel's block is 16 KB */
#define AHEAD 1024             /* floats (4 KB) ahead: the first of 7+ groups prefetches there */
#define FAR 16384              /* floats (64 KB, 4 blocks) ahead: 3-6 groups prefetch there */
#define SHARED 6               /* up to this many groups share a block's prefetches */
#define XMAX (64 * 1024)       /* floats of packed input rows: 256 KB */
#define STREAMS 4              /* one or two groups of rows read the panels as 4 streams */
#define NEXT (KC * NR)         /* floats (16 KB, a block) ahead: each stream prefetches there */
#define SPREAD 8               /* tile's prefetch mode for them: a line of each stream in turn */
#define INLINE static inline __attribute__((always_inline))

/* the first n of 8 lanes, as a mask for maskload/maskstore */
INLINE __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* y[0..R-1][0..ncols-1] = (first ? bias or 0 : y) + x @ panel over kc values of k.
   x: [kc][R] packed rows; pw: the panel's kc lines; ncols < 16 only on the last panel. */
INLINE void tile(const float* x, const float* pw, int kc, float* y, int64_t ldy,
                 const float* bias, int first, const float* pf, int64_t stride, int ncols,
                 const int R, const int PF) {
    __m256 acc[MR][2];
    const __m256i m0 = lanes(ncols), m1 = lanes(ncols - 8);
    const int full = ncols == NR;
    for (int r = 0; r < R; r++) {
        if (first && !bias) {
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        } else {
            const float* from = first ? bias : y + r * ldy;
            acc[r][0] = full ? _mm256_loadu_ps(from) : _mm256_maskload_ps(from, m0);
            acc[r][1] = full ? _mm256_loadu_ps(from + 8) : _mm256_maskload_ps(from + 8, m1);
        }
    }
    for (int k = 0; k < kc; k++) {
        /* PF 1: a line of the stream ahead each k; PF n > 1: each n-th k (n groups share
           a block's prefetches, so the stream is asked for all the time, not by one);
           PF SPREAD + n - 1: each n-th k a line of the next of four streams (`streams`) */
        if (PF >= SPREAD && k % (PF - SPREAD + 1) == 0) {
            const int j = k / (PF - SPREAD + 1);
            _mm_prefetch((const char*)(pf + (j % STREAMS) * stride + NR * (j / STREAMS)),
                         _MM_HINT_T1);
        }
        else if (PF == 1 || (PF > 1 && k % PF == 0))
            _mm_prefetch((const char*)(pf + NR * (k / PF)), _MM_HINT_T1);
        __m256 w0 = _mm256_loadu_ps(pw + NR * k), w1 = _mm256_loadu_ps(pw + NR * k + 8);
        /* keep the panel's line in two registers: gcc would fold the loads into every
           FMA, R times over, and a tile of 4 rows would wait on 12 loads a k, not 6 */
        __asm__("" : "+x"(w0), "+x"(w1));
        for (int r = 0; r < R; r++) {
            const __m256 b = _mm256_broadcast_ss(x + k * R + r);
            acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        /* masked stores only on the last panel: they are slow on AMD cores */
        if (full) {
            _mm256_storeu_ps(y + r * ldy, acc[r][0]);
            _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
        } else {
            _mm256_maskstore_ps(y + r * ldy, m0, acc[r][0]);
            _mm256_maskstore_ps(y + r * ldy + 8, m1, acc[r][1]);
        }
    }
}

/* rows x[0..rows-1][0..K-1] -> dst [K][rows] */
static void pack_rows(const float* x, int64_t ldx, int rows, int64_t K, float* dst) {
    for (int r = 0; r < rows; r++)
        for (int64_t k = 0; k < K; k++) dst[k * rows + r] = x[r * ldx + k];
}

/* the end of group g of `groups` over `rows` rows, spread evenly (at most MR each) */
INLINE int64_t group_end(int64_t rows, int64_t groups, int64_t g) {
    return (rows * (g + 1) + groups - 1) / groups;
}

static __thread float xbuf[XMAX] __attribute__((aligned(64)));

#define TILE_PF(R, PF) tile(xg, pw, kc, yg, ldy, bp, first, pf, 0, ncols, R, PF); break;
#define TILE(R)                                                          \
    switch (pfmode) {                                                    \
    case 1: TILE_PF(R, 1) case 2: TILE_PF(R, 2) case 3: TILE_PF(R, 3)   \
    case 4: TILE_PF(R, 4) case 5: TILE_PF(R, 5) case 6: TILE_PF(R, 6)   \
    default: TILE_PF(R, 0)                                               \
    }                                                                    \
    break;

#define STREAM_PF(R, n) \
    tile(xg, pw, kc, yg, ldy, bp, first, pf, stride, ncols, R, SPREAD + n - 1); break;
#define STREAM_TILE(R) if (groups == 1) { STREAM_PF(R, 1) } else { STREAM_PF(R, 2) }

/* One or two groups of rows (1-12: a decode step of few sequences) over the panels, read as
   four streams side by side (the top of the file says why): the panels in four runs of Q,
   a block (16 KB) of each run in turn, and each tile prefetches its share of every stream's
   next block, a line of each stream in turn. Every output sums over k in the same order as
   in `linear_f32`'s loop, so the results are the same bits. */
static void streams(const float* packed, int64_t N, int64_t K, int64_t P, const float* xbuf0,
                    int rows, const float* bias, float* y0, int64_t ldy) {
    const int groups = (rows + MR - 1) / MR;
    const int64_t Q = (P + STREAMS - 1) / STREAMS; /* panels a stream */
    const int64_t stride = Q * K * NR;              /* floats from a stream to the next */
    for (int64_t q = 0; q < Q; q++) {
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? (int)(K - k0) : KC;
            const int first = k0 == 0, share = (kc + STREAMS - 1) / STREAMS;
            for (int s = 0; s < STREAMS && s * Q + q < P; s++) {
                const int64_t p = s * Q + q;
                const int ncols = N - p * NR < NR ? (int)(N - p * NR) : NR;
                const float* pw = packed + (p * K + k0) * NR;
                const float* bp = bias ? bias + p * NR : 0;
                for (int g = 0, m = 0; g < groups; g++) {
                    const int end = (int)group_end(rows, groups, g), rg = end - m;
                    const float* xg = xbuf0 + m * K + k0 * rg;
                    const float* pf = packed + (q * K + k0) * NR + NEXT
                                      + ((int64_t)s * share + g * (share / groups)) * NR;
                    float* yg = y0 + m * ldy + p * NR;
                    switch (rg) {
                    case 1: STREAM_TILE(1) case 2: STREAM_TILE(2) case 3: STREAM_TILE(3)
                    case 4: STREAM_TILE(4) case 5: STREAM_TILE(5) default: STREAM_TILE(6)
                    }
                    m = end;
                }
            }
        }
    }
}

/* Returns 0, or -1 for a K over the input buffer (65536). */
int linear_f32(const float* packed, int64_t N, int64_t K, const float* x, int64_t M,
               int64_t ldx, const float* bias, float* y, int64_t ldy) {
    if (K < 1 || K > XMAX) return -1;
    const int64_t P = (N + NR - 1) / NR;
    int64_t cap = XMAX / K; /* rows whose K values the buffer holds */
    if (cap > MR) cap -= cap % MR;
    const int64_t blocks = (M + cap - 1) / cap;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t m1 = M * (b + 1) / blocks, rows = m1 - m0;
        const int64_t groups = (rows + MR - 1) / MR;
        for (int64_t g = 0, m = 0; g < groups; g++) {
            const int64_t end = group_end(rows, groups, g);
            pack_rows(x + (m0 + m) * ldx, ldx, (int)(end - m), K, xbuf + m * K);
            m = end;
        }
        if (groups <= 2) {
            streams(packed, N, K, P, xbuf, (int)rows, bias, y + m0 * ldy, ldy);
            m0 = m1;
            continue;
        }
        for (int64_t p = 0; p < P; p++) {
            const int ncols = N - p * NR < NR ? (int)(N - p * NR) : NR;
            const float* bp = bias ? bias + p * NR : 0;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int kc = K - k0 < KC ? (int)(K - k0) : KC;
                const int first = k0 == 0;
                const float* pw = packed + (p * K + k0) * NR;
                for (int64_t g = 0, m = 0; g < groups; g++) {
                    const int64_t end = group_end(rows, groups, g);
                    const float* xg = xbuf + m * K + k0 * (end - m);
                    float* yg = y + (m0 + m) * ldy + p * NR;
                    /* which lines this group prefetches (the comment at the top) */
                    const int shared = groups <= SHARED;
                    const int pfmode = shared ? (int)groups : g == 0 ? 1 : 0;
                    const float* pf = shared ? pw + FAR + g * ((kc + groups - 1) / groups) * NR
                                             : pw + AHEAD;
                    switch (end - m) {
                    case 1: TILE(1) case 2: TILE(2) case 3: TILE(3)
                    case 4: TILE(4) case 5: TILE(5) default: TILE(6)
                    }
                    m = end;
                }
            }
        }
        m0 = m1;
    }
    return 0;
}
