/* Decode products with 8-bit activations (LoadOptions(cpu_activations="q8")): llama.cpp's arithmetic, not the
   exact default. Each row of x is quantized once per call, per 32 values: d = amax / 127, q = round(x * (1 / d))
   (round half to even, as ggml's AVX2 quantizer), with the integer sums of every 16 q kept (times d) for the
   weight types with minimums. One 32-value group of a weight row then contributes
       d_x * (D * sum_16-halves(s_h * sum(c * q)) + M * sum_16-halves(n_h * sum_h(q)))
   with the weight's integer codes c, its float scale D, integer sub-scales s_h (per 16 values, 1 for the types
   with one scale per 32), and for types with minimums the float M and integer n_h. The integer sums are exact;
   the float sums are float32. The activation scale is per 32 values for every type (a finer grid than llama.cpp's
   Q8_K of 256 values for the K-quants, and the same integer arithmetic within each 32).

   With AVX2 the codes of a group are decoded into one register of 32 int8 and dotted with
   _mm256_maddubs_epi16 (|c| times q with c's sign) and _mm256_madd_epi16 (with the sub-scales); without it, a
   portable route does the same sums in plain C. OpenMP over output rows; up to four rows of x share one decode. */
#include "blocks.h"

/* One weight row times m quantized x rows (m <= 4, a constant in each instantiation). qx: m rows of k int8;
   dx: their scales per 32; dxs: d times the sum of each 16 q. y[r * n] gets row r's result. */
static inline __attribute__((always_inline)) void q8_rows(const int t, const int m, const uint8_t *row, int64_t nb,
                                                          const int8_t *qx, const float *dx, const float *dxs,
                                                          const float *dxs32, int64_t k, float *y, int64_t n) {
    const int G = a_groups(t);
    const int64_t size = A_BYTES[t];
    float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    scales_t sc;
#if POOT_AVX2
    __m256 acc[4], macc8[4];
    for (int r = 0; r < m; r++) acc[r] = macc8[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
#else
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int8_t c[32];
    (void)dxs32;
#endif
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        block_scales(t, blk, &sc);
        for (int g = 0; g < G; g++) {
            const int64_t gi = b * G + g;  /* the 32-value group's index in the row */
#if POOT_AVX2
            const __m256i cv = group_codes_v(t, blk, g), ac = _mm256_sign_epi8(cv, cv);
            const __m256i s16 = a_sub16(t) ? _mm256_set_m128i(_mm_set1_epi16(sc.s[2 * g + 1]), _mm_set1_epi16(sc.s[2 * g]))
                                           : ones;
            for (int r = 0; r < m; r++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qx + r * k + gi * 32));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, _mm256_sign_epi8(q, cv)), s16);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc.D[g] * dx[r * (k / 32) + gi]), acc[r]);
#else
            group_codes(t, blk, g, c);
            for (int r = 0; r < m; r++) {
                const int8_t *q = qx + r * k + gi * 32;
                int32_t i0 = 0, i1 = 0;
                for (int l = 0; l < 16; l++) {
                    i0 += (int32_t)c[l] * q[l];
                    i1 += (int32_t)c[l + 16] * q[l + 16];
                }
                const int32_t isum = a_sub16(t) ? sc.s[2 * g] * i0 + sc.s[2 * g + 1] * i1 : i0 + i1;
                acc[r] += (float)isum * (sc.D[g] * dx[r * (k / 32) + gi]);
#endif
#if POOT_AVX2
                /* 32-value blocks: one scalar term; the 256-value ones take theirs per block, below */
                if (a_has_min(t) && G == 1) macc[r] += sc.M[0] * dxs32[r * (k / 32) + gi];
#else
                if (a_has_min(t)) {
                    const float *s = dxs + r * (k / 16) + 2 * gi;
                    macc[r] += sc.M[g] * ((float)sc.n[2 * g] * s[0] + (float)sc.n[2 * g + 1] * s[1]);
                }
#endif
            }
        }
#if POOT_AVX2
        if (a_has_min(t) && G == 8) {
            for (int r = 0; r < m; r++) {
                if (a_sub16(t)) { /* Q2_K: a minimum per 16 values, times -dmin */
                    const float *s = dxs + r * (k / 16) + b * 16;
                    const __m256 md = _mm256_set1_ps(sc.M[0]);
                    const __m256 n0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)sc.n)));
                    const __m256 n1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(sc.n + 8))));
                    macc8[r] = _mm256_fmadd_ps(_mm256_mul_ps(md, n0), _mm256_loadu_ps(s), macc8[r]);
                    macc8[r] = _mm256_fmadd_ps(_mm256_mul_ps(md, n1), _mm256_loadu_ps(s + 8), macc8[r]);
                } else { /* Q4_K, Q5_K: a minimum per 32 values */
                    macc8[r] = _mm256_fmadd_ps(_mm256_loadu_ps(sc.M), _mm256_loadu_ps(dxs32 + r * (k / 32) + b * 8),
                                               macc8[r]);
                }
            }
        }
#endif
    }
#if POOT_AVX2
    for (int r = 0; r < m; r++) y[r * n] = hsum8(_mm256_add_ps(acc[r], macc8[r])) + macc[r];
#else
    for (int r = 0; r < m; r++) y[r * n] = acc[r] + macc[r];
#endif
}

