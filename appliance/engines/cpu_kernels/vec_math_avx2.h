/* Vector math the AVX2 kernels share (fp32, 8 lanes: paged_decode_f32.c, layer_glue_f32.c).
   builder.py hashes every header here into each kernel's cache key. */
#ifndef APPLIANCED_VEC_MATH_AVX2_H
#define APPLIANCED_VEC_MATH_AVX2_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* exp of 8 floats: Cephes' expf, 2^n * p(r) with r = x - n ln2 (vec_math.h's exp_ps), within
   ~1 ulp of expf */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
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

/* the first n of 8 lanes (all for n >= 8), as a mask for maskload/maskstore */
static inline __attribute__((always_inline)) __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n > 8 ? 8 : (int)n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the largest of r[0..n) (-inf for none) */
static inline float row_max(const float* r, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(r + i));
    float mv[8];
    _mm256_storeu_ps(mv, m8);
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = mv[l] > mx ? mv[l] : mx;
    for (; i < n; i++) mx = r[i] > mx ? r[i] : mx;
    return mx;
}

/* the sum of 8 lanes, in a fixed order */
static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

#endif
