/* Matrix products and dequantization for the GGUF K-quant types of 256-value super-blocks (Q4_K, Q5_K,
   Q6_K), read straight from the memory-mapped blocks. */
#include "common.h"

/* K-quant super-blocks of 256 values (Q4_K 144 bytes, Q5_K 176, Q6_K 210), dequantized whole into v. */
static void k_block(int type, const uint8_t *b, float *v) {
    if (type == 5) { /* Q6_K: ql[128] qh[64] int8 scales[16] d */
        float d = f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    int e = 128 * h + 32 * g + l;
                    int lo = g < 2 ? b[64 * h + 32 * g + l] & 15 : b[64 * h + 32 * (g - 2) + l] >> 4;
                    int hi = (b[128 + 32 * h + l] >> (2 * g)) & 3;
                    float dl = d * (float)(int8_t)b[192 + e / 16];
                    v[e] = dl * (float)((lo | (hi << 4)) - 32);
                }
        return;
    }
    /* Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: qh 32], qs 128 */
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (type == 3 ? 16 : 48);
    for (int j = 0; j < 8; j++) {
        int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        for (int l = 0; l < 32; l++) {
            int e = 32 * j + l;
            int q = (j & 1) ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
            if (type == 4) q |= ((qh[l] >> j) & 1) << 4;
            float p = dl * (float)q;
            POOT_ROUNDED(p); /* rounded before the minimum is taken off, as ggml does */
            v[e] = p - ml;
        }
    }
}

static inline int64_t k_size(int type) { return type == 3 ? 144 : type == 4 ? 176 : 210; }

static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    *sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

#ifdef __AVX512F__
/* One row of Q4_K / Q5_K times one x: per 32-value sub-block, d * sc * (q . x) - dmin * m * sum(x). */
static float row_dot_q45k(int type, const uint8_t *row, int64_t nb, const float *x, const float *xsum32) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    float macc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * k_size(type), *qs = blk + (type == 3 ? 16 : 48);
        float d = f16(blk), dmin = f16(blk + 2);
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
        if (type == 4) {
            h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)));
            h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32)));
        }
        for (int c = 0; c < 4; c++) {
            __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
            __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
            for (int k = 0; k < 2; k++) {
                int j = 2 * c + k, sc, mn;
                k_scale_min(blk + 4, j, &sc, &mn);
                __m512i l0 = k ? _mm512_srli_epi32(q0, 4) : _mm512_and_si512(q0, low4);
                __m512i l1 = k ? _mm512_srli_epi32(q1, 4) : _mm512_and_si512(q1, low4);
                if (type == 4) {
                    l0 = _mm512_or_si512(l0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h0, j), one), 4));
                    l1 = _mm512_or_si512(l1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h1, j), one), 4));
                }
                const float *xb = x + b * 256 + 32 * j;
                __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l1), _mm512_loadu_ps(xb + 16),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(l0), _mm512_loadu_ps(xb)));
                __m512 dl = _mm512_set1_ps(d * (float)sc);
                if (k) acc1 = _mm512_fmadd_ps(dl, v, acc1);
                else acc0 = _mm512_fmadd_ps(dl, v, acc0);
                macc += dmin * (float)mn * xsum32[b * 8 + j];
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - macc;
}

/* One row of Q6_K times one x: per 16-value group, d * sc * (q . x) with q = (4 low | 2 high bits) - 32. */
static float row_dot_q6k(const uint8_t *row, int64_t nb, const float *x) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        float d = f16(blk + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            __m512i a0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
            __m512i a1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16)));
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32)));
            __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 48)));
            __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
            __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16)));
            for (int g = 0; g < 4; g++) {
                __m512i s0 = (g & 1) ? b0 : a0, s1 = (g & 1) ? b1 : a1;
                __m512i l0 = g < 2 ? _mm512_and_si512(s0, low4) : _mm512_srli_epi32(s0, 4);
                __m512i l1 = g < 2 ? _mm512_and_si512(s1, low4) : _mm512_srli_epi32(s1, 4);
                __m512i u0 = _mm512_and_si512(_mm512_srli_epi32(h0, 2 * g), three);
                __m512i u1 = _mm512_and_si512(_mm512_srli_epi32(h1, 2 * g), three);
                __m512i q0 = _mm512_sub_epi32(_mm512_or_si512(l0, _mm512_slli_epi32(u0, 4)), bias);
                __m512i q1 = _mm512_sub_epi32(_mm512_or_si512(l1, _mm512_slli_epi32(u1, 4)), bias);
                const float *xb = x + b * 256 + 128 * h + 32 * g;
                const int8_t *sc = (const int8_t *)(blk + 192) + 8 * h + 2 * g;
                acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[0]),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(q0), _mm512_loadu_ps(xb)), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc[1]),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(q1), _mm512_loadu_ps(xb + 16)), acc1);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

/* Machines without AVX-512: 256-bit routes for up to 4 x rows. */
#if POOT_AVX2 && !defined(__AVX512F__)
/* The 32 codes of sub-block j of a Q4_K super-block as four vectors of 8 floats: q holds the 32 bytes of
   nibbles it shares with its neighbour (sub-blocks 2c, 2c + 1: low and high nibbles), widened to 32-bit lanes
   straight from memory. */
static inline void q4k_floats(const __m256i *q, int j, __m256 *f) {
    for (int i = 0; i < 4; i++)
        f[i] = _mm256_cvtepi32_ps((j & 1) ? _mm256_srli_epi32(q[i], 4) : _mm256_and_si256(q[i], _mm256_set1_epi32(15)));
}

