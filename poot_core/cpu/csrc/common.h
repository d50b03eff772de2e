/* Shared by every part of the CPU kernel library: the headers, and the helpers more than one part uses.
   Each .c file in this folder is one part; poot_core/cpu/c_kernels.py compiles them all into one library. */
#ifndef POOT_COMMON_H
#define POOT_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* The 256-bit vector routes (written for machines without AVX-512, and used by the newer kernels everywhere). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define POOT_AVX2 1
#else
#define POOT_AVX2 0
#endif

/* Marks the float (or vector) v as rounded: the empty asm hides its value, so the compiler cannot fuse the
   multiply that made it with a following add into one FMA. Dequantization uses it where ggml (and numpy)
   round d * q before adding the minimum. */
#if defined(__x86_64__) || defined(__i386__)
#define POOT_ROUNDED(v) __asm__("" : "+x"(v))
#else
#define POOT_ROUNDED(v) do { volatile __typeof__(v) poot_t_ = (v); (v) = poot_t_; } while (0)
#endif

/* One case of a switch over block types: calls fn(T, rows, ...) with rows = m (1 to 4; more counts as 4) as a
   constant, so that each pair of type and row count is its own inlined expansion of fn, then returns. */
#define POOT_CASE_ROWS(T, m, fn, ...)                                                   \
    case T:                                                                              \
        switch (m) {                                                                     \
        case 1: fn(T, 1, __VA_ARGS__); return;                                           \
        case 2: fn(T, 2, __VA_ARGS__); return;                                           \
        case 3: fn(T, 3, __VA_ARGS__); return;                                           \
        default: fn(T, 4, __VA_ARGS__); return;                                          \
        }

/* The IEEE half at p (2 bytes, any alignment) as a float. */
static inline float f16(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* The sum of each 32 consecutive values of x, for `groups` groups (in index order), in a malloc'd array of
   groups + 1 floats the caller frees; NULL when there is no memory. The quantized products take a block's
   minimum (or offset) term from these. */
static inline float *sums_of_32(const float *x, int64_t groups) {
    float *sums = malloc(sizeof(float) * (size_t)(groups + 1));
    if (!sums) return NULL;
    for (int64_t i = 0; i < groups; i++) {
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += x[32 * i + j];
        sums[i] = s;
    }
    return sums;
}

/* acc[r] += v . (block b of row r of x) for the m (at most 4) rows of x, each nb blocks of 256 values, summed
   in index order: the portable route of the K-quant products, over one block decoded into v. */
static inline void block_dot_rows(const float *v, const float *x, int64_t m, int64_t nb, int64_t b, float *acc) {
    for (int64_t r = 0; r < m; r++) {
        const float *xb = x + r * nb * 256 + b * 256;
        float s = 0.0f;
        for (int j = 0; j < 256; j++) s += v[j] * xb[j];
        acc[r] += s;
    }
}

#if defined(__AVX512F__) || POOT_AVX2
/* What exp16 and exp8 share: x = k ln2 + r with k = round(x log2(e)) and ln2 in two parts (the high part has
   few bits, so k * POOT_LN2_HI is exact), then p(r) = sum of r^i / i! for i <= 6 by Horner's rule, the
   coefficients highest first. */
#define POOT_LOG2E 1.44269504088896341f
#define POOT_LN2_HI 0.693145751953125f
#define POOT_LN2_LO 1.428606765330187e-06f
#define POOT_EXP_TERMS 7
static const float poot_exp_poly[POOT_EXP_TERMS] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                                                    0.5f, 1.0f, 1.0f};
#endif

#ifdef __AVX512F__
/* exp(x) for 16 floats: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (about
   2 ulp, as vectorized exp libraries are); inputs below -104 give 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(POOT_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(POOT_LN2_LO), _mm512_fnmadd_ps(k, _mm512_set1_ps(POOT_LN2_HI), x));
    __m512 p = _mm512_set1_ps(poot_exp_poly[0]);
    for (int j = 1; j < POOT_EXP_TERMS; j++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(poot_exp_poly[j]));
    return _mm512_scalef_ps(p, k);
}
#endif

#if POOT_AVX2
/* exp(x) for 8 floats, as exp16 computes it; 2^k is applied in two factors 2^(k/2) so that k down to -150
   stays exact without AVX-512's scalef. Inputs below -104 give 0, above 89 infinity. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(POOT_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(POOT_LN2_LO), _mm256_fnmadd_ps(k, _mm256_set1_ps(POOT_LN2_HI), x));
    __m256 p = _mm256_set1_ps(poot_exp_poly[0]);
    for (int j = 1; j < POOT_EXP_TERMS; j++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(poot_exp_poly[j]));
    const __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* The sum of the 8 lanes of v. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* Rope for one token: its heads of head_dim values (x; out may lie elsewhere, even in the cache), the first
   2 * half features of each rotated by (c, s): pairs (2i, 2i + 1) when interleaved, else (i, i + half); the
   rest copied. */
static inline void rope_row(const float *x, int64_t heads, int64_t head_dim, int64_t half, const float *c,
                            const float *s, int interleaved, float *out) {
    for (int64_t h = 0; h < heads; h++) {
        const float *xh = x + h * head_dim;
        float *oh = out + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
            const float a = xh[ia], b = xh[ib];
            oh[ia] = a * c[i] - b * s[i];
            oh[ib] = b * c[i] + a * s[i];
        }
        for (int64_t i = 2 * half; i < head_dim; i++) oh[i] = xh[i];
    }
}

#endif
