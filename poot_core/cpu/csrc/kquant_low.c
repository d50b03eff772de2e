/* Matrix products and dequantization for the low-bit GGUF types of 256-value super-blocks: Q2_K (84 bytes),
   Q3_K (110) and IQ4_XS (136), read straight from the memory-mapped blocks (layouts: ggml's block_q2_K,
   block_q3_K, block_iq4_xs).

   Every weight is dequantized exactly as ggml defines it: d * scale * q is exact in float32 for these types
   (at most 24 significant bits), so the order of those products does not matter, and Q2_K's "- min" is one
   rounding, as in ggml. Sums are float32. With AVX2 a block is decoded eight weights at a time in registers:
   Q2_K and Q3_K codes index a table of eight floats that already carries the 16-value group's scale (one
   permute gives eight weights; Q2_K with one row of x scales each group's q . x instead); IQ4_XS codes go
   through the code book as bytes, and each 32 of them times x is summed before its scale. Up to four rows of
   x share one decode of each block (decode steps); prefill dequantizes tiles of rows into a float32 buffer
   for torch's matmul (poot_dequant_kl). Without AVX2 a portable route dequantizes each block, then dots. */
#include "common.h"

enum { KL_Q2_K = 0, KL_Q3_K = 1, KL_IQ4_XS = 2 };
static const int64_t kl_size[3] = {84, 110, 136};
/* The non-linear 4-bit code book of IQ4_NL / IQ4_XS. */
static const int8_t kl_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if !POOT_AVX2
/* The 16 signed 6-bit scales of a Q3_K block (12 bytes at s): low nibbles from bytes 0-7 (low nibbles first,
   then high), top two bits from bytes 8-11 (scale g takes bits 2 * (g / 4) of byte 8 + g % 4). */
