/* Decode products with 8-bit activations (LoadOptions(cpu_activations="q8")): llama.cpp's arithmetic, not the
   exact default. Each row of x is quantized once per call, per 32 values: d = amax / 127, q = round(x * (1 / d))
   (round half to even, as ggml's AVX2 quantizer), with the integer sums of every 16 q kept (times d) for the
   weight types with minimums. One 32-value group of a weight row then contributes
       d_x * (D * sum_16-halves(s_h * sum(c * q)) + M * sum_16-halves(n_h * sum_h(q)))
   with the weight's integer codes c, its float scale D, integer sub-scales s_h (per 16 values, 1 for the types
   with one scale per 32), and for types with minimums the float M and integer n_h. The integer sums are exact;
   the float sums are float32. The activation scale is per 32 values for every type (a finer grid than llama.cpp's
   Q8_K of 256 values for the K-quants, and the same integer arithmetic within each 32: on a per-256 grid one
   outlier of a block zeroes the rest of its 256 values, which moved a random test model's logits by 0.96).

   With AVX2 the codes of a group are decoded into one register of 32 int8 and dotted with
   _mm256_maddubs_epi16 (|c| times q with c's sign) and _mm256_madd_epi16 (with the sub-scales); without it, a
   portable route does the same sums in plain C (per 32 values in float32 for every type). OpenMP over output
   rows; up to four rows of x share one decode. */
#include "blocks.h"

#if POOT_AVX2
/* The largest of the 8 lanes of v. */
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The sum of the 8 int32 lanes of v. */
static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#endif

/* Row x [k] quantized per 32 values: d = amax / 127 and q = round-half-even(x * (1 / d)) in
   float32 (q = 0 where amax is 0), ds = d * sum(q) per 16, and where not NULL bs = sum(q) per 16 and
   ds32 = d * sum(q) per 32. The AVX2 route gives the same bits (its float32 products and rounding are the
   same operations, 8 at a time). */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *ds, int16_t *bs, float *ds32) {
    const int64_t qb = 32;
    for (int64_t i = 0; i < k / qb; i++) {
        const float *xb = x + qb * i;
        float amax = 0.0f;
#if POOT_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps();
        for (int64_t l = 0; l < qb; l += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + l)));
        amax = hmax8(mx);
#else
        for (int64_t l = 0; l < qb; l++) amax = fmaxf(amax, fabsf(xb[l]));
#endif
        const float di = amax / 127.0f, id = di != 0.0f ? 1.0f / di : 0.0f;
        d[i] = di;
        for (int64_t h = qb * i / 16; h < qb * (i + 1) / 16; h++) {  /* each 16 values of the block */
            const float *xh = x + 16 * h;
            int32_t sum = 0;
#if POOT_AVX2
            const __m256 iv = _mm256_set1_ps(id);
            const __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xh), iv));
            const __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xh + 8), iv));
            const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(v0), _mm256_extracti128_si256(v0, 1));
            const __m128i p16b = _mm_packs_epi32(_mm256_castsi256_si128(v1), _mm256_extracti128_si256(v1, 1));
            _mm_storeu_si128((__m128i *)(q + 16 * h), _mm_packs_epi16(p16, p16b));
            sum = hsum8i(_mm256_add_epi32(v0, v1));
#else
            for (int l = 0; l < 16; l++) {
                const int v = (int)nearbyintf(xh[l] * id);
                q[16 * h + l] = (int8_t)v;
                sum += v;
            }
#endif
            ds[h] = di * (float)sum;
            if (bs) bs[h] = (int16_t)sum;
        }
    }
    if (ds32)
        for (int64_t i = 0; i < k / 32; i++) ds32[i] = ds[2 * i] + ds[2 * i + 1];
}

#if POOT_AVX2
/* Types whose codes are stored unsigned (maddubs takes them as they are): the Q4_0 / Q5_0 codes before their
   offset of 8 / 16 is taken off, which q8_rows then takes off as offset * D * d_x * sum(q). */
static inline int a_unsigned(int t) { return t == A_Q4_0 || t == A_Q4_1 || t == A_Q5_0 || t == A_Q5_1 || t == A_Q2_K; }

