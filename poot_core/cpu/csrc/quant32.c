/* Matrix products and dequantization for the GGUF types of 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
   IQ4_NL), read straight from the memory-mapped blocks. Every block is d * c (+ m for Q4_1 and Q5_1) with an
   f16 scale d, an f16 minimum m and 32 integer codes c that fit in int8. */
#include "common.h"

/* The type ids (the first argument of poot_gemv and poot_dequant; packed_linear.C_TYPES maps names to them). */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 6, Q5_1 = 7, IQ4_NL = 8 };

static inline int64_t block_bytes(int type) {
    switch (type) {
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q5_0: return 22;
    case Q5_1: return 24;
    default: return 18; /* Q4_0, IQ4_NL */
    }
}

/* Where the codes start: 16 bytes of nibbles (value j in the low nibble of byte j, value j + 16 in its high
   nibble), or Q8_0's 32 bytes. Q5_0 and Q5_1 keep the fifth bits of the 32 values in a uint32 before them. */
static inline int codes_at(int type) { return type == Q4_1 ? 4 : type == Q5_0 ? 6 : type == Q5_1 ? 8 : 2; }
static inline int has_min(int type) { return type == Q4_1 || type == Q5_1; }

/* The non-linear code book of IQ4_NL (ggml's kvalues_iq4nl). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The 32 codes of one block. */
static inline void codes(int type, const uint8_t *b, int8_t *c) {
    const uint8_t *q = b + codes_at(type);
    if (type == Q8_0) {
        memcpy(c, q, 32);
        return;
    }
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) memcpy(&qh, b + codes_at(type) - 4, 4);
    const int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
        const int lo = q[j] & 15, hi = q[j] >> 4;
        if (type == IQ4_NL) {
            c[j] = IQ4_VALUES[lo];
            c[j + 16] = IQ4_VALUES[hi];
        } else {
            c[j] = (int8_t)((lo | (int)((qh >> j) & 1) << 4) - offset);
            c[j + 16] = (int8_t)((hi | (int)((qh >> (j + 16)) & 1) << 4) - offset);
        }
    }
}

#ifdef __AVX512F__
/* The 32 values of one Q8_0 block times x, folded to 16 lanes (before the block's scale). */
static inline __m512 q8_block_dot(const uint8_t *blk, const float *xb) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
}