static inline int kl_q3_scale(const uint8_t *s, int g) {
    int lo = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
    int hi = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* The 8 signed 6-bit scales of an IQ4_XS block (scales_h: u16 at b + 2, scales_l: 4 bytes at b + 4). */
static inline int kl_iq4_scale(const uint8_t *b, int ib) {
    int hi = ((b[2] | (b[3] << 8)) >> (2 * ib)) & 3;
    return (((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | (hi << 4)) - 32;
}

/* One block dequantized into v[256] (the route without AVX2). */
static void kl_block(int type, const uint8_t *b, float *v) {
    if (type == KL_Q2_K) { /* scales[16] (scale | min << 4), qs[64], d, dmin */
        const float d = f16(b + 80), dmin = f16(b + 82);
        for (int e = 0; e < 256; e++) {
            const int n = e / 128, j = (e / 32) % 4, l = e % 32;
            const float dl = d * (float)(b[e / 16] & 15), ml = dmin * (float)(b[e / 16] >> 4);
            v[e] = dl * (float)((b[16 + 32 * n + l] >> (2 * j)) & 3) - ml;
        }
    } else if (type == KL_Q3_K) { /* hmask[32], qs[64], scales[12], d; a clear hmask bit subtracts 4 */
        const float d = f16(b + 108);
        for (int e = 0; e < 256; e++) {
            const int n = e / 128, j = (e / 32) % 4, l = e % 32;
            const int q = ((b[32 + 32 * n + l] >> (2 * j)) & 3) - (((b[l] >> (e / 32)) & 1) ? 0 : 4);
            v[e] = d * (float)kl_q3_scale(b + 96, e / 16) * (float)q;
        }
    } else { /* d, scales_h, scales_l[4], qs[128]: per 32 values 16 bytes, low nibbles then high nibbles */
        const float d = f16(b);
        for (int e = 0; e < 256; e++) {
            const int ib = e / 32, l = e % 32;
            const int q = l < 16 ? b[8 + 16 * ib + l] & 15 : b[8 + 16 * ib + l - 16] >> 4;
            v[e] = d * (float)kl_iq4_scale(b, ib) * (float)kl_iq4[q];
        }
    }
}

#endif

#if POOT_AVX2
#define KL_INLINE static inline __attribute__((always_inline))

/* Where one block's decoded weights go: m == 0 stores them to out; else they are multiplied by m rows of x
   (the block's 256 inputs at x, rows xs apart) into acc[row][one of A accumulators]. Q2_K with one row also
   uses xs16 (the sums of each 16 inputs, advanced per block) and macc (its minimum terms). */
typedef struct {
    const float *x;
    int64_t xs;
    float *out;
    const float *xs16;
    __m256 acc[4][4], macc;
} kl_sink;

/* Accumulators per row: enough independent sums to hide the multiply-add latency. */
#define KL_A(m) ((m) == 1 ? 4 : 2)

KL_INLINE void kl_emit(const int m, kl_sink *s, __m256 w, const int e) {
    if (m == 0) {
        _mm256_storeu_ps(s->out + e, w);
        return;
    }
    const int a = (e >> 3) % KL_A(m);
    for (int r = 0; r < m; r++) s->acc[r][a] = _mm256_fmadd_ps(w, _mm256_loadu_ps(s->x + r * s->xs + e), s->acc[r][a]);
}

/* The codes gathered into a stack buffer are read back with widening loads (load ports); without this the
   compiler forwards them through registers with shuffles, which compete with the lookups for the same ports. */
#define KL_FROM_MEMORY() __asm__ volatile("" ::: "memory")

static inline __m256i kl_u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* Q2_K: the weights of 16-value group g are dl_g * q - ml_g, q in 0..3 taken from bits 2j of qs[32n + l]. The
   table {dl*0 - ml, ..., dl*3 - ml} (one fused multiply-add: dl * q is exact, so this is ggml's single rounding)
   is looked up by the code bits directly: the in-lane permute reads only the two low bits of each index. With
   one row of x the table is not built: each group adds dl_g * (q . x) and the block's minimum terms come off
   as ml . xs16 (20% faster on an AVX2 EPYC, where building the tables waited on the scales). */
KL_INLINE void kl_q2k(const int m, const uint8_t *b, kl_sink *s) {
    float dl[16] __attribute__((aligned(32))), ml[16] __attribute__((aligned(32)));
    const __m128i sc = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(sc, low4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), low4);
    const __m256 d = _mm256_set1_ps(f16(b + 80)), nmin = _mm256_set1_ps(-f16(b + 82));
    _mm256_store_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
    _mm256_store_ps(dl + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_store_ps(ml, _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
    _mm256_store_ps(ml + 8, _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))));
    const __m256 codes = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    if (m == 1) {
        s->macc = _mm256_fmadd_ps(_mm256_load_ps(ml), _mm256_loadu_ps(s->xs16), s->macc);
        s->macc = _mm256_fmadd_ps(_mm256_load_ps(ml + 8), _mm256_loadu_ps(s->xs16 + 8), s->macc);
        s->xs16 += 16;
    }
#pragma GCC unroll 2
    for (int n = 0; n < 2; n++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i q0 = kl_u8x8(b + 16 + 32 * n + 16 * h), q1 = kl_u8x8(b + 24 + 32 * n + 16 * h);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const int g = 8 * n + 2 * j + h, e = 16 * g;
                const __m256i i0 = _mm256_srli_epi32(q0, 2 * j), i1 = _mm256_srli_epi32(q1, 2 * j);
                if (m == 1) {
                    const __m256 p = _mm256_fmadd_ps(_mm256_permutevar_ps(codes, i1), _mm256_loadu_ps(s->x + e + 8),
                                                     _mm256_mul_ps(_mm256_permutevar_ps(codes, i0),
                                                                   _mm256_loadu_ps(s->x + e)));
                    s->acc[0][g % 4] = _mm256_fmadd_ps(_mm256_broadcast_ss(dl + g), p, s->acc[0][g % 4]);
                } else {
                    const __m256 t = _mm256_fmadd_ps(_mm256_broadcast_ss(dl + g), codes, _mm256_broadcast_ss(ml + g));
                    kl_emit(m, s, _mm256_permutevar_ps(t, i0), e);
                    kl_emit(m, s, _mm256_permutevar_ps(t, i1), e + 8);
                }
            }
        }
}

/* The 16 scales of a Q3_K block times d, into dl (the portable route's kl_q3_scale for all g at once): the
   six bits of each put together in one 64-bit word per eight scales. */
static inline void kl_q3_scales(const uint8_t *b, float *dl) {
    uint64_t lo;
    uint32_t u;
    memcpy(&lo, b + 96, 8);
    memcpy(&u, b + 104, 4);
    const uint64_t nib = 0x0F0F0F0F0F0F0F0Full, two = 0x03030303u;
    const uint64_t s0 = (lo & nib) | (((u & two) | ((uint64_t)((u >> 2) & two) << 32)) << 4);
    const uint64_t s1 = ((lo >> 4) & nib) | ((((u >> 4) & two) | ((uint64_t)((u >> 6) & two) << 32)) << 4);
    const __m128i s = _mm_sub_epi8(_mm_set_epi64x((int64_t)s1, (int64_t)s0), _mm_set1_epi8(32));
    const __m256 d = _mm256_set1_ps(f16(b + 108));
    _mm256_store_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s))));
    _mm256_store_ps(dl + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)))));
}