/* group_codes_v, with Q4_0 and Q5_0 codes as stored (0-15, 0-31). */
static inline __attribute__((always_inline)) __m256i group_codes_raw(const int t, const uint8_t *b, int g) {
    if (t == A_Q4_0) return nibbles32(b + 2);
    if (t == A_Q5_0) {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        return _mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(16)));
    }
    return group_codes_v(t, b, g);
}
#endif

/* One weight row times m quantized x rows (m <= 4, a constant in each instantiation). y[r * n] gets row r's
   result. */
static inline __attribute__((always_inline)) void q8_rows(const int t, const int m, const uint8_t *row, int64_t nb,
                                                          const q8x_t *a, float *y, int64_t n) {
    const int G = a_groups(t);
    const int64_t size = A_BYTES[t], k = a->k;
    const int8_t *qx = a->q;
    const float *dx = a->d, *dxs = a->ds, *dxs32 = a->ds32;
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
            const __m256i cv = group_codes_raw(t, blk, g), ac = a_unsigned(t) ? cv : _mm256_sign_epi8(cv, cv);
            const __m256i s16 = a_sub16(t) ? _mm256_set_m128i(_mm_set1_epi16(sc.s[2 * g + 1]), _mm_set1_epi16(sc.s[2 * g]))
                                           : ones;
            /* Q4_0 / Q5_0 codes are stored + 8 / + 16: the offset is a minimum of -8 D / -16 D */
            const float offset = t == A_Q4_0 ? -8.0f * sc.D[0] : t == A_Q5_0 ? -16.0f * sc.D[0] : 0.0f;
            for (int r = 0; r < m; r++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qx + r * k + gi * 32));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, a_unsigned(t) ? q : _mm256_sign_epi8(q, cv)),
                                                    s16);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc.D[g] * dx[r * (k / 32) + gi]), acc[r]);
                /* 32-value blocks: one scalar term; the 256-value ones take theirs per block, below */
                if (a_has_min(t) && G == 1) macc[r] += sc.M[0] * dxs32[r * (k / 32) + gi];
                if (t == A_Q4_0 || t == A_Q5_0) macc[r] += offset * dxs32[r * (k / 32) + gi];
            }
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
                if (a_has_min(t)) {
                    const float *s = dxs + r * (k / 16) + 2 * gi;
                    macc[r] += sc.M[g] * ((float)sc.n[2 * g] * s[0] + (float)sc.n[2 * g + 1] * s[1]);
                }
            }
#endif
        }
#if POOT_AVX2
        if (a_has_min(t) && G == 8) { /* Q2_K (Q4_K and Q5_K take k8_rows): a minimum per 16 values, times -dmin */
            for (int r = 0; r < m; r++) {
                const float *s = dxs + r * (k / 16) + b * 16;
                const __m256 md = _mm256_set1_ps(sc.M[0]);
                const __m256 n0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)sc.n)));
                const __m256 n1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(sc.n + 8))));
                macc8[r] = _mm256_fmadd_ps(_mm256_mul_ps(md, n0), _mm256_loadu_ps(s), macc8[r]);
                macc8[r] = _mm256_fmadd_ps(_mm256_mul_ps(md, n1), _mm256_loadu_ps(s + 8), macc8[r]);
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

#if POOT_AVX2
/* Q4_K, Q5_K and Q6_K (AVX2): one weight row times m x rows, the codes taken unsigned as stored (maddubs needs no
   sign trick), each block's 8 float scales D_g * d_x of a row made in one vector product and read back a lane
   at a time by broadcast loads. Q4_K / Q5_K add M_g * d_x * sum(q) per group (8 at a time); for Q6_K, whose
   codes are stored + 32, d * d_x * 32 * (s_2g * sum(q of 16 2g) + s_2g+1 * sum(q of 16 2g+1)) is taken off,
   the integer part for the 8 groups from one madd of the sub-scales with x's sums of 16. Each row's sums are
   the same whatever m is. */