/* One row times one x for Q4_0, Q4_1 and Q8_0 (the first kernels, kept as they were measured). */
static float row_dot512(int type, const uint8_t *row, int64_t nb, const float *x, const float *xsum) {
    const int64_t size = block_bytes(type);
    /* Two accumulators so consecutive blocks do not wait on each other's multiply-add. */
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    if (type != 2) {
        /* 4-bit codes become floats through a 16-entry table (one permute, which reads only the index's low
           4 bits, so the low nibble needs no mask); the block's f16 scale (and Q4_1's minimum) convert together. */
        const __m512 table = type == 0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                       : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m128 macc = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * size;
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (type == 0 ? 2 : 4))));
            __m512 lo = _mm512_permutexvar_ps(q, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
            const float *xb = x + b * 32;
            __m512 v = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
            int32_t dm;
            memcpy(&dm, blk, 4);
            __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(type == 1 ? dm : dm & 0xffff)); /* d, m */
            if (b & 1) acc1 = _mm512_fmadd_ps(_mm512_broadcastss_ps(scales), v, acc1);
            else acc0 = _mm512_fmadd_ps(_mm512_broadcastss_ps(scales), v, acc0);
            if (type == 1) macc = _mm_fmadd_ss(_mm_movehdup_ps(scales), _mm_load_ss(xsum + b), macc);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + _mm_cvtss_f32(macc);
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *b0 = row + b * size, *b1 = b0 + size;
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(f16(b0)), q8_block_dot(b0, x + b * 32), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_set1_ps(f16(b1)), q8_block_dot(b1, x + b * 32 + 32), acc1);
    }
    for (; b < nb; b++) {
        const uint8_t *b0 = row + b * size;
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(f16(b0)), q8_block_dot(b0, x + b * 32), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* row_dot512 for R rows of x at once (1 < R <= 8; the rows k values apart, their sums of 32 nb apart, results
   n apart): each block is decoded once for all R rows, and each row's sums are row_dot512's (the same products
   of the same blocks in the same order into its own acc0, acc1 and macc), so each row of y is bit for bit what
   row_dot512 gives that row alone. */
static inline __attribute__((always_inline)) void rows_dot512(const int type, const int R, const uint8_t *row,
                                                              int64_t nb, const float *x, int64_t k,
                                                              const float *xsum, float *y, int64_t n) {
    const int64_t size = block_bytes(type);
    __m512 acc0[8], acc1[8];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    if (type != 2) {
        const __m512 table = type == 0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                       : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m128 macc[8];
        for (int r = 0; r < R; r++) macc[r] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * size;
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (type == 0 ? 2 : 4))));
            __m512 lo = _mm512_permutexvar_ps(q, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
            int32_t dm;
            memcpy(&dm, blk, 4);
            __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(type == 1 ? dm : dm & 0xffff)); /* d, m */
            const __m512 d = _mm512_broadcastss_ps(scales);
            const __m128 mn = _mm_movehdup_ps(scales);
            for (int r = 0; r < R; r++) {
                const float *xb = x + r * k + b * 32;
                __m512 v = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
                if (b & 1) acc1[r] = _mm512_fmadd_ps(d, v, acc1[r]);
                else acc0[r] = _mm512_fmadd_ps(d, v, acc0[r]);
                if (type == 1) macc[r] = _mm_fmadd_ss(mn, _mm_load_ss(xsum + r * nb + b), macc[r]);
            }
        }
        for (int r = 0; r < R; r++)
            y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + _mm_cvtss_f32(macc[r]);
        return;
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *b0 = row + b * size, *b1 = b0 + size;
        const __m512 d0 = _mm512_set1_ps(f16(b0)), d1 = _mm512_set1_ps(f16(b1));
        const __m512 lo0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b0 + 2))));
        const __m512 hi0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b0 + 18))));
        const __m512 lo1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b1 + 2))));
        const __m512 hi1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b1 + 18))));
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * k + b * 32;
            acc0[r] = _mm512_fmadd_ps(d0, _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xb + 16),
                                                          _mm512_mul_ps(lo0, _mm512_loadu_ps(xb))), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(d1, _mm512_fmadd_ps(hi1, _mm512_loadu_ps(xb + 48),
                                                          _mm512_mul_ps(lo1, _mm512_loadu_ps(xb + 32))), acc1[r]);
        }
    }
    for (; b < nb; b++) {
        const uint8_t *b0 = row + b * size;
        const __m512 d0 = _mm512_set1_ps(f16(b0));
        const __m512 lo0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b0 + 2))));
        const __m512 hi0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b0 + 18))));
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * k + b * 32;
            acc0[r] = _mm512_fmadd_ps(d0, _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xb + 16),
                                                          _mm512_mul_ps(lo0, _mm512_loadu_ps(xb))), acc0[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

/* rows_dot512 for any number of rows: eight at a time, then four, two, and a last one through row_dot512. */
static void rows_any512(int type, const uint8_t *row, int64_t nb, const float *x, int64_t m, const float *xsum,
                        float *y, int64_t n) {
    const int64_t k = nb * 32;
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) rows_dot512(type, 8, row, nb, x + r * k, k, xsum + r * nb, y + r * n, n);
    if (r + 4 <= m) {
        rows_dot512(type, 4, row, nb, x + r * k, k, xsum + r * nb, y + r * n, n);
        r += 4;
    }
    if (r + 2 <= m) {
        rows_dot512(type, 2, row, nb, x + r * k, k, xsum + r * nb, y + r * n, n);
        r += 2;
    }
    if (r < m) y[r * n] = row_dot512(type, row, nb, x + r * k, xsum + r * nb);
}
#endif

#if POOT_AVX2
/* The 32 codes of one block as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31). 4- and 5-bit codes
   are widened straight from memory to 32-bit lanes (low nibble: & 15, high: >> 4), Q5's fifth bit shifted in
   per lane; IQ4_NL's go through its 16-entry code book (a byte shuffle). With `raw`, Q4_0 and Q5_0 codes keep
   their offset (8, 16): the product takes offset * d * sum(x) off instead. */
