/* Matrix products from 16-bit float weights (bf16, f16). */
#include "common.h"

/* y[m, n] = x[m, k] @ W^T for W stored as 16-bit floats [n, k] (bf16, or f16 when half != 0), rows
   row_elems apart: each weight is widened exactly to float32 in registers and summed in float32, so the
   result is that of the float32 product, read at the 16-bit weights' memory cost. */
static inline float wide16(uint16_t v, int half) {
    if (half) { uint8_t b[2]; memcpy(b, &v, 2); return f16(b); }
    uint32_t bits = (uint32_t)v << 16; float f; memcpy(&f, &bits, 4); return f;
}

/* Machines with AVX2 and without AVX-512. */
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

/* Machines with AVX-512. */
#if defined(__AVX512F__) && defined(__F16C__)
/* 16 16-bit floats at p, widened exactly. */
static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p, const int half) {
    const __m256i r = _mm256_loadu_si256((const __m256i *)p);
    return half ? _mm512_cvtph_ps(r) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
}

/* One weight row times m x rows (m <= 8, half and m constants in each instantiation): each 32 weights are
   widened once and multiplied into every row's two accumulators. A row's sums run in the same order whatever
   m is, so each row's result is the one it gets alone. */
static inline __attribute__((always_inline)) void rows32(const int half, const int m, const uint16_t *row,
                                                         int64_t k, const float *x, float *y, int64_t n) {
    __m512 a[8][2];
    for (int r = 0; r < m; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        const __m512 w0 = widen16(row + j, half), w1 = widen16(row + j + 16, half);
        for (int r = 0; r < m; r++) {
            a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + j), a[r][0]);
            a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + j + 16), a[r][1]);
        }
    }
    for (int r = 0; r < m; r++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
        for (int64_t i = j; i < k; i++) s += wide16(row[i], half) * x[r * k + i];
        y[r * n] = s;
    }
}

#define POOT_ROWS32(H)                                                   \
    switch (m) {                                                         \
    case 1: rows32(H, 1, row, k, x, y, n); return;                       \
    case 2: rows32(H, 2, row, k, x, y, n); return;                       \
    case 3: rows32(H, 3, row, k, x, y, n); return;                       \
    case 4: rows32(H, 4, row, k, x, y, n); return;                       \
    case 5: rows32(H, 5, row, k, x, y, n); return;                       \
    case 6: rows32(H, 6, row, k, x, y, n); return;                       \
    case 7: rows32(H, 7, row, k, x, y, n); return;                       \
    default: rows32(H, 8, row, k, x, y, n); return;                      \
    }

static void rows_dot32(int half, int m, const uint16_t *row, int64_t k, const float *x, float *y, int64_t n) {
    if (half) POOT_ROWS32(1)
    POOT_ROWS32(0)
}
#endif

/* Any number of x rows: each weight row is read from memory once and met by the rows a group at a time (8 with
   AVX-512, 4 with AVX2) while it is in cache; a row's result does not depend on m. */
void poot_gemv16(const uint16_t *w, int64_t row_elems, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                 int half, int threads) {
#if defined(__AVX512F__) && defined(__F16C__)
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++)
        for (int64_t r = 0; r < m; r += 8)
            rows_dot32(half, (int)(m - r < 8 ? m - r : 8), w + o * row_elems, k, x + r * k, y + r * n + o, n);
#elif POOT_AVX2 && !defined(__AVX512F__)
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++)
        for (int64_t r = 0; r < m; r += 4)
            rows_dot16(half, (int)(m - r < 4 ? m - r : 4), w + o * row_elems, k, x + r * k, y + r * n + o, n);
#else
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint16_t *row = w + o * row_elems;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float s = 0.0f;
            for (int64_t j = 0; j < k; j++) s += wide16(row[j], half) * xr[j];
            y[r * n + o] = s;
        }
    }
#endif
}
