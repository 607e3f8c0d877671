/* One decode step's attention over the paged KV pool, on the CPU, in fp32 (AVX2 and FMA):
   paged_decode.c's job for a CPU without AVX-512, where a worker holds fp32 weights and KV.

   Why a kernel: torch's path gathers each sequence's blocks into a buffer (a copy of every
   K and V a step reads) and then runs SDPA on it; here K and V are read where they lie in
   the pool, once, with the next rows prefetched. Measured on an AMD EPYC Zen 3 core, the
   82m shape, contexts of 320 scattered through a pool no cache holds, 12 layers: a step's
   attention 18.9 against 29.6 ms (torch's gather + SDPA) at 8 sequences, 56.4 against
   88.7 at 32 (bench/bench_f32_kernels.py).

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

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define INLINE static inline __attribute__((always_inline))

/* exp of 8 floats: Cephes' expf, 2^n * p(r) with r = x - n ln2 (as vec_math.h's exp_ps) */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-103.972084045410f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n: n + 127 into the exponent; n >= -150 here, so 2^n may be a denormal's scale:
       split it in two factors, each a normal */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

/* the first n of 8 lanes, as a mask for maskload/maskstore */
INLINE __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 vectors -> the vector of their 8 horizontal sums, in order */
INLINE __m256 sums_of_8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab's low lane: sums 0-3 of the low halves; high lane: of the high halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
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

/* 8 positions' scores for one query head (NV = head_dim / 8, a constant per instance) */
INLINE __m256 scores8(const float* const* rows, int hoff, const float* qh, const int NV) {
    __m256 part[8];
    for (int i = 0; i < 8; i++) {
        const float* kr = rows[i] + hoff;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kr));
        for (int v = 1; v < NV; v++)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), _mm256_loadu_ps(kr + 8 * v), a);
        part[i] = a;
    }
    return sums_of_8(part);
}

/* each row of sc ([rows][n]) -> softmax(row), in place */
static void softmax_rows(float* sc, int rows, int n) {
    for (int j = 0; j < rows; j++) {
        float* r = sc + (int64_t)j * n;
        float mx = -INFINITY;
        for (int i = 0; i < n; i++) mx = r[i] > mx ? r[i] : mx;
        const __m256 m = _mm256_set1_ps(mx);
        __m256 tot = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) {
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

/* out rows of GJ query heads of one KV head: sum over positions of p * v */
INLINE void values(rows_t vat, int n, int hoff, const float* p, int64_t pstride, float* out,
                   int hd, const int NV, const int GJ) {
    __m256 acc[4][MAX_HEAD_DIM / 8]; /* [GJ][NV] used: constants, so registers */
    for (int j = 0; j < GJ; j++)
        for (int v = 0; v < NV; v++) acc[j][v] = _mm256_setzero_ps();
    rows_t ahead = vat;
    for (int i = 0; i < 32; i++) row_next(&ahead);
    for (int t = 0; t < n; t++, row_next(&vat), row_next(&ahead)) {
        const float* vr = row_here(&vat) + hoff;
        if (t + 32 < n)
            for (int64_t b = 0; b < (int64_t)hd * 4; b += 64)
                _mm_prefetch((const char*)(row_here(&ahead) + hoff) + b, _MM_HINT_T0);
        __m256 w[4];
        for (int j = 0; j < GJ; j++) w[j] = _mm256_broadcast_ss(p + j * pstride + t);
        for (int v = 0; v < NV; v++) {
            const __m256 x = _mm256_loadu_ps(vr + 8 * v);
            for (int j = 0; j < GJ; j++) acc[j][v] = _mm256_fmadd_ps(w[j], x, acc[j][v]);
        }
    }
    for (int j = 0; j < GJ; j++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + (int64_t)j * hd + 8 * v, acc[j][v]);
}

INLINE int decode(const float* q, const float* kpool, const float* vpool, const int64_t* tables,
                  int64_t table_stride, const int32_t* ctx_lens, const int32_t* starts, int B,
                  int H, int KVH, int bs, float scale, float* scratch, int64_t scratch_elems,
                  float* out, const int NV) {
    const int hd = 8 * NV, g = H / KVH;
    /* query heads per call of `values`: at most 12 accumulators of AVX2's 16 registers */
    const int GJ = NV <= 3 ? 4 : NV <= 4 ? 3 : NV <= 6 ? 2 : 1;
    const int64_t tok = (int64_t)KVH * hd; /* floats of one position's row */
    for (int b = 0; b < B; b++) {
        const int c = ctx_lens[b], s0 = starts[b], n = c - s0;
        if (n < 1) return -1;
        if ((int64_t)H * n > scratch_elems) return -2;
        const int64_t* tab = tables + (int64_t)b * table_stride;
        const float* qb = q + (int64_t)b * H * hd;
        float* sc = scratch; /* [H][n] */
        rows_t at = rows_from(kpool, tab, s0, bs, tok), ahead = at;
        for (int i = 0; i < 8 && s0 + i < c; i++) row_next(&ahead);
        for (int t0 = s0; t0 < c; t0 += 8) {
            const int nt = c - t0 < 8 ? c - t0 : 8;
            const float* rows[8];
            for (int i = 0; i < 8; i++) {
                rows[i] = row_here(&at);   /* past the end: the last row again */
                if (i + 1 < nt) row_next(&at);
            }
            row_next(&at);
            /* the next 8 positions' K and V rows into L2 */
            for (int i = 0; i < 8 && t0 + 8 + i < c; i++, row_next(&ahead)) {
                const char* kr = (const char*)row_here(&ahead);
                for (int64_t l = 0; l < tok * 4; l += 64) {
                    _mm_prefetch(kr + l, _MM_HINT_T1);
                    _mm_prefetch((const char*)vpool + (kr - (const char*)kpool) + l, _MM_HINT_T1);
                }
            }
            for (int h = 0; h < H; h++) {
                const __m256 s = _mm256_mul_ps(scores8(rows, (h / g) * hd, qb + h * hd, NV),
                                               _mm256_set1_ps(scale));
                _mm256_maskstore_ps(sc + (int64_t)h * n + (t0 - s0), lanes(nt), s);
            }
        }
        softmax_rows(sc, H, n);
        const rows_t vat = rows_from(vpool, tab, s0, bs, tok);
        for (int h = 0; h < KVH; h++)
            for (int j = 0; j < g; j += GJ) {
                const float* p = sc + (int64_t)(h * g + j) * n;
                float* o = out + ((int64_t)b * H + h * g + j) * hd;
#define VALUES(R) values(vat, n, h * hd, p, n, o, hd, NV, R); break;
                switch (g - j < GJ ? g - j : GJ) {
                case 1: VALUES(1) case 2: VALUES(2) case 3: VALUES(3) default: VALUES(4)
                }
#undef VALUES
            }
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
#define CASE(NV) case NV: return decode(q, kpool, vpool, tables, table_stride, ctx_lens, \
                                        starts, B, H, KVH, bs, scale, scratch, scratch_elems, out, NV);
    switch (hd / 8) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
    CASE(17) CASE(18) CASE(19) CASE(20) CASE(21) CASE(22) CASE(23) CASE(24)
    CASE(25) CASE(26) CASE(27) CASE(28) CASE(29) CASE(30) CASE(31) CASE(32)
    }
#undef CASE
    return -1;
}