static inline __attribute__((always_inline)) void codes_f32(const int type, const uint8_t *b, const int raw,
                                                            __m256 *f) {
    const uint8_t *q = b + codes_at(type);
    if (type == Q8_0) {
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
        return;
    }
    if (type == IQ4_NL) {
        const __m128i book = _mm_loadu_si128((const __m128i *)IQ4_VALUES), m15 = _mm_set1_epi8(15);
        const __m128i packed = _mm_loadu_si128((const __m128i *)q);
        int8_t c[32] __attribute__((aligned(32)));
        _mm_store_si128((__m128i *)c, _mm_shuffle_epi8(book, _mm_and_si128(packed, m15)));
        _mm_store_si128((__m128i *)(c + 16), _mm_shuffle_epi8(book, _mm_and_si128(_mm_srli_epi16(packed, 4), m15)));
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * i))));
        return;
    }
    const __m256i m15 = _mm256_set1_epi32(15);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i v[4] = {_mm256_and_si256(a, m15), _mm256_and_si256(c, m15), _mm256_srli_epi32(a, 4),
                    _mm256_srli_epi32(c, 4)};
    if (type == Q5_0 || type == Q5_1) {
        /* bit j of qh is value j's fifth bit: shifted 4 left first, lane j's shift by j leaves it at bit 4 */
        uint32_t qh;
        memcpy(&qh, q - 4, 4);
        const __m256i lo = _mm256_set1_epi32((int)((qh & 0xffff) << 4));
        const __m256i hi = _mm256_set1_epi32((int)((qh >> 16) << 4));
        const __m256i s0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i s1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
        const __m256i bit = _mm256_set1_epi32(16);
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_srlv_epi32(lo, s0), bit));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_srlv_epi32(lo, s1), bit));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_srlv_epi32(hi, s0), bit));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srlv_epi32(hi, s1), bit));
    }
    const int offset = raw ? 0 : type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
    for (int i = 0; i < 4; i++)
        f[i] = _mm256_cvtepi32_ps(offset ? _mm256_sub_epi32(v[i], _mm256_set1_epi32(offset)) : v[i]);
}

/* What a block adds per sum(x) when its codes are read raw: the minimum, or -offset * d. */
static inline float raw_min(int type, const uint8_t *blk) {
    return has_min(type) ? f16(blk + 2) : type == Q4_0 ? -8.0f * f16(blk) : type == Q5_0 ? -16.0f * f16(blk) : 0.0f;
}

/* One weight row times m x rows (m <= 4; both constants in each instantiation below): each block is decoded
   once and dotted with every x row, y[r * n] = sum_b d_b * (c_b . x_rb) + m_b * sum(x_rb), with m_b the
   minimum or, for raw Q4_0 / Q5_0 codes, -offset * d_b. */
static inline __attribute__((always_inline)) void rows256(const int type, const int m, const uint8_t *row,
                                                          int64_t nb, const float *x, const float *xsum, float *y,
                                                          int64_t n) {
    const int64_t size = block_bytes(type), k = nb * 32;
    __m256 acc[4];
    float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        __m256 f[4];
        codes_f32(type, blk, 1, f);
        const __m256 d = _mm256_set1_ps(f16(blk));
        const float mn = raw_min(type, blk);
        for (int r = 0; r < m; r++) {
            const float *xb = x + r * k + b * 32;
            const __m256 p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
            const __m256 q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24),
                                             _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
            acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(p, q), acc[r]);
            if (type != Q8_0 && type != IQ4_NL) macc[r] += mn * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < m; r++) y[r * n] = hsum8(acc[r]) + macc[r];
}

#define POOT_ROWS256(T) POOT_CASE_ROWS(T, m, rows256, row, nb, x, xsum, y, n)

static void rows_dot256(int type, int m, const uint8_t *row, int64_t nb, const float *x, const float *xsum,
                        float *y, int64_t n) {
    switch (type) {
    POOT_ROWS256(Q4_0)
    POOT_ROWS256(Q4_1)
    POOT_ROWS256(Q8_0)
    POOT_ROWS256(Q5_0)
    POOT_ROWS256(Q5_1)
    POOT_ROWS256(IQ4_NL)
    }
}