/* Q3_K: the 3-bit code (2 low bits from qs, the third from hmask) of every weight is first gathered into one
   byte per weight with 32-byte-wide operations; the table dl_g * {-4, ..., 3} is then looked up by it. */
KL_INLINE void kl_q3k(const int m, const uint8_t *b, kl_sink *s) {
    float dl[16] __attribute__((aligned(32)));
    uint8_t code[256] __attribute__((aligned(32)));
    kl_q3_scales(b, dl);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b), three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
#pragma GCC unroll 2
    for (int n = 0; n < 2; n++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * n));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const int k = 4 * n + j; /* hmask bit of these 32 weights, moved to bit 2 of each byte */
            const __m256i hb = k >= 2 ? _mm256_srli_epi16(hm, k - 2) : _mm256_slli_epi16(hm, 2 - k);
            const __m256i c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), three),
                                              _mm256_and_si256(hb, four));
            _mm256_store_si256((__m256i *)(code + 32 * k), c);
        }
    }
    KL_FROM_MEMORY();
    const __m256 values = _mm256_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3);
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) {
        const __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(dl + g), values);
        kl_emit(m, s, _mm256_permutevar8x32_ps(t, kl_u8x8(code + 16 * g)), 16 * g);
        kl_emit(m, s, _mm256_permutevar8x32_ps(t, kl_u8x8(code + 16 * g + 8)), 16 * g + 8);
    }
}

/* IQ4_XS: the 4-bit codes go through the code book as bytes (one byte shuffle per 32 codes), then each
   eight widen to floats and take the sub-block's scale. */
KL_INLINE void kl_iq4xs(const int m, const uint8_t *b, kl_sink *s) {
    int8_t k[256] __attribute__((aligned(32)));
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kl_iq4)),
                  low4 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) { /* sub-blocks 2p and 2p + 1: 32 bytes of codes */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * p));
        const __m256i lo = _mm256_shuffle_epi8(book, _mm256_and_si256(q, low4));
        const __m256i hi = _mm256_shuffle_epi8(book, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
        /* element order: sub-block 2p low, 2p high, 2p + 1 low, 2p + 1 high */
        _mm256_store_si256((__m256i *)(k + 64 * p), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_store_si256((__m256i *)(k + 64 * p + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    KL_FROM_MEMORY();
    /* the 8 scales at once: nibble ib of scales_l, bits 2 ib of scales_h */
    uint32_t sl;
    memcpy(&sl, b + 4, 4);
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(b[2] | (b[3] << 8)),
                                         _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    float dl[8] __attribute__((aligned(32)));
    _mm256_store_ps(dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)),
                                      _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32)))));
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const __m256 scale = _mm256_broadcast_ss(dl + ib);
        __m256 part[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const int e = 32 * ib + 8 * c;
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(k + e))));
            if (m == 0) _mm256_storeu_ps(s->out + e, _mm256_mul_ps(scale, v));
            /* a product: the 32 codes times x first, then the scale (no rounding in codes * scale to lose) */
            for (int r = 0; r < m; r++) {
                const __m256 xv = _mm256_loadu_ps(s->x + r * s->xs + e);
                part[r] = c == 0 ? _mm256_mul_ps(v, xv) : _mm256_fmadd_ps(v, xv, part[r]);
            }
        }
        const int a = ib % KL_A(m > 0 ? m : 1);
        for (int r = 0; r < m; r++) s->acc[r][a] = _mm256_fmadd_ps(scale, part[r], s->acc[r][a]);
    }
}

KL_INLINE void kl_decode(const int type, const int m, const uint8_t *b, kl_sink *s) {
    if (type == KL_Q2_K) kl_q2k(m, b, s);
    else if (type == KL_Q3_K) kl_q3k(m, b, s);
    else kl_iq4xs(m, b, s);
}

/* y[r * n + o] for m (1..4) rows of x [m, nb * 256] and the weight rows o0 <= o < o1 (one thread's share);
   xs16: the sums of each 16 values of x (Q2_K, m == 1). */
KL_INLINE void kl_rows(const int type, const int m, const uint8_t *w, int64_t row_bytes, int64_t nb,
                       const float *x, const float *xs16, float *y, int64_t n, int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o++) {
        kl_sink s = {.x = x, .xs = nb * 256, .xs16 = xs16, .macc = _mm256_setzero_ps()};
        for (int r = 0; r < m; r++)
            for (int a = 0; a < KL_A(m); a++) s.acc[r][a] = _mm256_setzero_ps();
        const uint8_t *row = w + o * row_bytes;
        for (int64_t b = 0; b < nb; b++, s.x += 256) kl_decode(type, m, row + b * kl_size[type], &s);
        for (int r = 0; r < m; r++) {
            __m256 t = r == 0 ? s.macc : _mm256_setzero_ps();
            for (int a = 0; a < KL_A(m); a++) t = _mm256_add_ps(t, s.acc[r][a]);
            y[r * n + o] = hsum8(t);
        }
    }
}