static inline __attribute__((always_inline)) void k8_rows(const int t, const int m, const uint8_t *row, int64_t nb,
                                                          const q8x_t *a, float *y, int64_t n) {
    const int64_t size = A_BYTES[t], k = a->k, kg = k / 32;
    const __m256i m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256 acc[4][4], macc[4];  /* four sums a row (by the group's index mod 4): FMA latency, not one chain */
    for (int r = 0; r < m; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        float sv[4][8] __attribute__((aligned(32)));  /* D_g * d_x of group g, per row */
        if (t == A_Q6_K) {
            const __m128i sb = _mm_loadu_si128((const __m128i *)(blk + 192));
            const __m256 dv = _mm256_set1_ps(f16(blk + 208));
            const __m256i s16 = _mm256_cvtepi8_epi16(sb);
            for (int r = 0; r < m; r++) {
                const __m256 dd = _mm256_mul_ps(dv, _mm256_loadu_ps(a->d + r * kg + b * 8));
                _mm256_store_ps(sv[r], dd);
                const __m256i bsum = _mm256_loadu_si256((const __m256i *)(a->bs + r * (k / 16) + b * 16));
                const __m256 off = _mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_madd_epi16(s16, bsum), 5));
                macc[r] = _mm256_fnmadd_ps(off, dd, macc[r]);
            }
            for (int h = 0; h < 2; h++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i qb = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i u[4];
                u[0] = _mm256_or_si256(_mm256_and_si256(qa, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                u[1] = _mm256_or_si256(_mm256_and_si256(qb, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m15), _mm256_and_si256(qh, m30));
                u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m15),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
                for (int j = 0; j < 4; j++) {
                    const int g = 4 * h + j;  /* sub-scales 2g (values 0-15) and 2g + 1 (16-31) */
                    const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (2 * g + 1), 0x0101010101010101LL * (2 * g));
                    const __m256i sg = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sb, pick));
                    for (int r = 0; r < m; r++) {
                        const __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + r * k + b * 256 + 32 * g));
                        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], q), sg);
                        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sv[r][g]), acc[r][j]);
                    }
                }
            }
        } else {
            uint32_t u0, u1, u2;
            memcpy(&u0, blk + 4, 4);
            memcpy(&u1, blk + 8, 4);
            memcpy(&u2, blk + 12, 4);
            /* the 6-bit scales and minimums of the 8 groups, a byte each (k4_scale_min, 4 at a time) */
            const uint32_t sc_lo = u0 & 0x3f3f3f3f, mn_lo = u1 & 0x3f3f3f3f;
            const uint32_t sc_hi = (u2 & 0x0f0f0f0f) | ((u0 >> 2) & 0x30303030);
            const uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0f) | ((u1 >> 2) & 0x30303030);
            const __m256i sc8 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)(sc_lo | (uint64_t)sc_hi << 32)));
            const __m256i mn8 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)(mn_lo | (uint64_t)mn_hi << 32)));
            /* D_g = d * sc_g and M_g = -dmin * m_g: exact (an f16 times a 6-bit integer), as block_scales */
            const __m256 dg = _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(sc8));
            const __m256 mg = _mm256_mul_ps(_mm256_set1_ps(-f16(blk + 2)), _mm256_cvtepi32_ps(mn8));
            for (int r = 0; r < m; r++) {
                _mm256_store_ps(sv[r], _mm256_mul_ps(dg, _mm256_loadu_ps(a->d + r * kg + b * 8)));
                macc[r] = _mm256_fmadd_ps(mg, _mm256_loadu_ps(a->ds32 + r * kg + b * 8), macc[r]);
            }
            const uint8_t *qs = blk + (t == A_Q4_K ? 16 : 48);
            const __m256i qh = t == A_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(q4, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m15);
                if (t == A_Q5_K) {
                    const __m256i one = _mm256_set1_epi8(1);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
                }
                for (int r = 0; r < m; r++) {
                    const int8_t *q = a->q + r * k + b * 256 + 64 * c;
                    const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)), ones);
                    const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32))), ones);
                    acc[r][(2 * c) & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo), _mm256_broadcast_ss(&sv[r][2 * c]),
                                                          acc[r][(2 * c) & 3]);
                    acc[r][(2 * c + 1) & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi), _mm256_broadcast_ss(&sv[r][2 * c + 1]),
                                                              acc[r][(2 * c + 1) & 3]);
                }
            }
        }
    }
    for (int r = 0; r < m; r++)
        y[r * n] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                                     _mm256_add_ps(acc[r][2], acc[r][3])), macc[r]));
}
#define POOT_K8(T) POOT_CASE_ROWS(T, m, k8_rows, row, nb, a, y, n)
#else
#define POOT_K8(T) POOT_CASE_ROWS(T, m, q8_rows, row, nb, a, y, n)
#endif