/* 32 bytes at p widened to four vectors of 8 32-bit lanes. */
static inline void widen_bytes(const uint8_t *p, __m256i *v) {
    for (int i = 0; i < 4; i++) v[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i)));
}

/* The 32 codes of sub-block j of a Q5_K super-block as int8 lanes (0..31: the fifth bit is bit j of
   qh[l]); measured faster for Q5_K than widening from memory as q4k_floats does. */
static inline __attribute__((always_inline)) __m256i q45k_codes(const int type, const uint8_t *blk, int j) {
    __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (type == 3 ? 16 : 48) + 32 * (j / 2)));
    if (j & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(15));
    if (type == 4) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1)), 4));
    }
    return q;
}

/* The 32 codes of elements 128 h + 32 g .. + 31 of a Q6_K super-block: (4 low | 2 high bits) - 32. */
static inline __m256i q6k_codes(const uint8_t *blk, int h, int g) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
    if (g >= 2) lo = _mm256_srli_epi16(lo, 4);
    lo = _mm256_and_si256(lo, _mm256_set1_epi8(15));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* 32 int8 codes as four vectors of 8 floats. */
static inline void widen_k(__m256i c, __m256 *f) {
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* One weight row times m x rows (type and m constants in each instantiation): each 32-value sub-block is
   decoded once; Q4_K / Q5_K add d * sc * (q . x) and take dmin * mn * sum(x) off, Q6_K adds d * sc * (q . x)
   per 16 values. xsum32: sum(x) per 32 values, [m, nb * 8]. */
static inline __attribute__((always_inline)) void rowsk256(const int type, const int m, const uint8_t *row,
                                                           int64_t nb, const float *x, const float *xsum32,
                                                           float *y, int64_t n) {
    const int64_t k = nb * 256;
    __m256 acc[4][2];
    float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < m; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * k_size(type);
        if (type == 5) {
            const float d = f16(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++) {
                    __m256 f[4];
                    widen_k(q6k_codes(blk, h, g), f);
                    const __m256 s0 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * g]);
                    const __m256 s1 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * g + 1]);
                    for (int r = 0; r < m; r++) {
                        const float *xb = x + r * k + b * 256 + 128 * h + 32 * g;
                        const __m256 p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8),
                                                         _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
                        const __m256 q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24),
                                                         _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
                        acc[r][0] = _mm256_fmadd_ps(s0, p, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(s1, q, acc[r][1]);
                    }
                }
        } else {
            const float d = f16(blk), dmin = f16(blk + 2);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                k_scale_min(blk + 4, j, &sc, &mn);
                __m256 f[4];
                if (type == 3) {
                    if (!(j & 1)) widen_bytes(blk + 16 + 32 * (j / 2), q);
                    q4k_floats(q, j, f);
                } else {
                    widen_k(q45k_codes(type, blk, j), f);
                }
                const __m256 dl = _mm256_set1_ps(d * (float)sc);
                const float ml = dmin * (float)mn;
                for (int r = 0; r < m; r++) {
                    const float *xb = x + r * k + b * 256 + 32 * j;
                    const __m256 p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8),
                                                     _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
                    const __m256 q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24),
                                                     _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
                    acc[r][j & 1] = _mm256_fmadd_ps(dl, _mm256_add_ps(p, q), acc[r][j & 1]);
                    macc[r] += ml * xsum32[r * nb * 8 + b * 8 + j];
                }
            }
        }
    }
    for (int r = 0; r < m; r++) y[r * n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - macc[r];
}

#define POOT_ROWSK(T) POOT_CASE_ROWS(T, m, rowsk256, row, nb, x, xsum32, y, n)

static void rows_dotk(int type, int m, const uint8_t *row, int64_t nb, const float *x, const float *xsum32,
                      float *y, int64_t n) {
    switch (type) {
    POOT_ROWSK(3)
    POOT_ROWSK(4)
    POOT_ROWSK(5)
    }
}
#endif

/* y[m, n] = x[m, nb * 256] @ W^T for the K-quant types: each block is decoded to floats in L1, then dotted
   (with AVX-512 one x, with AVX2 up to 4 take the vector routes above). */
void poot_gemv_k(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                 float *y, int threads) {
#ifdef __AVX512F__
    if (m == 1 && type == 5) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < n; o++) y[o] = row_dot_q6k(w + o * row_bytes, nb, x);
        return;
    }
    if (m == 1) {
        float *xsum32 = sums_of_32(x, nb * 8);
        if (xsum32) {
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t o = 0; o < n; o++) y[o] = row_dot_q45k(type, w + o * row_bytes, nb, x, xsum32);
            free(xsum32);
            return;
        }
    }
#endif
#if POOT_AVX2 && !defined(__AVX512F__)
    if (m <= 4) {
        float *xsum32 = sums_of_32(x, m * nb * 8);
        if (xsum32) {
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t o = 0; o < n; o++) rows_dotk(type, (int)m, w + o * row_bytes, nb, x, xsum32, y + o, n);
            free(xsum32);
            return;
        }
    }
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        float v[256], acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t b = 0; b < nb; b++) {
            k_block(type, w + o * row_bytes + b * k_size(type), v);
            block_dot_rows(v, x, m, nb, b, acc);
        }
        for (int64_t r = 0; r < m; r++) y[r * n + o] = acc[r];
    }
}

void poot_dequant_k(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, float *out,
                    int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < rows; o++)
        for (int64_t b = 0; b < nb; b++)
            k_block(type, w + o * row_bytes + b * k_size(type), out + o * nb * 256 + b * 256);
}
