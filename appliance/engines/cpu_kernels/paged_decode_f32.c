/* One decode step's attention over the paged KV pool, on the CPU, in fp32 (AVX2 and FMA):
   paged_decode.c's job for a CPU without AVX-512, where a worker holds fp32 weights and KV.

   Why a kernel: torch's path gathers each sequence's blocks into a buffer (a copy of every
   K and V a step reads) and then runs SDPA on it; here K and V are read where they lie in
   the pool, once. Measured on an AMD EPYC Zen 3 core, the 82m shape, contexts of 320
   scattered through a pool no cache holds, 12 layers: a step's attention 18.9 against
   29.6 ms (torch's gather + SDPA) at 8 sequences, 56.4 against 88.7 at 32 (session 48,
   bench/bench_f32_kernels.py).

   Two passes a sequence. Scores: 4 positions at a time, each K vector loaded once for up
   to 3 query heads of its KV head (12 accumulators). Values: a run of rows at a time
   (seq_one: every query head over them, the rows in L1 after the first head; seq_four:
   as its scores), summed into the output per run. The kernel before read scores for 8
   positions of one head (two loads an FMA) and, in the values pass, swept all of V once
   for each query head.

   Two ways to walk a sequence's rows. `seq_one`: in order, the rows two blocks ahead
   prefetched; it gets ~5-8 GB/s of K and V where the core streams ~9-12, and no prefetch
   distance tried (1-64 rows, into L1 or L2), nor huge pages, nor none at all, brought the
   rows sooner. `seq_four`: four streams side by side, a quarter of the span each, then
   the last n % 4 rows, and no software prefetch: one core read 16 KB blocks in a random
   order at 10.6 GB/s as one stream, 15.5 as two, 22.6 as four (session 63, a Zen 3;
   bench/read_streams.c). Its values pass reads V as its scores pass reads K, a row of
   each stream at a time, each V vector for up to 3 query heads: it read 4 rows of each
   stream at a time and every query head loaded them again from L1, and took ~1.6x the
   scores pass's time. Session 66 (a Zen 3, 12 layers of the 82m shape, contexts of 290,
   from memory, a C loop over the kernel alone, alternating): 8 sequences 5.2-5.6 ->
   3.8-4.2 ms, 32 sequences 21.6-23.0 -> 16.1-19.7; contexts of 1000 and 4000 and 64
   20-28% less too. A walk prefetching the step's rows 64-256 KB ahead (across passes and
   sequences) gained nothing there. Against `seq_one`, 12 layers of the 82m shape from memory,
   alternating (bench_f32_kernels --rows 0 --contexts 290): 8 sequences 8.2-9.2 -> 7.0-8.6
   ms, 32 sequences 28.3-29.2 -> 24.7-29.9 (session 64; session 63: 8.5-9.7 -> 6.5-7.7,
   30-40 -> 23-26). Four streams serve the head sizes of the families served (64, 128,
   256); the others read one, so that the file builds in ~30 s, not 2-3.5x that.

   The numbers are SDPA's in fp32: scores = (q . k) * scale, softmax, out = sum p * v, all
   in fp32; only summation order and exp differ (exp: Cephes' polynomial, within ~1 ulp of
   expf).

   Layout (one layer): pool [blocks, block_size, kv_heads, head_dim] fp32, K and V apart;
   q and out [B, heads, head_dim] fp32, contiguous; tables [B, table_stride] int64 block
   ids; sequence b reads positions starts[b] .. ctx_lens[b]-1 (a sliding window's start).
   head_dim a multiple of 8.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vec_math_avx2.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define AHEAD 32 /* rows a pass prefetches ahead of those it reads: two blocks of 16 */
#define INLINE static inline __attribute__((always_inline))

/* 4 vectors -> their 4 horizontal sums, in order */
INLINE __m128 sums_of_4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    /* t's low lane: the four sums of the low halves; high lane: of the high halves */
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Walks a sequence's positions through its block table without a division per row. */
typedef struct {
    const float* pool;
    const int64_t* tab;
    int64_t tok;
    int bs, blk, off;
} rows_t;

