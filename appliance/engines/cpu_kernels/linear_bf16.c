/* y = x @ W^T (+ bias) in bf16 for the few rows of a decode step (AVX512-BF16).

   Why a kernel: at 1-8 rows a decode step's matmuls stream every weight once and do
   little arithmetic per byte, and oneDNN's packed bf16 linear reads the 82m model's
   weights at 12-16 GB/s on one core where a plain read runs at ~30. Here the weight is
   stored as pairs of input columns interleaved across 16 output rows, so one 64-byte load
   feeds one VDPBF16PS per input row, with no horizontal sums: the products and their
   fp32 sums are those oneDNN's bf16 kernel makes on the same instruction (equal results
   were measured at up to 8 rows; at more, a few outputs differ by one bf16 step).
   The weight is one contiguous stream in the order the kernel reads it, and the caller
   keeps it on transparent huge pages (`cpu_kernels.huge_page_empty`): measured on the
   82m model's weights at 5 rows, one core, 32 GB/s against 19 with 16-row blocks stored
   one after the other on 4 KB pages (~22 on huge pages). No software
   prefetch: the hardware's stream does better (one row 6.4 ms per step's layers without,
   7.4 ms prefetching 1 KB ahead, 7.8 ms at 8 KB).

   Layout: w [Npad/16][K/2][16][2] bf16 split in groups of NT blocks (the last group may
   hold fewer), each group stored [K/2][blocks in group][16][2]: the pairs of input
   columns of its 32 output rows, k-pair after k-pair. Npad = N rounded up to 16, padding
   rows zero; K even. x [M, ldx] bf16 (K columns used); bias [N] fp32 or NULL;
   y [M, ldy] bf16.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NT 2 /* 16-row weight blocks per tile */
#define MT 8 /* input rows per tile */

static inline __attribute__((always_inline)) void tile(const uint16_t* w, int64_t K2, int nblocks, const uint16_t* x, int64_t ldx,
                 int rows, const float* bias, int64_t n0, int64_t N, uint16_t* y, int64_t ldy) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K2; kp++) {
        __m512bh wv[NT];
        for (int j = 0; j < nblocks; j++) {
            const uint16_t* at = w + (kp * nblocks + j) * 32;
            wv[j] = (__m512bh)_mm512_loadu_si512(at);
        }
        for (int m = 0; m < rows; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nblocks; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
        }
    }
    for (int j = 0; j < nblocks; j++) {
        const int64_t n = n0 + 16 * j;
        const __mmask16 keep = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
            _mm256_mask_storeu_epi16(y + m * ldy + n, keep, (__m256i)out);
        }
    }
}

/* Returns 0, or -1 for an odd K. */
int linear_bf16(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                int64_t ldx, const float* bias, uint16_t* y, int64_t ldy) {
    if (K % 2) return -1;
    const int64_t K2 = K / 2, blocks = (N + 15) / 16;
    for (int64_t nb = 0; nb < blocks; nb += NT) {
        const int nblocks = blocks - nb < NT ? (int)(blocks - nb) : NT;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int rows = M - m0 < MT ? (int)(M - m0) : MT;
            const uint16_t* wt = w + nb * K2 * 32;
            const uint16_t* xt = x + m0 * ldx;
            uint16_t* yt = y + m0 * ldy;
            /* a constant row count per case, so the accumulators stay in registers */
#define TILE(R) tile(wt, K2, nblocks, xt, ldx, R, bias, nb * 16, N, yt, ldy); break;
            switch (rows) {
            case 1: TILE(1) case 2: TILE(2) case 3: TILE(3) case 4: TILE(4)
            case 5: TILE(5) case 6: TILE(6) case 7: TILE(7) default: TILE(8)
            }
#undef TILE
        }
    }
    return 0;
}