/* rows256 for eight rows of x at once (serving steps, poot_gemv_many): each block is decoded once for all
   eight, and each row's sums are rows256's: the same products of the same blocks in the same order into its
   acc, and the minimum's terms, summed apart in block order (a lane per row of macc: the fused multiply-add
   rows256's macc[r] += mn * xsum compiles to), added last. So each row of y is bit for bit what rows256 gives
   it alone. xsum_t: the sums of x transposed, xsum_t[b * 8 + r]. */
static inline __attribute__((always_inline)) void rows256_8(const int type, const uint8_t *row, int64_t nb,
                                                            const float *x, const float *xsum_t, float *y,
                                                            int64_t n) {
    const int64_t size = block_bytes(type), k = nb * 32;
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        __m256 f[4];
        codes_f32(type, blk, 1, f);
        const __m256 d = _mm256_set1_ps(f16(blk));
        for (int r = 0; r < 8; r++) {
            const float *xb = x + r * k + b * 32;
            const __m256 p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
            const __m256 q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24),
                                             _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
            acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(p, q), acc[r]);
        }
    }
    float macc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (type != Q8_0 && type != IQ4_NL) {
        __m256 mv = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++)
            mv = _mm256_fmadd_ps(_mm256_set1_ps(raw_min(type, row + b * size)), _mm256_loadu_ps(xsum_t + b * 8), mv);
        _mm256_storeu_ps(macc, mv);
    }
    for (int r = 0; r < 8; r++) y[r * n] = hsum8(acc[r]) + macc[r];
}

static void rows_dot256_8(int type, const uint8_t *row, int64_t nb, const float *x, const float *xsum_t, float *y,
                          int64_t n) {
    switch (type) {
    case Q4_0: rows256_8(Q4_0, row, nb, x, xsum_t, y, n); return;
    case Q4_1: rows256_8(Q4_1, row, nb, x, xsum_t, y, n); return;
    case Q8_0: rows256_8(Q8_0, row, nb, x, xsum_t, y, n); return;
    case Q5_0: rows256_8(Q5_0, row, nb, x, xsum_t, y, n); return;
    case Q5_1: rows256_8(Q5_1, row, nb, x, xsum_t, y, n); return;
    case IQ4_NL: rows256_8(IQ4_NL, row, nb, x, xsum_t, y, n); return;
    }
}

/* Bytes of weight rows a chunk of poot_gemv_many holds: they stay in the core's cache while every group of x
   rows meets them, so W is read from memory once per call. */
#define MANY_CHUNK_BYTES (32 * 1024)

/* poot_gemv_many's AVX2 route: the sums of x once for the call (xsum for groups of 1-4 rows, xsum_t
   transposed per group of 8), then chunks of W's rows, spread over the threads as they come free, each meeting
   x eight rows at a time (the rest four at a time, then 1-3). */
static void many256(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                    float *y, int threads) {
    const int64_t eights = m / 8;
    float *xsum = sums_of_32(x, m * nb);
    float *xsum_t = malloc(sizeof(float) * (size_t)(eights * nb * 8 + 1));
    if (!xsum || !xsum_t) {
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        free(xsum);
        free(xsum_t);
        return;
    }
    for (int64_t g = 0; g < eights; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++) xsum_t[(g * nb + b) * 8 + r] = xsum[(g * 8 + r) * nb + b];
    int64_t chunk = MANY_CHUNK_BYTES / (row_bytes > 0 ? row_bytes : 1);
    const int64_t share = (n + 4 * threads - 1) / (4 * threads);  /* a few chunks a thread */
    if (chunk > share) chunk = share;
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (n + chunk - 1) / chunk, k = nb * 32;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o0 = c * chunk, o1 = (n - o0 < chunk) ? n : o0 + chunk;
        for (int64_t g = 0; g < eights; g++)
            for (int64_t o = o0; o < o1; o++)
                rows_dot256_8(type, w + o * row_bytes, nb, x + g * 8 * k, xsum_t + g * nb * 8, y + g * 8 * n + o, n);
        for (int64_t r0 = eights * 8; r0 < m; r0 += 4) {
            const int64_t group = (m - r0 < 4) ? m - r0 : 4;
            for (int64_t o = o0; o < o1; o++)
                rows_dot256(type, (int)group, w + o * row_bytes, nb, x + r0 * k, xsum + r0 * nb, y + r0 * n + o, n);
        }
    }
    free(xsum);
    free(xsum_t);
}

