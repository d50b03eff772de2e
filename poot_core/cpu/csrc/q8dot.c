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
#include "common.h"

/* The type ids (the first argument of poot_gemv_q8; packed_linear.Q8_TYPES maps names to them). */
enum { A_Q4_0, A_Q4_1, A_Q8_0, A_Q5_0, A_Q5_1, A_IQ4_NL, A_Q4_K, A_Q5_K, A_Q6_K, A_IQ4_XS, A_Q2_K, A_Q3_K };

static const int64_t A_BYTES[12] = {18, 20, 34, 22, 24, 18, 144, 176, 210, 136, 84, 110};
static const int8_t A_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int a_groups(int t) { return t >= A_Q4_K ? 8 : 1; }
static inline int a_has_min(int t) { return t == A_Q4_1 || t == A_Q5_1 || t == A_Q4_K || t == A_Q5_K || t == A_Q2_K; }
/* Types whose scales are per 16 values (integer sub-scales s_h / n_h); the others have one per 32. */
static inline int a_sub16(int t) { return t == A_Q6_K || t == A_Q2_K || t == A_Q3_K; }

/* The scales of one block, per 32-value group g: D[g], M[g]; per 16 values h: s[h], n[h]. */
typedef struct {
    float D[8], M[8];
    int16_t s[16], n[16];
} scales_t;

static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    *sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

static inline __attribute__((always_inline)) void block_scales(const int t, const uint8_t *b, scales_t *sc) {
    switch (t) {
    case A_Q4_0: case A_Q8_0: case A_Q5_0: case A_IQ4_NL:
        sc->D[0] = f16(b);
        return;
    case A_Q4_1: case A_Q5_1:
        sc->D[0] = f16(b);
        sc->M[0] = f16(b + 2);
        sc->n[0] = sc->n[1] = 1;
        return;
    case A_Q4_K: case A_Q5_K: {
        const float d = f16(b), dmin = f16(b + 2);
        for (int j = 0; j < 8; j++) {
            int s, m;
            k4_scale_min(b + 4, j, &s, &m);
            sc->D[j] = d * (float)s;  /* exact: an f16 times a 6-bit integer */
            sc->M[j] = -dmin * (float)m;
            sc->n[2 * j] = sc->n[2 * j + 1] = 1;
        }
        return;
    }
    case A_Q6_K: {
        const float d = f16(b + 208);
        for (int g = 0; g < 8; g++) sc->D[g] = d;
        for (int h = 0; h < 16; h++) sc->s[h] = (int8_t)b[192 + h];
        return;
    }
    case A_IQ4_XS: {
        const float d = f16(b);
        const int high = b[2] | (b[3] << 8);
        for (int g = 0; g < 8; g++) {
            const int ls = ((b[4 + g / 2] >> (4 * (g & 1))) & 15) | (((high >> (2 * g)) & 3) << 4);
            sc->D[g] = d * (float)(ls - 32);
        }
        return;
    }
    case A_Q2_K: {
        const float d = f16(b + 80), dmin = f16(b + 82);
        for (int g = 0; g < 8; g++) {
            sc->D[g] = d;
            sc->M[g] = -dmin;
        }
        for (int h = 0; h < 16; h++) {
            sc->s[h] = b[h] & 15;
            sc->n[h] = b[h] >> 4;
        }
        return;
    }
    default: { /* A_Q3_K: 6-bit scales, low nibbles in bytes 0-7, top two bits in bytes 8-11 */
        const float d = f16(b + 108);
        for (int g = 0; g < 8; g++) sc->D[g] = d;
        for (int h = 0; h < 16; h++) {
            const int lo = h < 8 ? b[96 + h] & 15 : b[96 + h - 8] >> 4;
            const int hi = (b[96 + 8 + (h & 3)] >> (2 * (h >> 2))) & 3;
            sc->s[h] = (int16_t)((lo | (hi << 4)) - 32);
        }
        return;
    }
    }
}

