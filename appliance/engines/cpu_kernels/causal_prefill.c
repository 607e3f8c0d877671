/* A prompt's causal self-attention on the CPU, in bf16 (AVX512-BF16; AMX where built
   and granted).

   Why a kernel: torch's CPU SDPA runs a 256-token prompt's attention at ~35 GFLOPS in
   bf16 (3.4 ms a layer for 12 heads of 64 on the 82m model, 15% of a prefill step), and
   its math path is no faster. Here both products run on VDPBF16PS at full width: K is
   laid out once per call as pairs of head dimensions across 16 keys (one load feeds eight
   query rows), V as pairs of keys across 16 head dimensions (one load feeds four rows).
   Those two layouts are also AMX's B tiles as they stand, and on a CPU with AMX both
   products run on TDPBF16PS instead (head_dim a multiple of 32; see the AMX section).

   Numbers as torch's CPU flash SDPA makes them in bf16, which the engine used before and
   which keeps greedy tokens with transformers where eager-style rounding of the scores
   did not (measured on the default tiny model): scores q . k * scale in fp32, the row's
   exps over keys 0..p (its own maximum subtracted) rounded to bf16 as probabilities,
   output = bf16(sum p * v / sum of the exps), accumulated in fp32. Measured against
   SDPA: 88-96% of outputs equal, the rest one bf16 step apart, and the same error to an
   fp32 reference.

   q [n, heads, hd] with rows `q_row` elements apart, k and v [n, kv_heads, hd] with rows
   `kv_row` apart (head and element strides dense); out [n, heads, hd] contiguous. The
   scratch holds both layouts of one KV head and one tile's scores and probabilities:
   `causal_prefill_scratch` bytes.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vec_math.h"

#define RQ 8 /* query rows per score tile */
#define RV 4 /* query rows per value tile */
#define MAX_HEAD_DIM 256

static inline int64_t up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static inline __attribute__((always_inline)) void score_tile(
        const uint16_t* kt, int hp, const uint16_t* qt, int64_t q_row, int rows, float scale,
        float* sc, int64_t n16) {
    __m512 acc[RQ];
    for (int r = 0; r < RQ; r++) acc[r] = _mm512_setzero_ps();
    for (int dp = 0; dp < hp; dp++) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + dp * 32);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, qt + r * q_row + 2 * dp, 4);
            acc[r] = _mm512_dpbf16_ps(acc[r], kv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(sc + r * n16, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}

static inline __attribute__((always_inline)) void value_tile(
        const uint16_t* vp, int hd, int nv, int64_t pairs, const uint16_t* pt, int64_t n16,
        int rows, const float* inv, uint16_t* o, int64_t o_row) {
    __m512 acc[RV][MAX_HEAD_DIM / 16];
    for (int r = 0; r < RV; r++)
        for (int d = 0; d < nv; d++) acc[r][d] = _mm512_setzero_ps();
    for (int64_t tp = 0; tp < pairs; tp++) {
        __m512bh p[RV];
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, pt + r * n16 + 2 * tp, 4);
            p[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int d = 0; d < nv; d++) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(vp + tp * hd * 2 + d * 32);
            for (int r = 0; r < rows; r++) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], x, p[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < nv; d++)
            _mm256_storeu_si256((__m256i*)(o + r * o_row + 16 * d),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(acc[r][d], _mm512_set1_ps(inv[r]))));
}

#define RA 16 /* query rows per tile on the AMX path */

/* Bytes of scratch `causal_prefill_bf16` needs for a prompt of n tokens (either path:
   the AMX path's K and V run to a multiple of 32 keys, its tiles have 16 rows). */