#define POOT_Q8ROWS(T) POOT_CASE_ROWS(T, m, q8_rows, row, nb, a, y, n)

/* One weight row of type t times the m (1-4) rows of a. */
static void q8_row(int t, int m, const uint8_t *row, int64_t nb, const q8x_t *a, float *y, int64_t n) {
    switch (t) {
    POOT_Q8ROWS(A_Q4_0) POOT_Q8ROWS(A_Q4_1) POOT_Q8ROWS(A_Q8_0) POOT_Q8ROWS(A_Q5_0) POOT_Q8ROWS(A_Q5_1)
    POOT_Q8ROWS(A_IQ4_NL) POOT_K8(A_Q4_K) POOT_K8(A_Q5_K) POOT_K8(A_Q6_K) POOT_Q8ROWS(A_IQ4_XS)
    POOT_Q8ROWS(A_Q2_K) POOT_Q8ROWS(A_Q3_K)
    }
}

/* x[m, k] (k a multiple of 32) quantized per 32 values: q[m, k], d[m, k / 32], ds[m, k / 16] = d * sum of each
   16 q. d = amax / 127 and q = round-half-even(x * (1 / d)), in float32 (q = 0 where amax is 0). */
void poot_quantize_q8(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *ds) {
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, k, q + r * k, d + r * (k / 32), ds + r * (k / 16), NULL, NULL);
}

/* The activations of a product of type t from x [m, nb blocks]: allocated and quantized (rows spread over the
   threads); 0 and y [m, n] all NaN where there is no memory. */
static int q8_activations(int t, int64_t nb, const float *x, int64_t m, q8x_t *a, float *y, int64_t n, int threads) {
    const int64_t k = nb * (t >= A_Q4_K ? 256 : 32);
    if (!q8x_alloc(a, m, k)) {
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return 0;
    }
    #pragma omp parallel for num_threads(m > 1 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const q8x_t ar = q8x_from(a, r);
        quantize_row(x + r * k, k, ar.q, ar.d, ar.ds, ar.bs, ar.ds32);
    }
    return 1;
}

/* y[m, n] = x[m, nb * block] @ W^T for m <= 4 with x quantized to 8 bits first (the arguments of poot_gemv;
   type is an A_ id). */
void poot_gemv_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                  float *y, int threads) {
    q8x_t a;
    if (!q8_activations(type, nb, x, m, &a, y, n, threads)) return;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) q8_row(type, (int)m, w + o * row_bytes, nb, &a, y + o, n);
    q8x_free(&a);
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
    q8x_t a;
    if (!q8_activations(type, nb, x, m, &a, y, n, threads)) return;
    const int64_t k = a.k;
    int64_t panel = Q8_PANEL_BYTES / (k > 0 ? k : 1) / 4 * 4;
    if (panel < 4) panel = 4;
    int64_t chunk = (n + 4 * threads - 1) / (4 * threads);
    if (chunk > 64) chunk = 64;
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (n + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o0 = c * chunk, o1 = o0 + chunk < n ? o0 + chunk : n;
        for (int64_t p0 = 0; p0 < m; p0 += panel) {
            const int64_t p1 = p0 + panel < m ? p0 + panel : m;
            for (int64_t o = o0; o < o1; o++)
                for (int64_t r0 = p0; r0 < p1; r0 += 4) {
                    const q8x_t ar = q8x_from(&a, r0);
                    q8_row(type, (int)(p1 - r0 < 4 ? p1 - r0 : 4), w + o * row_bytes, nb, &ar, y + r0 * n + o, n);
                }
        }
    }
    q8x_free(&a);
}