/* The 32 integer codes of group g of block b (portable). */
static inline __attribute__((always_inline)) void group_codes(const int t, const uint8_t *b, int g, int8_t *c) {
    for (int l = 0; l < 32; l++) {
        int v;
        switch (t) {
        case A_Q4_0: v = (l < 16 ? b[2 + l] & 15 : b[2 + l - 16] >> 4) - 8; break;
        case A_Q4_1: v = l < 16 ? b[4 + l] & 15 : b[4 + l - 16] >> 4; break;
        case A_Q8_0: v = (int8_t)b[2 + l]; break;
        case A_Q5_0: case A_Q5_1: {
            const int at = t == A_Q5_0 ? 6 : 8;
            uint32_t qh;
            memcpy(&qh, b + at - 4, 4);
            v = (l < 16 ? b[at + l] & 15 : b[at + l - 16] >> 4) | (int)((qh >> l) & 1) << 4;
            if (t == A_Q5_0) v -= 16;
            break;
        }
        case A_IQ4_NL: v = A_IQ4[l < 16 ? b[2 + l] & 15 : b[2 + l - 16] >> 4]; break;
        case A_Q4_K: v = (g & 1) ? b[16 + 32 * (g / 2) + l] >> 4 : b[16 + 32 * (g / 2) + l] & 15; break;
        case A_Q5_K:
            v = ((g & 1) ? b[48 + 32 * (g / 2) + l] >> 4 : b[48 + 32 * (g / 2) + l] & 15) | ((b[16 + l] >> g) & 1) << 4;
            break;
        case A_Q6_K: {
            const int h = g / 4, j = g % 4;
            const int lo = j < 2 ? b[64 * h + 32 * j + l] & 15 : b[64 * h + 32 * (j - 2) + l] >> 4;
            v = (lo | ((b[128 + 32 * h + l] >> (2 * j)) & 3) << 4) - 32;
            break;
        }
        case A_IQ4_XS: v = A_IQ4[l < 16 ? b[8 + 16 * g + l] & 15 : b[8 + 16 * g + l - 16] >> 4]; break;
        case A_Q2_K: v = (b[16 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3; break;
        default: /* A_Q3_K: a clear hmask bit subtracts 4 */
            v = ((b[32 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3) - (((b[l] >> g) & 1) ? 0 : 4);
            break;
        }
        c[l] = (int8_t)v;
    }
}

#if POOT_AVX2
/* 16 packed bytes as 32 nibbles: values 0-15 the low nibbles, 16-31 the high ones. */
static inline __m256i nibbles32(const uint8_t *q) {
    const __m128i p = _mm_loadu_si128((const __m128i *)q), m15 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m15), _mm_and_si128(p, m15));
}

/* 0xff in byte j where bit j of bits is set. */
static inline __m256i bytes_of_bits(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
}

/* group_codes in one register. */
static inline __attribute__((always_inline)) __m256i group_codes_v(const int t, const uint8_t *b, int g) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    switch (t) {
    case A_Q4_0: return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    case A_Q4_1: return nibbles32(b + 4);
    case A_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case A_Q5_0: case A_Q5_1: {
        const int at = t == A_Q5_0 ? 6 : 8;
        uint32_t qh;
        memcpy(&qh, b + at - 4, 4);
        const __m256i v = _mm256_or_si256(nibbles32(b + at), _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(16)));
        return t == A_Q5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
    }
    case A_IQ4_NL: case A_IQ4_XS: {
        const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)A_IQ4));
        return _mm256_shuffle_epi8(book, nibbles32(t == A_IQ4_NL ? b + 2 : b + 8 + 16 * g));
    }
    case A_Q4_K: case A_Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (t == A_Q4_K ? 16 : 48) + 32 * (g / 2)));
        __m256i v = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(q, 4) : q, m15);
        if (t == A_Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, g), _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
        }
        return v;
    }
    case A_Q6_K: {
        const int h = g / 4, j = g % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (j & 1)));
        const __m256i lo = _mm256_and_si256(j < 2 ? ql : _mm256_srli_epi16(ql, 4), m15);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), m3);
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    case A_Q2_K:
        return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g / 4))),
                                                  2 * (g % 4)), m3);
    default: { /* A_Q3_K */
        const __m256i low = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (g / 4))), 2 * (g % 4)), m3);
        const __m256i bit = _mm256_set1_epi8((char)(1 << g));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), bit), bit);
        return _mm256_sub_epi8(low, _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
    }
    }
}
#endif

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
