/* Matrix products from 16-bit float weights (bf16, f16). */
#include "common.h"

/* y[m, n] = x[m, k] @ W^T for W stored as 16-bit floats [n, k] (bf16, or f16 when half != 0), rows
   row_elems apart: each weight is widened exactly to float32 in registers and summed in float32, so the
   result is that of the float32 product, read at the 16-bit weights' memory cost. */
static inline float wide16(uint16_t v, int half) {
    if (half) { uint8_t b[2]; memcpy(b, &v, 2); return f16(b); }
    uint32_t bits = (uint32_t)v << 16; float f; memcpy(&f, &bits, 4); return f;
}

/* Machines without AVX-512 (which keep the route below). */
#if POOT_AVX2 && !defined(__AVX512F__)
/* 8 16-bit floats at p, widened exactly. */
static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *p, const int half) {
    const __m128i r = _mm_loadu_si128((const __m128i *)p);
    return half ? _mm256_cvtph_ps(r) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16));
}

/* One weight row times m x rows (m <= 4, half and m constants in each instantiation): each 16 weights are
   widened once and multiplied into every row's two accumulators. */
static inline __attribute__((always_inline)) void rows16(const int half, const int m, const uint16_t *row,
                                                         int64_t k, const float *x, float *y, int64_t n) {
    __m256 a[4][2];
    for (int r = 0; r < m; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        const __m256 w0 = widen8(row + j, half), w1 = widen8(row + j + 8, half);
        for (int r = 0; r < m; r++) {
            a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + j), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + j + 8), a[r][1]);
        }
    }
    for (int r = 0; r < m; r++) {
        float s = hsum8(_mm256_add_ps(a[r][0], a[r][1]));
        for (int64_t i = j; i < k; i++) s += wide16(row[i], half) * x[r * k + i];
        y[r * n] = s;
    }
}

#define POOT_ROWS16(H)                                                   \
    switch (m) {                                                         \
    case 1: rows16(H, 1, row, k, x, y, n); return;                       \
    case 2: rows16(H, 2, row, k, x, y, n); return;                       \
    case 3: rows16(H, 3, row, k, x, y, n); return;                       \
    default: rows16(H, 4, row, k, x, y, n); return;                      \
    }

static void rows_dot16(int half, int m, const uint16_t *row, int64_t k, const float *x, float *y, int64_t n) {
    if (half) POOT_ROWS16(1)
    POOT_ROWS16(0)
}
#endif

void poot_gemv16(const uint16_t *w, int64_t row_elems, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                 int half, int threads) {
#if POOT_AVX2 && !defined(__AVX512F__)
    if (m <= 4) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < n; o++) rows_dot16(half, (int)m, w + o * row_elems, k, x, y + o, n);
        return;
    }
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint16_t *row = w + o * row_elems;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float s = 0.0f;
            int64_t j = 0;
#if defined(__AVX512F__) && defined(__F16C__)
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            for (; j + 32 <= k; j += 32) {
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(row + j));
                __m256i r1 = _mm256_loadu_si256((const __m256i *)(row + j + 16));
                __m512 w0 = half ? _mm512_cvtph_ps(r0)
                                 : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r0), 16));
                __m512 w1 = half ? _mm512_cvtph_ps(r1)
                                 : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16));
                a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr + j), a0);
                a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + j + 16), a1);
            }
            s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
            for (; j < k; j++) s += wide16(row[j], half) * xr[j];
            y[r * n + o] = s;
        }
    }
}
