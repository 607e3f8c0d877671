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

static inline __m512 load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16 -> fp32, round to nearest even (as torch's cast of finite values) */
static inline __m512 round_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline uint16_t to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    v.u += 0x7fff + ((v.u >> 16) & 1);
    return (uint16_t)(v.u >> 16);
}

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

static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* each row of sc ([rows][n]) -> bf16(softmax(row)) */
static void softmax_rows(float* sc, int rows, int n) {
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
        for (int i = 0; i < n; i += 16)
            _mm512_mask_storeu_ps(r + i, first(n - i),
                                  round_bf16(_mm512_div_ps(_mm512_maskz_loadu_ps(first(n - i), r + i), sum)));
    }
}

static inline const uint16_t* row_at(const uint16_t* pool, const int64_t* tab, int t, int bs,
                                     int64_t tok) {
    return pool + (tab[t / bs] * bs + t % bs) * tok;
}

static inline void prefetch_row(const uint16_t* row, int64_t elems) {
    for (int64_t b = 0; b < elems * 2; b += 64) _mm_prefetch((const char*)row + b, _MM_HINT_T0);
}

/* Returns 0; -1 when the shape is outside this kernel (the caller uses torch's path);
   -2 when `scratch` (heads x longest span floats) is too small. */
int paged_decode_bf16(const uint16_t* q, const uint16_t* kpool, const uint16_t* vpool,
                      const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                      const int32_t* starts, int B, int H, int KVH, int hd, int bs, float scale,
                      float* scratch, int64_t scratch_elems, uint16_t* out) {
    if (H > MAX_HEADS || hd > MAX_HEAD_DIM || hd % 16 || KVH < 1 || H % KVH || bs < 1) return -1;
    const int g = H / KVH, nv = hd / 16;
    const int64_t tok = (int64_t)KVH * hd; /* elements of one position's row */
    float qf[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int b = 0; b < B; b++) {
        const int c = ctx_lens[b], s0 = starts[b], n = c - s0;
        if (n < 1) return -1;
        if ((int64_t)H * n > scratch_elems) return -2;
        const int64_t* tab = tables + (int64_t)b * table_stride;
        for (int i = 0; i < H * hd; i++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)q[(int64_t)b * H * hd + i] << 16;
            qf[i] = v.f;
        }
        float* sc = scratch; /* [H][n] */
        /* scores, 16 positions at a time: one vector of 16 sums per query head */
        for (int t0 = s0; t0 < c; t0 += 16) {
            const int nt = c - t0 < 16 ? c - t0 : 16;
            const uint16_t* rows[16];
            for (int i = 0; i < 16; i++) rows[i] = row_at(kpool, tab, t0 + (i < nt ? i : 0), bs, tok);
            for (int i = 0; i < 16 && t0 + 16 + i < c; i++)
                prefetch_row(row_at(kpool, tab, t0 + 16 + i, bs, tok), tok);
            for (int h = 0; h < KVH; h++) {
                for (int j = 0; j < g; j++) {
                    const float* qq = qf + (h * g + j) * hd;
                    __m512 part[16];
                    for (int i = 0; i < 16; i++) {
                        const uint16_t* kr = rows[i] + h * hd;
                        __m512 a = _mm512_mul_ps(_mm512_load_ps(qq), load_bf16(kr));
                        for (int v = 1; v < nv; v++)
                            a = _mm512_fmadd_ps(_mm512_load_ps(qq + 16 * v), load_bf16(kr + 16 * v), a);
                        part[i] = a;
                    }
                    __m512 s = _mm512_mul_ps(round_bf16(sums_of_16(part)), _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(sc + (int64_t)(h * g + j) * n + (t0 - s0), first(nt), s);
                }
            }
        }
        softmax_rows(sc, H, n);
        /* values: up to 4 query heads of one KV head at a time, accumulated in fp32 */
        for (int h = 0; h < KVH; h++) {
            for (int j0 = 0; j0 < g; j0 += 4) {
                const int gj = g - j0 < 4 ? g - j0 : 4;
                __m512 acc[4][MAX_HEAD_DIM / 16];
                for (int j = 0; j < gj; j++)
                    for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
                for (int t = s0; t < c; t++) {
                    const uint16_t* vr = row_at(vpool, tab, t, bs, tok) + h * hd;
                    if (t + 8 < c) prefetch_row(row_at(vpool, tab, t + 8, bs, tok) + h * hd, hd);
                    for (int v = 0; v < nv; v++) {
                        const __m512 x = load_bf16(vr + 16 * v);
                        for (int j = 0; j < gj; j++)
                            acc[j][v] = _mm512_fmadd_ps(
                                _mm512_set1_ps(sc[(int64_t)(h * g + j0 + j) * n + (t - s0)]), x,
                                acc[j][v]);
                    }
                }
                for (int j = 0; j < gj; j++) {
                    float tmp[MAX_HEAD_DIM] __attribute__((aligned(64)));
                    for (int v = 0; v < nv; v++) _mm512_store_ps(tmp + 16 * v, acc[j][v]);
                    uint16_t* o = out + ((int64_t)b * H + h * g + j0 + j) * hd;
                    for (int d = 0; d < hd; d++) o[d] = to_bf16(tmp[d]);
                }
            }
        }
    }
    return 0;
}