INLINE rows_t rows_from(const float* pool, const int64_t* tab, int t, int bs, int64_t tok) {
    rows_t r = {pool, tab, tok, bs, t / bs, t % bs};
    return r;
}

INLINE const float* row_here(const rows_t* r) {
    return r->pool + (r->tab[r->blk] * r->bs + r->off) * r->tok;
}

INLINE void row_next(rows_t* r) {
    if (++r->off == r->bs) {
        r->off = 0;
        r->blk++;
    }
}

/* 4 positions' scores (rows[0..3], at column hoff) for GH query heads of one KV head
   (q: their rows, head_dim apart), times scale, into sc[j * n + i * step] for head j and
   row i: nt of them. Each K vector is loaded once for the GH heads; 12 accumulators, 3 q
   vectors, 1 K. */
INLINE void scores4(const float* const* rows, int hoff, const float* q, float scale,
                    float* sc, int64_t n, int nt, int step, const int NV, const int GH) {
    __m256 acc[3][4];
    for (int j = 0; j < GH; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_ps();
    for (int v = 0; v < NV; v++) {
        __m256 qv[3];
        for (int j = 0; j < GH; j++) qv[j] = _mm256_loadu_ps(q + j * 8 * NV + 8 * v);
        for (int i = 0; i < 4; i++) {
            const __m256 kv = _mm256_loadu_ps(rows[i] + hoff + 8 * v);
            for (int j = 0; j < GH; j++) acc[j][i] = _mm256_fmadd_ps(qv[j], kv, acc[j][i]);
        }
    }
    for (int j = 0; j < GH; j++) {
        const __m128 s = _mm_mul_ps(sums_of_4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                                    _mm_set1_ps(scale));
        if (nt == 4 && step == 1) {
            _mm_storeu_ps(sc + j * n, s);
        } else {
            float t[4];
            _mm_storeu_ps(t, s);
            for (int i = 0; i < nt; i++) sc[j * n + i * step] = t[i];
        }
    }
}

/* each row of sc ([rows][n]) -> softmax(row), in place */
static void softmax_rows(float* sc, int rows, int n) {
    for (int j = 0; j < rows; j++) {
        float* r = sc + (int64_t)j * n;
        const __m256 m = _mm256_set1_ps(row_max(r, n));
        __m256 tot = _mm256_setzero_ps();
        int i;
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + i), m));
            _mm256_storeu_ps(r + i, e);
            tot = _mm256_add_ps(tot, e);
        }
        if (i < n) {
            const __m256i k = lanes(n - i);
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(r + i, k), m)),
                                           _mm256_castsi256_ps(k));
            _mm256_maskstore_ps(r + i, k, e);
            tot = _mm256_add_ps(tot, e);
        }
        float t[8];
        _mm256_storeu_ps(t, tot);
        const float total = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
        const __m256 sum = _mm256_set1_ps(total);
        for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(r + i, _mm256_div_ps(_mm256_loadu_ps(r + i), sum));
        for (; i < n; i++) r[i] /= total;
    }
}

/* acc (NC vectors of one query head's output, a chunk of head_dim) += sum over `run`
   positions of p[t] * v[t]; v rows `tok` floats apart (consecutive rows of one block) */
INLINE void values_run(const float* v, int64_t tok, const float* p, int run, float* out,
                       const int NC) {
    __m256 acc[8];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int t = 0; t < run; t++) {
        const __m256 w = _mm256_broadcast_ss(p + t);
        const float* vr = v + t * tok;
        for (int c = 0; c < NC; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
    }
    for (int c = 0; c < NC; c++)
        _mm256_storeu_ps(out + 8 * c, _mm256_add_ps(_mm256_loadu_ps(out + 8 * c), acc[c]));
}

