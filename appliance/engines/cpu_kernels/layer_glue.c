/* The elementwise work between a step's matmuls, in bf16 (AVX-512F): a residual add with
   the RMSNorm after it, RoPE on q and k with the step's K and V written into the paged
   pool, SwiGLU's silu(gate) * up, and Qwen3's per-head q/k norms.

   Why a kernel: at a decode step's few rows each of these is a handful of torch ops (an
   RMSNorm in bf16 is some thirteen: casts, pow, mean, rsqrt, two multiplies...), each a
   dispatch of a few microseconds over a few kilobytes; on the 82m model they were ~1.2 ms
   of an ~11 ms step at 5 rows (bench/bench_decode_step.py). One call here does each. A
   prompt's rows pass over memory once instead of once per op.

   The numbers are torch's: every value is rounded to bf16 where torch's bf16 ops round
   (checked element for element against them in tests/integration/test_cpu_kernels.py):
   - add_rms_norm: h = bf16(h + delta); x = bf16((h * r) * w) in fp32, with
     r = 1 / sqrt(sum(h^2) / n + eps) (F.rms_norm's composite on the CPU: one rounding);
   - rope: x = bf16(bf16(x * cos) + rotate_half(x) * sin) (`mul_` then `addcmul_`), with
     the tables' rows as the model keeps them (sin's first half negated);
   - silu_mul: bf16(bf16(g / (1 + exp(-g))) * u) (`silu` then `mul_`);
   - head_rms_norm: x = bf16(w * bf16(x * r)) per head (Qwen3's q/k norms,
     `layers.norm.head_rms_norm_`: normalized in fp32, cast, then scaled).
   Only a sum's order (the norm's mean) and exp (Cephes', within ~1 ulp) can differ.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* h_out = h + delta (delta NULL: h_out = h, not written); x_out = rms_norm(h_out) * w.
   Rows are contiguous, n wide. */
void add_rms_norm_bf16(const uint16_t* h, const uint16_t* delta, const uint16_t* w,
                       int64_t rows, int64_t n, float eps, uint16_t* h_out, uint16_t* x_out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* a = h + r * n;
        uint16_t* hr = delta ? h_out + r * n : (uint16_t*)a;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            __m512 v = load_bf16_mask(a + i, m);
            if (delta) {
                v = round_bf16(_mm512_add_ps(v, load_bf16_mask(delta + r * n + i, m)));
                store_bf16(hr + i, v, m);
            }
            ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
        }
        const float var = _mm512_reduce_add_ps(ss) / (float)n;
        const __m512 rs = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(var + eps))));
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load_bf16_mask(hr + i, m), rs), load_bf16_mask(w + i, m));
            store_bf16(x_out + r * n + i, y, m);
        }
    }
}

/* In place on heads [T][heads][hd] (token stride `ld` elements): each head's vector
   normalized over hd, as `layers.norm.head_rms_norm_` does in bf16. */
void head_rms_norm_bf16(uint16_t* x, int64_t T, int64_t ld, int heads, int hd, const uint16_t* w,
                        float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            uint16_t* p = x + t * ld + (int64_t)h * hd;
            __m512 ss = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) {
                const __m512 v = load_bf16_mask(p + i, first(hd - i));
                ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
            }
            const float var = _mm512_reduce_add_ps(ss) / (float)hd;
            const __m512 rs = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(var + eps))));
            for (int i = 0; i < hd; i += 16) {
                const __mmask16 m = first(hd - i);
                const __m512 n = round_bf16(_mm512_mul_ps(load_bf16_mask(p + i, m), rs));
                store_bf16(p + i, _mm512_mul_ps(load_bf16_mask(w + i, m), n), m);
            }
        }
}

/* In place on rows [T][heads][hd] (row stride `ld` elements): RoPE on the first `rotate`
   heads of each row, the cos/sin rows of each token's position from the model's tables
   [table_rows][hd]. Then, when kcache is given, heads rotate-kvh .. rotate-1 (K) and the
   kvh heads after them (V) are copied into kcache/vcache [cache_slots][kvh][hd] at slot
   slots[t]. Returns 0, or -1 (nothing written) for a position or slot out of range. */
int rope_kv_bf16(uint16_t* x, int64_t T, int64_t ld, int rotate, int hd, const uint16_t* cos_t,
                 const uint16_t* sin_t, const int64_t* pos, int64_t table_rows, int kvh,
                 const int64_t* slots, uint16_t* kcache, uint16_t* vcache, int64_t cache_slots) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= table_rows || (kcache && (slots[t] < 0 || slots[t] >= cache_slots)))
            return -1;
    const int half = hd / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* c = cos_t + pos[t] * hd;
        const uint16_t* s = sin_t + pos[t] * hd;
        uint16_t* row = x + t * ld;
        for (int h = 0; h < rotate; h++) {
            uint16_t* p = row + (int64_t)h * hd;
            for (int i = 0; i < half; i += 16) {
                const __mmask16 m = first(half - i);
                const __m512 lo = load_bf16_mask(p + i, m), hi = load_bf16_mask(p + half + i, m);
                const __m512 a = _mm512_add_ps(round_bf16(_mm512_mul_ps(lo, load_bf16_mask(c + i, m))),
                                               _mm512_mul_ps(hi, load_bf16_mask(s + i, m)));
                const __m512 b = _mm512_add_ps(round_bf16(_mm512_mul_ps(hi, load_bf16_mask(c + half + i, m))),
                                               _mm512_mul_ps(lo, load_bf16_mask(s + half + i, m)));
                store_bf16(p + i, a, m);
                store_bf16(p + half + i, b, m);
            }
        }
        if (kcache) {
            const int64_t tok = (int64_t)kvh * hd;
            memcpy(kcache + slots[t] * tok, row + (int64_t)(rotate - kvh) * hd, tok * 2);
            memcpy(vcache + slots[t] * tok, row + (int64_t)rotate * hd, tok * 2);
        }
    }
    return 0;
}

/* out [rows][inter] = silu(gu[:, :inter]) * gu[:, inter:] */
void silu_mul_bf16(const uint16_t* gu, int64_t rows, int64_t inter, uint16_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* g = gu + r * 2 * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 m = first(inter - i);
            const __m512 v = load_bf16_mask(g + i, m);
            const __m512 sv = round_bf16(_mm512_div_ps(
                v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
            store_bf16(out + r * inter + i, _mm512_mul_ps(sv, load_bf16_mask(g + inter + i, m)), m);
        }
    }
}
