/* A prompt's causal self-attention on the CPU in fp32 (AVX2 and FMA): causal_prefill.c's
   job for a CPU without AVX-512, whose workers hold fp32 weights and KV.

   Why a kernel: torch's fp32 CPU SDPA (the flash kernel) computes every score of a
   256-token prompt, the masked half too (its key blocks are longer than the prompt), at
   ~45 GFLOPS: ~54 ms of a ~650 ms prompt on the 82m model (12 layers, 12 heads of 64 over
   4 KV heads), measured on an AMD EPYC Zen 4 core with AVX-512 hidden. Here only the
   scores a row sees are computed (to a block of 16 keys), at the core's FMA rate.

   Per KV head, K is packed once per call into panels of 16 keys ([n/16][hd][16]) and V
   into dense rows ([n][hd]), in the scratch; every query head of the group reads them.
   Queries go 6 rows at a time: scores as a tile of 6 rows by 16 keys (12 accumulators,
   per head dimension two loads of the panel's line and a broadcast of each row's q), the
   row's softmax over its keys 0..p, then the output as tiles of 6 rows by 16 head
   dimensions over the keys (the same shape, V's row in place of the panel's line).

   The numbers are SDPA's in fp32: scores = (q . k) * scale, softmax (the row's maximum
   subtracted, exp, divided by the sum at the end), out = sum p * v, all in fp32; only the
   order of the sums and exp differ (exp: Cephes', within ~1 ulp of expf).

   q [n, heads, hd] with rows `q_row` elements apart, k and v [n, kv_heads, hd] with rows
   `kv_row` apart (head and element strides dense); out [n, heads, hd] contiguous; the
   scratch `causal_prefill_f32_scratch(n, hd)` bytes. hd a multiple of 16, at most 256.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math_avx2.h"

#define RQ 6 /* query rows a tile */
#define MAX_HEAD_DIM 256
#define INLINE static inline __attribute__((always_inline))

static inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

/* bytes of scratch a call of n tokens and head size hd needs */
int64_t causal_prefill_f32_scratch(int64_t n, int hd) {
    const int64_t n16 = up16(n);
    return (n16 * hd + n * hd + RQ * n16) * 4 + 64;
}

/* kt [n16/16][hd][16]: kt[p][d][c] = k[16p + c][d], zeros past n; vt [n][hd] dense */
static void pack(const float* k, const float* v, int64_t kv_row, int64_t n, int hd, float* kt,
                 float* vt) {
    const int64_t panels = up16(n) / 16;
    for (int64_t p = 0; p < panels; p++) {
        float* dst = kt + p * hd * 16;
        for (int c = 0; c < 16; c++) {
            const int64_t j = p * 16 + c;
            if (j < n) {
                const float* src = k + j * kv_row;
                for (int d = 0; d < hd; d++) dst[d * 16 + c] = src[d];
            } else {
                for (int d = 0; d < hd; d++) dst[d * 16 + c] = 0.0f;
            }
        }
    }
    for (int64_t j = 0; j < n; j++) memcpy(vt + j * hd, v + j * kv_row, (size_t)hd * 4);
}

/* s[r][0..16) = (q_r . k) * scale for the 16 keys of one panel, 6 rows (rows[] may repeat
   the last real row) */
INLINE void score_tile(const float* panel, int hd, const float* const* rows, float scale,
                       float* s, int64_t n16) {
    __m256 acc[RQ][2];
    for (int r = 0; r < RQ; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m256 k0 = _mm256_loadu_ps(panel + d * 16), k1 = _mm256_loadu_ps(panel + d * 16 + 8);
        __asm__("" : "+x"(k0), "+x"(k1)); /* in registers, not folded into each FMA */
        for (int r = 0; r < RQ; r++) {
            const __m256 b = _mm256_broadcast_ss(rows[r] + d);
            acc[r][0] = _mm256_fmadd_ps(b, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, k1, acc[r][1]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int r = 0; r < RQ; r++) {
        _mm256_storeu_ps(s + r * n16, _mm256_mul_ps(acc[r][0], sc));
        _mm256_storeu_ps(s + r * n16 + 8, _mm256_mul_ps(acc[r][1], sc));
    }
}

/* row s[0..len) -> exp(s - max) for j < keep, 0 for keep <= j < len; returns the sum */
static float softmax_row(float* s, int64_t keep, int64_t len) {
    const __m256 m = _mm256_set1_ps(row_max(s, keep));
    __m256 tot = _mm256_setzero_ps();
    int64_t j;
    for (j = 0; j < keep; j += 8) {
        const __m256i in = lanes(keep - j);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m)),
                                       _mm256_castsi256_ps(in));
        _mm256_storeu_ps(s + j, e);    /* lanes past keep: 0, inside the row's scratch */
        tot = _mm256_add_ps(tot, e);
    }
    for (; j < len; j += 8) _mm256_storeu_ps(s + j, _mm256_setzero_ps());
    return hsum8(tot);
}