int64_t causal_prefill_scratch(int64_t n, int hd) {
    const int64_t n32 = up(n, 32);
    return 2 * n32 * hd * 2                 /* K and V of one KV head, re-laid out */
           + (int64_t)RA * n32 * 4          /* a tile's fp32 scores */
           + (int64_t)RA * n32 * 2          /* its bf16 probabilities */
           + (int64_t)RA * MAX_HEAD_DIM * 2 /* a last tile's query rows, padded */
           + 4 * 1024 + 128;                /* C tiles stored; alignment */
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- Both products on AMX's tiles (Sapphire Rapids and later) ----

   Why: there VDPBF16PS issues once every 2 cycles, so the path below runs at ~16
   multiply-adds a cycle, and a 256-token prompt's attention took 20 ms of an 89 ms
   prefill step on the 82m model (measured on such a core). A TDPBF16PS multiplies 16
   query rows by 16 keys over 32 head dimensions at once. The layouts are the ones the
   path below builds: K's pairs of head dimensions across 16 keys are a B tile as they
   stand (16 pairs a tile), and so are V's pairs of keys across 16 head dimensions. The
   numbers are those of the path below: fp32 sums of the same exact products (in another
   order), the same softmax and rounding. Tiles: C 0-3, A 4, B 5-6. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_PATH 1

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux hands AMX's tile state to a process only when asked; asking twice is harmless */
static int amx_granted(void) {
    if (!amx_state)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

/* every tile 16 rows of 64 bytes; configured on entry and released on return, since
   other code on this thread (oneDNN, the matmul kernel) configures its own */
static void amx_configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* C tile t (0-3) += A (4) x B tile b (5 or 6); t, b variables */
static inline void amx_dp(int t, int b) {
    switch (t * 2 + (b == 6)) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(0, 4, 6); break;
    case 2: _tile_dpbf16ps(1, 4, 5); break;
    case 3: _tile_dpbf16ps(1, 4, 6); break;
    case 4: _tile_dpbf16ps(2, 4, 5); break;
    case 5: _tile_dpbf16ps(2, 4, 6); break;
    case 6: _tile_dpbf16ps(3, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 6); break;
    }
}

static inline void amx_zero(int t) {
    switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
    }
}

static inline void amx_store(int t, float* dst, int64_t stride) {
    switch (t) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
    }
}

static inline void amx_load_b(int b, const void* src, int64_t stride) {
    if (b == 5) _tile_loadd(5, src, stride);
    else _tile_loadd(6, src, stride);
}

/* One query head's rows r0 .. r0+rows-1 (rows <= 16) against keys 0 .. r0+rows-1:
   kp, vp: the KV head's two layouts (zero past n, to a multiple of 32 keys). */
static void amx_tile(const uint16_t* kp, const uint16_t* vp, const uint16_t* qt, int64_t q_row,
                     int64_t r0, int rows, int hd, float scale, float* sc, uint16_t* pr,
                     int64_t n32, uint16_t* qpad, float* cbuf, uint16_t* o, int64_t o_row) {
    const int64_t keys = r0 + rows;
    /* A tiles read 16 query rows: a last, shorter tile's rows go through a zeroed copy */
    const uint16_t* a = qt;
    int64_t a_row = q_row;
    if (rows < RA) {
        memset(qpad, 0, (size_t)RA * hd * 2);
        for (int r = 0; r < rows; r++) memcpy(qpad + r * hd, qt + r * q_row, (size_t)hd * 2);
        a = qpad;
        a_row = hd;
    }
    /* scores: up to 4 blocks of 16 keys at once (one C tile each), one A tile per 32
       head dimensions shared by them */
    for (int64_t kb = 0; kb < keys; kb += 64) {
        const int nb = (int)((keys - kb + 15) / 16 < 4 ? (keys - kb + 15) / 16 : 4);
        for (int t = 0; t < nb; t++) amx_zero(t);
        for (int dt = 0; dt < hd / 32; dt++) {
            _tile_loadd(4, a + 32 * dt, a_row * 2);
            for (int t = 0; t < nb; t++) {
                const int b = 5 + (t & 1);
                amx_load_b(b, kp + ((kb / 16 + t) * hd + dt * 32) * 16, 64);
                amx_dp(t, b);
            }
        }
        for (int t = 0; t < nb; t++) amx_store(t, sc + kb + 16 * t, n32 * 4);
    }
    /* each row's exps over keys 0..p as bf16 probabilities, zero to the 32-key block */
    float inv[RA];
    const int64_t k32 = up(keys, 32);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const int64_t seen = r0 + r + 1;
        float* row = sc + r * n32;
        uint16_t* prow = pr + r * n32;
        __m512 m = _mm512_set1_ps(-INFINITY), tot = _mm512_setzero_ps();
        for (int64_t i = 0; i < seen; i += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + i), sv);
            _mm512_storeu_ps(row + i, x);
            m = _mm512_mask_max_ps(m, first(seen - i), m, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for (int64_t i = 0; i < seen; i += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mx));
            e = _mm512_maskz_mov_ps(first(seen - i), e);
            _mm512_storeu_ps(row + i, e);
            tot = _mm512_add_ps(tot, e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(tot);
        for (int64_t i = 0; i < k32; i += 16) {
            __m512 p = i < seen ? _mm512_loadu_ps(row + i) : _mm512_setzero_ps();
            p = _mm512_maskz_mov_ps(first(seen - i), p);
            _mm256_storeu_si256((__m256i*)(prow + i), (__m256i)_mm512_cvtneps_pbh(p));
        }
    }
    for (int r = rows; r < RA; r++) memset(pr + r * n32, 0, (size_t)k32 * 2);
    /* values: 16 head dimensions a C tile, up to 4 at once; 32 keys (16 pairs) a step */
    for (int d0 = 0; d0 < hd; d0 += 64) {
        const int nd = (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
        for (int t = 0; t < nd; t++) amx_zero(t);
        for (int64_t kb = 0; kb < k32; kb += 32) {
            _tile_loadd(4, pr + kb, n32 * 2);
            for (int t = 0; t < nd; t++) {
                const int b = 5 + (t & 1);
                amx_load_b(b, vp + (kb / 2) * hd * 2 + (d0 + 16 * t) * 2, (int64_t)hd * 4);
                amx_dp(t, b);
            }
        }
        for (int t = 0; t < nd; t++) {
            amx_store(t, cbuf, 64);
            for (int r = 0; r < rows; r++)
                _mm256_storeu_si256((__m256i*)(o + r * o_row + d0 + 16 * t),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                        _mm512_loadu_ps(cbuf + 16 * r), _mm512_set1_ps(inv[r]))));
        }
    }
}
#endif