/* out (GH query heads of one KV head, head_dim apart; 4 vectors of each from column off)
   += sum over nr rows of w[j * 4 + r] * rows[r][off..]: each V vector loaded once for the
   GH heads (12 accumulators, 3 broadcasts, 1 V) */
INLINE void values_rows(const float* const* rows, int off, const float* w, int nr, float* out,
                        int64_t hd, const int GH) {
    __m256 acc[3][4];
    for (int j = 0; j < GH; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm256_setzero_ps();
    for (int r = 0; r < nr; r++) {
        __m256 b[3];
        for (int j = 0; j < GH; j++) b[j] = _mm256_broadcast_ss(w + j * 4 + r);
        const float* vr = rows[r] + off;
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_loadu_ps(vr + 8 * c);
            for (int j = 0; j < GH; j++) acc[j][c] = _mm256_fmadd_ps(b[j], v, acc[j][c]);
        }
    }
    for (int j = 0; j < GH; j++)
        for (int c = 0; c < 4; c++) {
            float* o = out + j * hd + 8 * c;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[j][c]));
        }
}

/* the lines of `rows` rows from `r` on, into L2: the stream a pass reads next */
INLINE void prefetch_rows(rows_t r, int rows, int64_t tok) {
    for (int i = 0; i < rows; i++, row_next(&r)) {
        const char* at = (const char*)row_here(&r);
        for (int64_t l = 0; l < tok * 4; l += 64) _mm_prefetch(at + l, _MM_HINT_T1);
    }
}

/* one sequence's attention: rows s0 .. c-1 of its table `tab`; q and out its rows,
   sc its [H][n] scores */
INLINE void seq_one(const float* qb, const float* kpool, const float* vpool,
                   const int64_t* tab, int s0, int c, int H, int g, int bs, float scale,
                   float* sc, float* ob, const int NV) {
    const int hd = 8 * NV, n = c - s0;
    const int64_t tok = (int64_t)(H / g) * hd; /* floats of one position's row */
    /* pass 1: scores, K's rows in order, AHEAD rows prefetched ahead of them */
    rows_t at = rows_from(kpool, tab, s0, bs, tok), ahead = at;
    const int first = n < AHEAD ? n : AHEAD;
    prefetch_rows(at, first, tok);
    for (int i = 0; i < first; i++) row_next(&ahead);
    for (int t0 = s0; t0 < c; t0 += 4) {
        const int nt = c - t0 < 4 ? c - t0 : 4;
        const float* rows[4];
        for (int i = 0; i < 4; i++) {
            rows[i] = row_here(&at);   /* past the end: the last row again */
            if (i + 1 < nt) row_next(&at);
        }
        row_next(&at);
        const int more = c - (t0 + AHEAD) < 4 ? c - (t0 + AHEAD) : 4;
        if (more > 0) {
            prefetch_rows(ahead, more, tok);
            for (int i = 0; i < more; i++) row_next(&ahead);
        }
        for (int h = 0; h < H; h += 3) {
            /* up to 3 query heads of one KV head at a time */
            const int kvh = h / g, left = (kvh + 1) * g - h, gh = left < 3 ? left : 3;
            float* at_sc = sc + (int64_t)h * n + (t0 - s0);
#define SCORES(GH) scores4(rows, kvh * hd, qb + h * hd, scale, at_sc, n, nt, 1, NV, GH); break;
            switch (gh) {
            case 1: SCORES(1) case 2: SCORES(2) default: SCORES(3)
            }
#undef SCORES
            h += gh - 3;
        }
    }
    softmax_rows(sc, H, n);
    /* pass 2: values, V's rows in order a block's run at a time; each run's rows (in
       L1 after the first head reads them) serve every head */
    for (int i = 0; i < H * hd; i += 8) _mm256_storeu_ps(ob + i, _mm256_setzero_ps());
    rows_t vat = rows_from(vpool, tab, s0, bs, tok), vahead = vat;
    prefetch_rows(vat, first, tok);
    for (int i = 0; i < first; i++) row_next(&vahead);
    for (int t0 = s0; t0 < c;) {
        const int run = bs - vat.off < c - t0 ? bs - vat.off : c - t0;
        const float* v0 = row_here(&vat);
        const int more = c - (t0 + AHEAD) < run ? c - (t0 + AHEAD) : run;
        if (more > 0) {
            prefetch_rows(vahead, more, tok);
            for (int i = 0; i < more; i++) row_next(&vahead);
        }
        for (int h = 0; h < H; h++) {
            const float* v = v0 + (h / g) * hd;
            const float* p = sc + (int64_t)h * n + (t0 - s0);
            for (int c0 = 0; c0 < NV; c0 += 8) {
                float* o = ob + (int64_t)h * hd + 8 * c0;
#define RUN(NC) values_run(v + 8 * c0, tok, p, run, o, NC); break;
                switch (NV - c0 < 8 ? NV - c0 : 8) {
                case 1: RUN(1) case 2: RUN(2) case 3: RUN(3) case 4: RUN(4)
                case 5: RUN(5) case 6: RUN(6) case 7: RUN(7) default: RUN(8)
                }
#undef RUN
            }
        }
        for (int i = 0; i < run; i++) row_next(&vat);
        t0 += run;
    }
}

