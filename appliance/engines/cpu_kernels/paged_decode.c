/* One decode step's attention over the paged KV pool, on the CPU, in bf16 (AVX-512F).

   Why a kernel: torch has no paged attention on the CPU, so the engine's torch path
   gathers each sequence's blocks into a buffer, copies K and V again into a head-major
   layout for the batched matmuls, and runs tiny matmuls of (query heads per KV head) rows.
   Here K and V are read where they lie in the pool, once, with the next rows prefetched.

   The numbers are those of the torch path (`layers.attention._grouped_decode`, which
   rounds as transformers' eager attention does in bf16): scores = bf16(q . k) * scale,
   softmax in fp32, probabilities rounded to bf16, output = bf16(sum p * v), accumulated
   in fp32. Only summation order and exp differ (exp: Cephes' polynomial, within ~1 ulp).

   Layout (one layer): pool [blocks, block_size, kv_heads, head_dim] bf16, K and V apart;
   q and out [B, heads, head_dim] bf16, contiguous; tables [B, table_stride] int64 block
   ids; sequence b reads positions starts[b] .. ctx_lens[b]-1 (a sliding window's start).
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256

/* [a's pairwise sums | b's pairwise sums] */
static inline __m512 pair_sums(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

/* 16 vectors -> the vector of their 16 horizontal sums, in order */
static inline __m512 sums_of_16(const __m512* v) {
    __m512 r[8], s[4], u[2];
    for (int i = 0; i < 8; i++) r[i] = pair_sums(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; i++) s[i] = pair_sums(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 2; i++) u[i] = pair_sums(s[2 * i], s[2 * i + 1]);
    return pair_sums(u[0], u[1]);
}

/* each row of sc ([rows][n]) -> bf16(softmax(row)): as fp32 values in place, or with
   `packed`, as bf16 written over the row's start ([n] bf16, a zero after an odd n: whole
   pairs for `values_pairs`). In place is safe: a vector's 32 bytes go where the 64 it
   was read from, or earlier ones, lay. */
static void softmax_rows(float* sc, int rows, int n, int packed) {
    for (int j = 0; j < rows; j++) {
        float* r = sc + (int64_t)j * n;
        __m512 m = _mm512_set1_ps(-INFINITY), tot = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16)
            m = _mm512_mask_max_ps(m, first(n - i), m, _mm512_maskz_loadu_ps(first(n - i), r + i));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for (int i = 0; i < n; i += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(first(n - i), r + i), mx));
            _mm512_mask_storeu_ps(r + i, first(n - i), e);
            tot = _mm512_mask_add_ps(tot, first(n - i), tot, e);
        }
        const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(tot));
        uint16_t* b = (uint16_t*)r;
        for (int i = 0; i < n; i += 16) {
            const __m512 p = _mm512_div_ps(_mm512_maskz_loadu_ps(first(n - i), r + i), sum);
            if (packed)
                store_bf16(b + i, p, first(n - i));
            else
                _mm512_mask_storeu_ps(r + i, first(n - i), round_bf16(p));
        }
        if (packed && (n & 1)) b[n] = 0;
    }
}

/* Walks a sequence's positions through its block table without a division per row. */
typedef struct {
    const uint16_t* pool;
    const int64_t* tab;
    int64_t tok;
    int bs, blk, off;
} rows_t;

static inline rows_t rows_from(const uint16_t* pool, const int64_t* tab, int t, int bs, int64_t tok) {
    rows_t r = {pool, tab, tok, bs, t / bs, t % bs};
    return r;
}

static inline const uint16_t* row_here(const rows_t* r) {
    return r->pool + (r->tab[r->blk] * r->bs + r->off) * r->tok;
}

static inline void row_next(rows_t* r) {
    if (++r->off == r->bs) {
        r->off = 0;
        r->blk++;
    }
}

/* A macro: the hint must be a constant, and gcc 12 dropped every call of this as a
   function (it judged an out-of-line copy free of side effects: a prefetch writes nothing) */