/* Returns 0; -1 when the shape is outside the kernel. */
int causal_prefill_bf16(const uint16_t* q, int64_t q_row, const uint16_t* k, const uint16_t* v,
                        int64_t kv_row, int64_t n, int H, int KVH, int hd, float scale,
                        uint8_t* scratch, uint16_t* out) {
    if (hd % 16 || hd > MAX_HEAD_DIM || KVH < 1 || H % KVH || n < 1) return -1;
    const int g = H / KVH, hp = hd / 2, nv = hd / 16;
#ifdef AMX_PATH
    const int amx = hd % 32 == 0 && amx_granted();
#endif
    /* keys to a multiple of 16 (32 on the AMX path, whose value tiles take 32 keys) */
    const int64_t n16 = up(n, 32);
    scratch = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t* kp = (uint16_t*)scratch;                  /* [n16/16][hp][16][2] */
    uint16_t* vp = kp + n16 * hd;                       /* [n16/2][hd][2] */
    float* sc = (float*)(vp + n16 * hd);                /* [RA][n16] */
    uint16_t* pr = (uint16_t*)(sc + (int64_t)RA * n16); /* [RA][n16] bf16 */
    uint16_t* qpad = pr + (int64_t)RA * n16;            /* [RA][hd] */
    float* cbuf = (float*)(qpad + RA * MAX_HEAD_DIM);   /* [16][16] */
    (void)qpad; (void)cbuf;
#ifdef AMX_PATH
    if (amx) amx_configure();
#endif
    for (int h = 0; h < KVH; h++) {
        /* this KV head's K and V in the two layouts (zero past n) */
        memset(kp, 0, (size_t)n16 * hd * 2 * 2);
        for (int64_t t = 0; t < n; t++) {
            const uint16_t* kr = k + t * kv_row + (int64_t)h * hd;
            const uint16_t* vr = v + t * kv_row + (int64_t)h * hd;
            uint16_t* kb = kp + (t / 16) * hd * 16 + (t % 16) * 2;
            uint16_t* vb = vp + (t / 2) * hd * 2 + (t % 2);
            for (int dp = 0; dp < hp; dp++) {
                kb[dp * 32] = kr[2 * dp];
                kb[dp * 32 + 1] = kr[2 * dp + 1];
            }
            for (int d = 0; d < hd; d++) vb[d * 2] = vr[d];
        }
#ifdef AMX_PATH
        if (amx) {
            for (int j = 0; j < g; j++) {
                const int hq = h * g + j;
                for (int64_t r0 = 0; r0 < n; r0 += RA)
                    amx_tile(kp, vp, q + r0 * q_row + (int64_t)hq * hd, q_row, r0,
                             n - r0 < RA ? (int)(n - r0) : RA, hd, scale, sc, pr, n16, qpad,
                             cbuf, out + (r0 * (int64_t)H + hq) * hd, (int64_t)H * hd);
            }
            continue;
        }
#endif
        for (int j = 0; j < g; j++) {
            const int hq = h * g + j;
            for (int64_t r0 = 0; r0 < n; r0 += RQ) {
                const int rows = n - r0 < RQ ? (int)(n - r0) : RQ;
                const int64_t keys = r0 + rows; /* the tile's last row sees keys 0..keys-1 */
                /* scores: RQ rows x 16 keys per step, one K load per head-dim pair */
                const uint16_t* qt = q + r0 * q_row + (int64_t)hq * hd;
                for (int64_t kb = 0; kb < keys; kb += 16) {
                    const uint16_t* kt = kp + (kb / 16) * hd * 16;
#define SCORES(R) score_tile(kt, hp, qt, q_row, R, scale, sc + kb, n16); break;
                    switch (rows) {
                    case 1: SCORES(1) case 2: SCORES(2) case 3: SCORES(3) case 4: SCORES(4)
                    case 5: SCORES(5) case 6: SCORES(6) case 7: SCORES(7) default: SCORES(8)
                    }
#undef SCORES
                }
                /* each row's exps over keys 0..p as bf16 probabilities (zero past p), 1/sum kept */
                float inv[RQ];
                for (int r = 0; r < rows; r++) {
                    const int64_t seen = r0 + r + 1;
                    float* row = sc + r * n16;
                    uint16_t* prow = pr + r * n16;
                    __m512 m = _mm512_set1_ps(-INFINITY), tot = _mm512_setzero_ps();
                    for (int64_t i = 0; i < seen; i += 16)
                        m = _mm512_mask_max_ps(m, first(seen - i), m, _mm512_loadu_ps(row + i));
                    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
                    for (int64_t i = 0; i < seen; i += 16) {
                        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mx));
                        e = _mm512_maskz_mov_ps(first(seen - i), e);
                        _mm512_storeu_ps(row + i, e);
                        tot = _mm512_add_ps(tot, e);
                    }
                    inv[r] = 1.0f / _mm512_reduce_add_ps(tot);
                    for (int64_t i = 0; i < up(keys, 16); i += 16) {
                        __m512 p = i < seen ? _mm512_loadu_ps(row + i) : _mm512_setzero_ps();
                        p = _mm512_maskz_mov_ps(first(seen - i), p);
                        _mm256_storeu_si256((__m256i*)(prow + i), (__m256i)_mm512_cvtneps_pbh(p));
                    }
                }
                /* values: RV rows x head_dim per step, one V load per key pair and 16 dims */
                for (int r0v = 0; r0v < rows; r0v += RV) {
                    const int rv = rows - r0v < RV ? rows - r0v : RV;
                    const int64_t pairs = (r0 + r0v + rv + 1) / 2; /* keys the rows see, in pairs */
                    uint16_t* o = out + ((r0 + r0v) * (int64_t)H + hq) * hd;
                    const uint16_t* pt = pr + r0v * n16;
#define VALUES(R) value_tile(vp, hd, nv, pairs, pt, n16, R, inv + r0v, o, (int64_t)H * hd); break;
                    switch (rv) {
                    case 1: VALUES(1) case 2: VALUES(2) case 3: VALUES(3) default: VALUES(4)
                    }
#undef VALUES
                }
            }
        }
    }
#ifdef AMX_PATH
    if (amx) _tile_release();
#endif
    return 0;
}

/* whether prompts with this head_dim run on AMX's tiles here (for tests) */
int causal_prefill_amx(int hd) {
#ifdef AMX_PATH
    return hd % 32 == 0 && amx_granted();
#else
    (void)hd;
    return 0;
#endif
}