/* the next row of each of four streams (st[i]); on the tail (nt = n % 4 rows, from
   st[3], which stands at the first of them) nt rows of st[3], the last repeated to fill
   rows[4] */
INLINE void four_rows(rows_t* st, int tail, int nt, const float** rows) {
    for (int i = 0; i < 4; i++) {
        rows_t* from = tail ? &st[3] : &st[i];
        rows[i] = row_here(from);
        if (!tail || i + 1 < nt) row_next(from);
    }
}

/* one sequence's attention: rows s0 .. c-1 of its table `tab`; q and out its rows,
   sc its [H][n] scores */
INLINE void seq_four(const float* qb, const float* kpool, const float* vpool,
                   const int64_t* tab, int s0, int c, int H, int g, int bs, float scale,
                   float* sc, float* ob, const int NV) {
    const int hd = 8 * NV, n = c - s0;
    const int64_t tok = (int64_t)(H / g) * hd; /* floats of one position's row */
    /* pass 1: scores. K's rows as four streams side by side, a quarter of the span
       each, then the last n % 4 rows: one core read four scattered streams of 16 KB
       blocks twice as fast as one (session 63, a Zen 3: 22.6 against 10.6 GB/s),
       and the hardware's prefetcher follows each without software prefetches */
    const int L = n / 4;
    rows_t st[4];
    for (int i = 0; i < 4; i++) st[i] = rows_from(kpool, tab, s0 + i * L, bs, tok);
    for (int t = 0; t < L + 1; t++) {
        const int tail = t == L, nt = tail ? n - 4 * L : 4;
        if (nt == 0) break;
        const float* rows[4];
        four_rows(st, tail, nt, rows);
        const int step = tail ? 1 : L;
        float* at_t = sc + (tail ? 4 * L : t);
        for (int h = 0; h < H; h += 3) {
            /* up to 3 query heads of one KV head at a time */
            const int kvh = h / g, left = (kvh + 1) * g - h, gh = left < 3 ? left : 3;
            float* at_sc = at_t + (int64_t)h * n;
#define SCORES(GH) scores4(rows, kvh * hd, qb + h * hd, scale, at_sc, n, nt, step, NV, GH); break;
            switch (gh) {
            case 1: SCORES(1) case 2: SCORES(2) default: SCORES(3)
            }
#undef SCORES
            h += gh - 3;
        }
    }
    softmax_rows(sc, H, n);
    /* pass 2: values, the same four streams of V's rows, a row of each at a time as
       pass 1 reads K, then the last n % 4 rows; each V vector serves up to 3 query heads
       of its KV head (the header says why) */
    for (int i = 0; i < H * hd; i += 8) _mm256_storeu_ps(ob + i, _mm256_setzero_ps());
    for (int i = 0; i < 4; i++) st[i] = rows_from(vpool, tab, s0 + i * L, bs, tok);
    for (int t = 0; t < L + 1; t++) {
        const int tail = t == L, nr = tail ? n - 4 * L : 4;
        if (nr == 0) break;
        const float* rows[4];
        four_rows(st, tail, nr, rows);
        for (int h = 0; h < H; h += 3) {
            const int kvh = h / g, left = (kvh + 1) * g - h, gh = left < 3 ? left : 3;
            float w[3 * 4];
            for (int j = 0; j < gh; j++)
                for (int r = 0; r < nr; r++)   /* row r's position: r * L + t, or the tail's */
                    w[j * 4 + r] = sc[(int64_t)(h + j) * n + (tail ? 4 * L + r : r * L + t)];
            for (int c0 = 0; c0 < NV; c0 += 4) {
                float* o = ob + (int64_t)h * hd + 8 * c0;
#define RUN(GH) values_rows(rows, kvh * hd + 8 * c0, w, nr, o, hd, GH); break;
                switch (gh) {
                case 1: RUN(1) case 2: RUN(2) default: RUN(3)
                }
#undef RUN
            }
            h += gh - 3;
        }
    }
}