#define prefetch_row(row, elems, hint)                                                   \
    for (int64_t b_ = 0; b_ < (int64_t)(elems) * 2; b_ += 64)                             \
        _mm_prefetch((const char*)(row) + b_, hint)

#define INLINE static inline __attribute__((always_inline))

/* 16 positions' scores for one query head: a vector of 16 fp32 sums (NV = head_dim/16,
   a constant in each instantiation so the loops unroll and the sums stay in registers) */
INLINE __m512 scores16(const uint16_t* const* rows, int hoff, const uint16_t* qh,
                       const float* qq, const int NV) {
    __m512 part[16];
#ifdef __AVX512BF16__
    /* bf16 pairs straight from q and the pool: the same exact products, summed in fp32
       in another order */
    (void)qq;
    __m512bh qv[(MAX_HEAD_DIM + 31) / 32];
    for (int d = 0; d < NV; d += 2)
        qv[d / 2] = (__m512bh)_mm512_maskz_loadu_epi16(NV - d >= 2 ? 0xffffffffu : 0xffffu, qh + 16 * d);
    for (int i = 0; i < 16; i++) {
        const uint16_t* kr = rows[i] + hoff;
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < NV; d += 2)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(
                                        NV - d >= 2 ? 0xffffffffu : 0xffffu, kr + 16 * d), qv[d / 2]);
        part[i] = a;
    }
#else
    (void)qh;
    for (int i = 0; i < 16; i++) {
        const uint16_t* kr = rows[i] + hoff;
        __m512 a = _mm512_mul_ps(_mm512_load_ps(qq), load_bf16(kr));
        for (int v = 1; v < NV; v++)
            a = _mm512_fmadd_ps(_mm512_load_ps(qq + 16 * v), load_bf16(kr + 16 * v), a);
        part[i] = a;
    }
#endif
    return sums_of_16(part);
}

/* out rows of GJ query heads of one KV head: sum over positions of p * v, in fp32 */
INLINE void values(rows_t vat, int n, int hoff, const float* p, int64_t pstride,
                   uint16_t* out, int hd, const int NV, const int GJ) {
    __m512 acc[4][MAX_HEAD_DIM / 16];   /* [GJ][NV] used: constants, so registers */
    for (int j = 0; j < GJ; j++)
        for (int v = 0; v < NV; v++) acc[j][v] = _mm512_setzero_ps();
    rows_t ahead = vat;
    for (int i = 0; i < 48; i++) row_next(&ahead);
    for (int t = 0; t < n; t++, row_next(&vat), row_next(&ahead)) {
        const uint16_t* vr = row_here(&vat) + hoff;
        if (t + 48 < n) prefetch_row(row_here(&ahead) + hoff, hd, _MM_HINT_T0);
        __m512 w[4];
        for (int j = 0; j < GJ; j++) w[j] = _mm512_set1_ps(p[j * pstride + t]);
        for (int v = 0; v < NV; v++) {
            const __m512 x = load_bf16(vr + 16 * v);
            for (int j = 0; j < GJ; j++) acc[j][v] = _mm512_fmadd_ps(w[j], x, acc[j][v]);
        }
    }
    for (int j = 0; j < GJ; j++)
        for (int v = 0; v < NV; v++) store_bf16(out + (int64_t)j * hd + 16 * v, acc[j][v], 0xffff);
}

#ifdef __AVX512BF16__
/* `values` two positions at a time on VDPBF16PS: p as bf16 pairs (dword t/2 of each head's
   row holds positions t and t+1; `pstride` dwords between heads), each two V rows
   interleaved into pairs by an unpack. Half the multiplies of `values` and no widening of
   V; the products are the same exact ones, summed in fp32 in another order. The unpack
   works within 128-bit lanes, so an accumulator's lanes hold dims in a fixed shuffle,
   undone once at the end. hd a multiple of 32. Measured (Zen 4, the kernel alone, pools
   in cache): 0.92 -> 0.84 ms a step at 4 sequences of 300 positions, 12 layers. */