/* One copy of kl_rows per type and row count, so that both are constants inside (the accumulators then stay
   in registers). The parallel region is outside: OpenMP outlines its body before constants propagate. */
#define KL_ROWS(T, M) \
    static void kl_rows_##T##_##M(const uint8_t *w, int64_t rb, int64_t nb, const float *x, const float *xs16, \
                                  float *y, int64_t n, int64_t o0, int64_t o1) { \
        kl_rows(T, M, w, rb, nb, x, xs16, y, n, o0, o1); \
    }
#define KL_ROWS_TYPE(T) KL_ROWS(T, 1) KL_ROWS(T, 2) KL_ROWS(T, 3) KL_ROWS(T, 4)
KL_ROWS_TYPE(KL_Q2_K)
KL_ROWS_TYPE(KL_Q3_K)
KL_ROWS_TYPE(KL_IQ4_XS)

typedef void (*kl_rows_fn)(const uint8_t *, int64_t, int64_t, const float *, const float *, float *, int64_t, int64_t,
                           int64_t);
static const kl_rows_fn kl_rows_table[3][4] = {
    {kl_rows_KL_Q2_K_1, kl_rows_KL_Q2_K_2, kl_rows_KL_Q2_K_3, kl_rows_KL_Q2_K_4},
    {kl_rows_KL_Q3_K_1, kl_rows_KL_Q3_K_2, kl_rows_KL_Q3_K_3, kl_rows_KL_Q3_K_4},
    {kl_rows_KL_IQ4_XS_1, kl_rows_KL_IQ4_XS_2, kl_rows_KL_IQ4_XS_3, kl_rows_KL_IQ4_XS_4},
};

static void kl_block_store(int type, const uint8_t *b, float *out) {
    kl_sink s = {.out = out};
    if (type == KL_Q2_K) kl_q2k(0, b, &s);
    else if (type == KL_Q3_K) kl_q3k(0, b, &s);
    else kl_iq4xs(0, b, &s);
}
#else
static void kl_rows_portable(int type, int64_t m, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,
                             const float *x, float *y, int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o++) {
        float v[256], acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t b = 0; b < nb; b++) {
            kl_block(type, w + o * row_bytes + b * kl_size[type], v);
            block_dot_rows(v, x, m, nb, b, acc);
        }
        for (int64_t r = 0; r < m; r++) y[r * n + o] = acc[r];
    }
}
#endif

/* y[m, n] = x[m, nb * 256] @ W^T, W given as n rows of nb blocks of `type` (0 Q2_K, 1 Q3_K, 2 IQ4_XS),
   row_bytes apart. Rows of x are taken four at a time (each block is decoded once per four); the weight rows
   are split evenly across the threads. */
void poot_gemv_kl(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                  float *y, int threads) {
    if (type < 0 || type > 2 || m < 1) return;
#if POOT_AVX2
    /* Q2_K's one-row route takes its minimum terms from the sums of each 16 values of that row (the last one
       when m % 4 == 1): nb * 64 bytes, 16 KB for rows of 65536 values. */
    const int64_t single = (m - 1) / 4 * 4;
    float xs16[type == KL_Q2_K && m % 4 == 1 ? nb * 16 : 1];
    if (type == KL_Q2_K && m % 4 == 1)
        for (int64_t i = 0; i < nb * 16; i++) {
            float t = 0.0f;
            for (int j = 0; j < 16; j++) t += x[single * nb * 256 + 16 * i + j];
            xs16[i] = t;
        }
#endif
    #pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t o0 = n * t / nt, o1 = n * (t + 1) / nt;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t mm = m - r0 < 4 ? m - r0 : 4;
#if POOT_AVX2
            kl_rows_table[type][mm - 1](w, row_bytes, nb, x + r0 * nb * 256, xs16, y + r0 * n, n, o0, o1);
#else
            kl_rows_portable(type, mm, w, row_bytes, n, nb, x + r0 * nb * 256, y + r0 * n, o0, o1);
#endif
        }
    }
}

/* out[rows, nb * 256] = the dequantized rows. */
void poot_dequant_kl(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, float *out,
                     int threads) {
    if (type < 0 || type > 2) return;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < rows; o++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + o * row_bytes + b * kl_size[type];
#if POOT_AVX2
            kl_block_store(type, blk, out + (o * nb + b) * 256);
#else
            kl_block(type, blk, out + (o * nb + b) * 256);
#endif
        }
}