#define POOT_Q8ROWS(T)                                                             \
    case T:                                                                        \
        switch (m) {                                                               \
        case 1: q8_rows(T, 1, row, nb, qx, dx, dxs, dxs32, k, y, n); return;       \
        case 2: q8_rows(T, 2, row, nb, qx, dx, dxs, dxs32, k, y, n); return;       \
        case 3: q8_rows(T, 3, row, nb, qx, dx, dxs, dxs32, k, y, n); return;       \
        default: q8_rows(T, 4, row, nb, qx, dx, dxs, dxs32, k, y, n); return;      \
        }

static void q8_row(int t, int m, const uint8_t *row, int64_t nb, const int8_t *qx, const float *dx,
                   const float *dxs, const float *dxs32, int64_t k, float *y, int64_t n) {
    switch (t) {
    POOT_Q8ROWS(A_Q4_0) POOT_Q8ROWS(A_Q4_1) POOT_Q8ROWS(A_Q8_0) POOT_Q8ROWS(A_Q5_0) POOT_Q8ROWS(A_Q5_1)
    POOT_Q8ROWS(A_IQ4_NL) POOT_Q8ROWS(A_Q4_K) POOT_Q8ROWS(A_Q5_K) POOT_Q8ROWS(A_Q6_K) POOT_Q8ROWS(A_IQ4_XS)
    POOT_Q8ROWS(A_Q2_K) POOT_Q8ROWS(A_Q3_K)
    }
}

/* x[m, k] (k a multiple of 32) quantized per 32 values: q[m, k], d[m, k / 32], ds[m, k / 16] = d * sum of each
   16 q. d = amax / 127 and q = round-half-even(x * (1 / d)), in float32 (q = 0 where amax is 0). */
void poot_quantize_q8(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *ds) {
    for (int64_t i = 0; i < m * k / 32; i++) {
        const float *xb = x + 32 * i;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
        const float di = amax / 127.0f, id = di != 0.0f ? 1.0f / di : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; l++) {
            const int v = (int)nearbyintf(xb[l] * id);
            q[32 * i + l] = (int8_t)v;
            if (l < 16) s0 += v;
            else s1 += v;
        }
        d[i] = di;
        ds[2 * i] = di * (float)s0;
        ds[2 * i + 1] = di * (float)s1;
    }
}

/* y[m, n] = x[m, nb * block] @ W^T for m <= 4 with x quantized to 8 bits per 32 values first (the arguments of
   poot_gemv; type is an A_ id). */
void poot_gemv_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                  float *y, int threads) {
    const int64_t k = nb * (type >= A_Q4_K ? 256 : 32);
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(2 * (m * k / 32) + m * k / 16));
    if (!qx || !dx) {
        free(qx);
        free(dx);
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    float *dxs = dx + m * k / 32, *dxs32 = dxs + m * k / 16;
    poot_quantize_q8(x, m, k, qx, dx, dxs);
    for (int64_t i = 0; i < m * k / 32; i++) dxs32[i] = dxs[2 * i] + dxs[2 * i + 1];  /* d times the sum of 32 */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) q8_row(type, (int)m, w + o * row_bytes, nb, qx, dx, dxs, dxs32, k, y + o, n);
    free(qx);
    free(dx);
}

/* Rows of x per panel of poot_gemm_q8: about 128 KiB of quantized x, kept in the core's L2 while its weight
   rows pass; a multiple of 4. */
#define Q8_PANEL_BYTES (128 * 1024)

/* y[m, n] = x[m, k] @ W^T for any m (prefill, serving steps) with x quantized once per call: every row of y is
   bit for bit what poot_gemv_q8 gives that row (the same quantization and the same q8_row sums), the weight's
   codes decoded once per 4 rows of x. OpenMP over chunks of weight rows; each chunk meets x a panel of rows at
   a time, each weight row (in L1) every 4 rows of the panel. */
void poot_gemm_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                  float *y, int threads) {
    const int64_t k = nb * (type >= A_Q4_K ? 256 : 32);
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(2 * (m * k / 32) + m * k / 16));
    if (!qx || !dx) {
        free(qx);
        free(dx);
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    float *dxs = dx + m * k / 32, *dxs32 = dxs + m * k / 16;
    int64_t panel = Q8_PANEL_BYTES / (k > 0 ? k : 1) / 4 * 4;
    if (panel < 4) panel = 4;
    int64_t chunk = (n + 4 * threads - 1) / (4 * threads);
    if (chunk > 64) chunk = 64;
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (n + chunk - 1) / chunk;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            poot_quantize_q8(x + r * k, 1, k, qx + r * k, dx + r * (k / 32), dxs + r * (k / 16));
            for (int64_t i = r * (k / 32); i < (r + 1) * (k / 32); i++) dxs32[i] = dxs[2 * i] + dxs[2 * i + 1];
        }
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t o0 = c * chunk, o1 = o0 + chunk < n ? o0 + chunk : n;
            for (int64_t p0 = 0; p0 < m; p0 += panel) {
                const int64_t p1 = p0 + panel < m ? p0 + panel : m;
                for (int64_t o = o0; o < o1; o++)
                    for (int64_t r0 = p0; r0 < p1; r0 += 4)
                        q8_row(type, (int)(p1 - r0 < 4 ? p1 - r0 : 4), w + o * row_bytes, nb, qx + r0 * k,
                               dx + r0 * (k / 32), dxs + r0 * (k / 16), dxs32 + r0 * (k / 32), k, y + r0 * n + o, n);
            }
        }
    }
    free(qx);
    free(dx);
}