INLINE void values_pairs(rows_t vat, int n, int hoff, const uint32_t* pp, int64_t pstride,
                         uint16_t* out, int hd, const int NC, const int GJ) {
    __m512 lo[4][MAX_HEAD_DIM / 32], hi[4][MAX_HEAD_DIM / 32];   /* [GJ][NC] used */
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) lo[j][c] = hi[j][c] = _mm512_setzero_ps();
    rows_t ahead = vat;
    for (int i = 0; i < 48; i++) row_next(&ahead);
    for (int t = 0; t < n; t += 2) {
        const uint16_t* v0 = row_here(&vat) + hoff;
        row_next(&vat);
        const uint16_t* v1 = t + 1 < n ? row_here(&vat) + hoff : NULL;
        row_next(&vat);
        if (t + 48 < n) prefetch_row(row_here(&ahead) + hoff, hd, _MM_HINT_T0);
        row_next(&ahead);
        if (t + 49 < n) prefetch_row(row_here(&ahead) + hoff, hd, _MM_HINT_T0);
        row_next(&ahead);
        __m512bh w[4];
        for (int j = 0; j < GJ; j++) w[j] = (__m512bh)_mm512_set1_epi32((int)pp[j * pstride + t / 2]);
        for (int c = 0; c < NC; c++) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
            const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
            const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh h = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int j = 0; j < GJ; j++) {
                lo[j][c] = _mm512_dpbf16_ps(lo[j][c], l, w[j]);
                hi[j][c] = _mm512_dpbf16_ps(hi[j][c], h, w[j]);
            }
        }
    }
    /* lo's lanes 4L..4L+3 hold dims 8L..8L+3 of the chunk, hi's dims 8L+4..8L+7 */
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) {
            uint16_t* o = out + (int64_t)j * hd + 32 * c;
            store_bf16(o, _mm512_permutex2var_ps(lo[j][c], first16, hi[j][c]), 0xffff);
            store_bf16(o + 16, _mm512_permutex2var_ps(lo[j][c], next16, hi[j][c]), 0xffff);
        }
}
#endif

