/* Vector math the CPU kernels share (AVX-512F). Included by the .c files beside it;
   builder.py hashes every header here into each kernel's cache key. */
#ifndef APPLIANCED_VEC_MATH_H
#define APPLIANCED_VEC_MATH_H
#include <immintrin.h>
#include <stdint.h>

/* the first n of 16 lanes */
static inline __mmask16 first(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* 16 bf16 -> fp32 (exact) */
static inline __m512 load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the first lanes of `m` as load_bf16, the rest zero */
static inline __m512 load_bf16_mask(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* fp32 -> bf16 -> fp32, round to nearest even as torch's cast (a NaN stays a NaN).
   With AVX512-BF16 one VCVTNEPS2BF16 does it (the same rounding; it flushes a denormal,
   below 1.2e-38, to zero where torch keeps it): measured on the glue kernels, whose
   roundings were most of their work, at 256 rows (AMD EPYC Zen 4): SwiGLU's activation
   0.43 -> 0.33 ms, the residual add and norm 0.12 -> 0.07. */
#ifdef __AVX512BF16__
static inline __m512 round_bf16(__m512 x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the lanes of `m`, rounded to bf16 as round_bf16 */
static inline void store_bf16(uint16_t* p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}
#else
static inline __m512 round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), hi);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_and_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)), hi);
    return _mm512_castsi512_ps(r);
}

/* the lanes of `m`, rounded to bf16 as round_bf16 */
static inline void store_bf16(uint16_t* p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16)));
}
#endif

/* exp of 16 floats: Cephes' expf, 2^n * p(r) with r = x - n ln2, |r| <= ln2/2; within
   ~1 ulp of expf (what torch's softmax computes with Sleef's expf). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-103.972084045410f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