/* every sequence through seq_one, or seq_four where FOUR */
INLINE int decode(const float* q, const float* kpool, const float* vpool, const int64_t* tables,
                  int64_t table_stride, const int32_t* ctx_lens, const int32_t* starts, int B,
                  int H, int KVH, int bs, float scale, float* scratch, int64_t scratch_elems,
                  float* out, const int NV, const int FOUR) {
    const int hd = 8 * NV, g = H / KVH;
    for (int b = 0; b < B; b++) {
        const int c = ctx_lens[b], s0 = starts[b];
        if (c - s0 < 1) return -1;
        if ((int64_t)H * (c - s0) > scratch_elems) return -2;
        const int64_t* tab = tables + (int64_t)b * table_stride;
        const float* qb = q + (int64_t)b * H * hd;
        float* ob = out + (int64_t)b * H * hd;
        if (FOUR)
            seq_four(qb, kpool, vpool, tab, s0, c, H, g, bs, scale, scratch, ob, NV);
        else
            seq_one(qb, kpool, vpool, tab, s0, c, H, g, bs, scale, scratch, ob, NV);
    }
    return 0;
}

/* Returns 0; -1 when the shape is outside this kernel (the caller uses torch's path);
   -2 when `scratch` (heads x longest span floats) is too small. */
int paged_decode_f32(const float* q, const float* kpool, const float* vpool,
                     const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                     const int32_t* starts, int B, int H, int KVH, int hd, int bs, float scale,
                     float* scratch, int64_t scratch_elems, float* out) {
    if (H > MAX_HEADS || hd > MAX_HEAD_DIM || hd % 8 || KVH < 1 || H % KVH || bs < 1) return -1;
#define ARGS q, kpool, vpool, tables, table_stride, ctx_lens, starts, B, H, KVH, bs, scale, \
             scratch, scratch_elems, out
    /* the head sizes of the families served (64: Llama 3.2, gpt-oss; 128: Qwen3, Llama 3
       8B; 256: Gemma 3) read four streams; the rest one, which keeps the build short (a
       four-stream copy for every head size took 2-3.5x as long to build, 36-70 s under
       load, and timed out test daemons) */
    switch (hd / 8) {
    case 8: return decode(ARGS, 8, 1);
    case 16: return decode(ARGS, 16, 1);
    case 32: return decode(ARGS, 32, 1);
    }
#define CASE(NV) case NV: return decode(ARGS, NV, 0);
    switch (hd / 8) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15)
    CASE(17) CASE(18) CASE(19) CASE(20) CASE(21) CASE(22) CASE(23) CASE(24)
    CASE(25) CASE(26) CASE(27) CASE(28) CASE(29) CASE(30) CASE(31)
    }
#undef CASE
#undef ARGS
    return -1;
}