INLINE int decode(const uint16_t* q, const uint16_t* kpool, const uint16_t* vpool,
                  const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                  const int32_t* starts, int B, int H, int KVH, int bs, float scale,
                  float* scratch, int64_t scratch_elems, uint16_t* out, const int NV) {
    const int hd = 16 * NV, g = H / KVH;
    /* query heads per call of `values`: at most 16 accumulators */
    const int GJ = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
    const int64_t tok = (int64_t)KVH * hd; /* elements of one position's row */
    float qf[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int b = 0; b < B; b++) {
        const int c = ctx_lens[b], s0 = starts[b], n = c - s0;
        if (n < 1) return -1;
        if ((int64_t)H * n > scratch_elems) return -2;
        const int64_t* tab = tables + (int64_t)b * table_stride;
        const uint16_t* qb = q + (int64_t)b * H * hd;
#ifndef __AVX512BF16__
        for (int i = 0; i < H * hd; i++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)qb[i] << 16;
            qf[i] = v.f;
        }
#endif
        float* sc = scratch; /* [H][n] */
        /* scores, 16 positions at a time: one vector of 16 sums per query head */
        rows_t at = rows_from(kpool, tab, s0, bs, tok), ahead = at;
        for (int i = 0; i < 16 && s0 + i < c; i++) row_next(&ahead);
        for (int t0 = s0; t0 < c; t0 += 16) {
            const int nt = c - t0 < 16 ? c - t0 : 16;
            const uint16_t* rows[16];
            for (int i = 0; i < 16; i++) {
                rows[i] = row_here(&at);
                if (i + 1 < nt) row_next(&at);
            }
            row_next(&at);
            /* The next 16 positions' K and V into L2 (V for the values pass; the pools
               share a layout), a share of the lines before each head's scores: at once,
               256 prefetches (82m shape) wait for the core's few line-fill buffers and
               stall the work behind them; spread out they overlap it. Measured on the AMX
               machine, 82m shape, 300 positions, 12 layers' pools: 16.1 -> 14.5 ms at 32
               sequences, 2.7 -> 2.2 at 8 (bench/bench_attention_kernel.py). K went to L1
               then; into L2 it leaves L1's fill buffers to the loads, which find it there:
               on AMD EPYC (Zen 4) 13.2 -> 10.1 ms at 32 sequences (16 positions ahead is
               enough: 32 and 48 measured no better). */
            const char* pk[16];
            int npk = 0;
            for (int i = 0; i < 16 && t0 + 16 + i < c; i++, npk++) {
                pk[i] = (const char*)row_here(&ahead);
                row_next(&ahead);
            }
            const int64_t row_bytes = tok * 2, lines = npk * ((row_bytes + 63) / 64);
            int64_t sent = 0, pr = 0, off = 0;  /* lines sent; the next one's row, offset */
            for (int h = 0; h < H; h++) {
                for (const int64_t end = lines * (h + 1) / H; sent < end; sent++) {
                    _mm_prefetch(pk[pr] + off, _MM_HINT_T1);
                    _mm_prefetch((const char*)vpool + (pk[pr] - (const char*)kpool) + off, _MM_HINT_T1);
                    if ((off += 64) >= row_bytes) {
                        off = 0;
                        pr++;
                    }
                }
                const __m512 s = _mm512_mul_ps(
                    round_bf16(scores16(rows, (h / g) * hd, qb + h * hd, qf + h * hd, NV)),
                    _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(sc + (int64_t)h * n + (t0 - s0), first(nt), s);
            }
        }
#ifdef __AVX512BF16__
        const int pairs = NV % 2 == 0;
#else
        const int pairs = 0;
#endif
        softmax_rows(sc, H, n, pairs);
        if (b + 1 < B) {   /* the next sequence's first 16 positions, which nothing else
                              prefetches: 9.7 -> 9.0 ms at 32 sequences (Zen 4) */
            const int s1 = starts[b + 1], n1 = ctx_lens[b + 1] - s1;
            if (n1 > 0) {
                rows_t nx = rows_from(kpool, tables + (int64_t)(b + 1) * table_stride, s1, bs, tok);
                for (int i = 0; i < 16 && i < n1; i++, row_next(&nx)) {
                    const char* kr = (const char*)row_here(&nx);
                    prefetch_row(kr, tok, _MM_HINT_T1);
                    prefetch_row((const char*)vpool + (kr - (const char*)kpool), tok, _MM_HINT_T1);
                }
            }
        }
        /* values: GJ query heads of one KV head at a time */
        const rows_t vat = rows_from(vpool, tab, s0, bs, tok);
        for (int h = 0; h < KVH; h++)
            for (int j = 0; j < g; j += GJ) {
                const float* p = sc + (int64_t)(h * g + j) * n;
                uint16_t* o = out + ((int64_t)b * H + h * g + j) * hd;
#ifdef __AVX512BF16__
#define VALUES(R)                                                                           \
    if (pairs) values_pairs(vat, n, h * hd, (const uint32_t*)p, n, o, hd, NV / 2, R);      \
    else values(vat, n, h * hd, p, n, o, hd, NV, R);                                        \
    break;
#else
#define VALUES(R) values(vat, n, h * hd, p, n, o, hd, NV, R); break;
#endif
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
int paged_decode_bf16(const uint16_t* q, const uint16_t* kpool, const uint16_t* vpool,
                      const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                      const int32_t* starts, int B, int H, int KVH, int hd, int bs, float scale,
                      float* scratch, int64_t scratch_elems, uint16_t* out) {
    if (H > MAX_HEADS || hd > MAX_HEAD_DIM || hd % 16 || KVH < 1 || H % KVH || bs < 1) return -1;
#define CASE(NV) case NV: return decode(q, kpool, vpool, tables, table_stride, ctx_lens, \
                                        starts, B, H, KVH, bs, scale, scratch, scratch_elems, out, NV);
    switch (hd / 16) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
    }
#undef CASE
    return -1;
}
