/* layer_glue.c's four functions in fp32 with AVX2 and FMA, for a CPU without AVX-512 whose
   workers hold fp32 weights and KV: a residual add with the RMSNorm after it, RoPE on q and
   k with the step's K and V written into the paged pool, SwiGLU's silu(gate) * up, and
   Qwen3's per-head q/k norms.

   Why a kernel: there a decode step's elementwise work was ~15 torch ops a layer (an fp32
   RMSNorm alone is pow, mean, add, rsqrt and two multiplies), each a dispatch of a few
   microseconds; on the 82m model at 4 rows the norms, RoPE, the KV write, the activation
   and the adds were ~3.2 ms of a ~25 ms step (bench/bench_decode_step.py, an AMD EPYC
   Zen 4 core with AVX-512 hidden). And these are what decode_layers_f32.c calls, so a
   decode step runs every layer in one call.

   The numbers are torch's fp32 ops', each rounded once where torch rounds:
   - add_rms_norm: h = h + delta; x = (h * r) * w, r = 1 / sqrt(sum(h^2) / n + eps);
   - rope: x = fma(rotate_half(x), sin, x * cos): `mul_`, then `addcmul_`, which torch's
     fp32 CPU kernel runs as one FMA (checked bit for bit), the tables' rows as the model
     keeps them (sin's first half negated);
   - silu_mul: (g / (1 + exp(-g))) * u;
   - head_rms_norm: x = (x * r) * w per head.
   Only a sum's order (the norms' mean) and exp (Cephes', within ~1 ulp) differ.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec_math_avx2.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __m256 load(const float* p, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n));
}

INLINE void store(float* p, __m256 v, int64_t n) {
    if (n >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, lanes(n), v);
}

/* 1 / sqrt(sum of squares of p[0..n) / n + eps), the sum in 8 lanes then across them */
INLINE float inv_rms(const float* p, int64_t n, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = load(p + i, n - i);
        ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
    }
    return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(hsum8(ss) / (float)n + eps)));
}

/* h_out = h + delta (delta NULL: h_out = h, not written); x_out = rms_norm(h_out) * w.
   Rows are contiguous, n wide. */
void add_rms_norm_f32(const float* h, const float* delta, const float* w, int64_t rows,
                      int64_t n, float eps, float* h_out, float* x_out) {
    for (int64_t r = 0; r < rows; r++) {
        const float* a = h + r * n;
        const float* hr = a;
        if (delta) {
            float* o = h_out + r * n;
            for (int64_t i = 0; i < n; i += 8)
                store(o + i, _mm256_add_ps(load(a + i, n - i), load(delta + r * n + i, n - i)),
                      n - i);
            hr = o;
        }
        const __m256 rs = _mm256_set1_ps(inv_rms(hr, n, eps));
        for (int64_t i = 0; i < n; i += 8)
            store(x_out + r * n + i,
                  _mm256_mul_ps(_mm256_mul_ps(load(hr + i, n - i), rs), load(w + i, n - i)),
                  n - i);
    }
}

/* In place on heads [T][heads][hd] (token stride `ld` elements): each head's vector
   normalized over hd, as `layers.norm.head_rms_norm_` does in fp32. */
void head_rms_norm_f32(float* x, int64_t T, int64_t ld, int heads, int hd, const float* w,
                       float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float* p = x + t * ld + (int64_t)h * hd;
            const __m256 rs = _mm256_set1_ps(inv_rms(p, hd, eps));
            for (int i = 0; i < hd; i += 8)
                store(p + i, _mm256_mul_ps(_mm256_mul_ps(load(p + i, hd - i), rs),
                                           load(w + i, hd - i)), hd - i);
        }
}

/* In place on rows [T][heads][hd] (row stride `ld` elements): RoPE on the first `rotate`
   heads of each row, the cos/sin rows of each token's position from the model's tables
   [table_rows][hd]. Then, when kcache is given, heads rotate-kvh .. rotate-1 (K) and the
   kvh heads after them (V) are copied into kcache/vcache [cache_slots][kvh][hd] at slot
   slots[t]. Returns 0, or -1 (nothing written) for a position or slot out of range. */
int rope_kv_f32(float* x, int64_t T, int64_t ld, int rotate, int hd, const float* cos_t,
                const float* sin_t, const int64_t* pos, int64_t table_rows, int kvh,
                const int64_t* slots, float* kcache, float* vcache, int64_t cache_slots) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= table_rows || (kcache && (slots[t] < 0 || slots[t] >= cache_slots)))
            return -1;
    const int half = hd / 2;
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos_t + pos[t] * hd;
        const float* s = sin_t + pos[t] * hd;
        float* row = x + t * ld;
        for (int h = 0; h < rotate; h++) {
            float* p = row + (int64_t)h * hd;
            for (int i = 0; i < half; i += 8) {
                const int64_t m = half - i;
                const __m256 lo = load(p + i, m), hi = load(p + half + i, m);
                const __m256 a = _mm256_fmadd_ps(hi, load(s + i, m),
                                                 _mm256_mul_ps(lo, load(c + i, m)));
                const __m256 b = _mm256_fmadd_ps(lo, load(s + half + i, m),
                                                 _mm256_mul_ps(hi, load(c + half + i, m)));
                store(p + i, a, m);
                store(p + half + i, b, m);
            }
        }
        if (kcache) {
            const int64_t tok = (int64_t)kvh * hd;
            memcpy(kcache + slots[t] * tok, row + (int64_t)(rotate - kvh) * hd, tok * 4);
            memcpy(vcache + slots[t] * tok, row + (int64_t)rotate * hd, tok * 4);
        }
    }
    return 0;
}

/* out [rows][inter] = silu(gu[:, :inter]) * gu[:, inter:] */
void silu_mul_f32(const float* gu, int64_t rows, int64_t inter, float* out) {
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const int64_t m = inter - i;
            const __m256 v = load(g + i, m);
            const __m256 sv = _mm256_div_ps(
                v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
            store(out + r * inter + i, _mm256_mul_ps(sv, load(g + inter + i, m)), m);
        }
    }
}