/* One block, dequantized into dst[32]: d * c, or (d * c rounded) + m. */
static inline __attribute__((always_inline)) void dequant256(const int type, const uint8_t *blk, float *dst) {
    __m256 f[4];
    codes_f32(type, blk, 0, f);
    const __m256 d = _mm256_set1_ps(f16(blk)), mn = _mm256_set1_ps(has_min(type) ? f16(blk + 2) : 0.0f);
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_mul_ps(d, f[i]);
        if (has_min(type)) {
            POOT_ROUNDED(v);
            v = _mm256_add_ps(v, mn);
        }
        _mm256_storeu_ps(dst + 8 * i, v);
    }
}

#define POOT_DEQUANT256(T)                                                               \
    case T:                                                                              \
        for (int64_t b = 0; b < nb; b++) dequant256(T, row + b * block_bytes(T), dst + 32 * b); \
        return;

static void dequant_row256(int type, const uint8_t *row, int64_t nb, float *dst) {
    switch (type) {
    POOT_DEQUANT256(Q4_0)
    POOT_DEQUANT256(Q4_1)
    POOT_DEQUANT256(Q8_0)
    POOT_DEQUANT256(Q5_0)
    POOT_DEQUANT256(Q5_1)
    POOT_DEQUANT256(IQ4_NL)
    }
}
#endif

#if !POOT_AVX2
/* One row times one x, without vector instructions. */
static float row_dot(int type, const uint8_t *row, int64_t nb, const float *x, const float *xsum) {
    const int64_t size = block_bytes(type);
    float acc = 0.0f;
    int8_t c[32];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        codes(type, blk, c);
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += (float)c[j] * x[b * 32 + j];
        acc += f16(blk) * s;
        if (has_min(type)) acc += f16(blk + 2) * xsum[b];
    }
    return acc;
}
#endif

/* y[m, n] = x[m, nb * 32] @ W^T for m <= 4, W given as n rows of nb blocks, row_bytes apart. */
void poot_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
               float *y, int threads) {
    float *xsum = sums_of_32(x, m * nb);  /* sum(x) per block, for the minimum */
    if (!xsum) {
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
#ifdef __AVX512F__
    if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < n; o++) rows_any512(type, w + o * row_bytes, nb, x, m, xsum, y + o, n);
        free(xsum);
        return;
    }
#endif
#if POOT_AVX2
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) rows_dot256(type, (int)m, w + o * row_bytes, nb, x, xsum, y + o, n);
#else
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++)
        for (int64_t r = 0; r < m; r++)
            y[r * n + o] = row_dot(type, w + o * row_bytes, nb, x + r * nb * 32, xsum + r * nb);
#endif
    free(xsum);
}

/* y[m, n] = x[m, nb * 32] @ W^T for any m (the rows of a serving step), each row bit for bit what poot_gemv
   gives that row alone. */
void poot_gemv_many(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x,
                    int64_t m, float *y, int threads) {
#if POOT_AVX2
#ifdef __AVX512F__
    if (type != Q4_0 && type != Q4_1 && type != Q8_0)  /* those three take poot_gemv's rows_any512 */
#endif
    {
        many256(type, w, row_bytes, n, nb, x, m, y, threads);
        return;
    }
#endif
    poot_gemv(type, w, row_bytes, n, nb, x, m, y, threads);  /* its other routes take one row at a time */
}

/* out[rows, nb * 32] = the dequantized rows, bit for bit as ggml defines them: d * c, or (d * c) + m with the
   product rounded first. */
void poot_dequant(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < rows; o++) {
        float *dst = out + o * nb * 32;
#if POOT_AVX2
        dequant_row256(type, w + o * row_bytes, nb, dst);
#else
        int8_t c[32];
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + o * row_bytes + b * block_bytes(type);
            const float d = f16(blk), mn = has_min(type) ? f16(blk + 2) : 0.0f;
            codes(type, blk, c);
            for (int j = 0; j < 32; j++) {
                float v = d * (float)c[j];
                if (has_min(type)) {
                    POOT_ROUNDED(v);
                    v += mn;
                }
                dst[32 * b + j] = v;
            }
        }
#endif
    }
}