/* out rows[r][0..16) = sum over keys j < len of p[r][j] * vt[j][0..16) / sums[r] */
INLINE void value_tile(const float* vt, int hd, const float* p, int64_t n16, int64_t len,
                       float* const* outs, const float* sums) {
    __m256 acc[RQ][2];
    for (int r = 0; r < RQ; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        __m256 x0 = _mm256_loadu_ps(vt + j * hd), x1 = _mm256_loadu_ps(vt + j * hd + 8);
        __asm__("" : "+x"(x0), "+x"(x1));
        for (int r = 0; r < RQ; r++) {
            const __m256 b = _mm256_broadcast_ss(p + r * n16 + j);
            acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
        }
    }
    for (int r = 0; r < RQ; r++) {
        const __m256 sum = _mm256_set1_ps(sums[r]);
        _mm256_storeu_ps(outs[r], _mm256_div_ps(acc[r][0], sum));
        _mm256_storeu_ps(outs[r] + 8, _mm256_div_ps(acc[r][1], sum));
    }
}

/* Returns 0, or -1 for a shape outside this kernel (the caller uses SDPA). */
int causal_prefill_f32(const float* q, int64_t q_row, const float* k, const float* v,
                       int64_t kv_row, int64_t n, int H, int KVH, int hd, float scale,
                       void* scratch, float* out) {
    if (n < 1 || hd < 16 || hd > MAX_HEAD_DIM || hd % 16 || KVH < 1 || H % KVH) return -1;
    const int g = H / KVH;
    const int64_t n16 = up16(n);
    float* kt = (float*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float* vt = kt + n16 * hd;
    float* s = vt + n * hd; /* [RQ][n16] */
    float junk[MAX_HEAD_DIM]; /* where the rows past n write */
    for (int kvh = 0; kvh < KVH; kvh++) {
        pack(k + (int64_t)kvh * hd, v + (int64_t)kvh * hd, kv_row, n, hd, kt, vt);
        for (int h = kvh * g; h < (kvh + 1) * g; h++) {
            for (int64_t r0 = 0; r0 < n; r0 += RQ) {
                const int real = n - r0 < RQ ? (int)(n - r0) : RQ;
                const int64_t len = r0 + real; /* keys any row of the tile sees */
                const float* rows[RQ];
                float* outs[RQ];
                for (int r = 0; r < RQ; r++) {
                    const int64_t i = r < real ? r0 + r : r0 + real - 1;
                    rows[r] = q + i * q_row + (int64_t)h * hd;
                    outs[r] = r < real ? out + (i * H + h) * hd : junk;
                }
                for (int64_t p = 0; p * 16 < len; p++)
                    score_tile(kt + p * hd * 16, hd, rows, scale, s + p * 16, n16);
                float sums[RQ];
                for (int r = 0; r < RQ; r++)
                    sums[r] = softmax_row(s + r * n16, r < real ? r0 + r + 1 : 1, up16(len));
                for (int d = 0; d < hd; d += 16) {
                    float* at[RQ];
                    for (int r = 0; r < RQ; r++) at[r] = outs[r] + (outs[r] == junk ? 0 : d);
                    value_tile(vt + d, hd, s, n16, len, at, sums);
                }
            }
        }
    }
    return 0;
}
