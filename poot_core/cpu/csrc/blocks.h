/* The GGUF block decoders of the 8-bit-activation products (q8dot.c) and the exact prefill panels (gemm.c):
   per block type (the A_ ids), a block's scales and each 32-value group's integer codes, so that a weight value
   is D * c (+ M), or for the types with 16-value sub-scales (D * s) * c (+ M * n). */
#ifndef POOT_BLOCKS_H
#define POOT_BLOCKS_H

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

/* The 8-bit activations of one product (q8dot.c): m rows of k values quantized per 32, in one allocation:
   q [m, k] int8; d [m, k / 32] scales; per 16 values ds = d * sum(q) and bs = sum(q) (int16); per 32 values
   ds32 = d * sum(q). */
typedef struct {
    int8_t *q;
    float *d, *ds, *ds32;
    int16_t *bs;
    int64_t k;
} q8x_t;

/* a's arrays for m rows of k values; 0 when there is no memory (then a holds nothing to free). */
static inline int q8x_alloc(q8x_t *a, int64_t m, int64_t k) {
    const int64_t floats = m * k / 32 + m * k / 16 + m * k / 32;
    char *mem = malloc(sizeof(float) * (size_t)floats + sizeof(int16_t) * (size_t)(m * k / 16) + (size_t)(m * k));
    if (!mem) return 0;
    a->d = (float *)mem;
    a->ds = a->d + m * k / 32;
    a->ds32 = a->ds + m * k / 16;
    a->bs = (int16_t *)(a->ds32 + m * k / 32);
    a->q = (int8_t *)(a->bs + m * k / 16);
    a->k = k;
    return 1;
}

static inline void q8x_free(q8x_t *a) { free(a->d); }

/* The same activations from row r on: what a call over rows r.. of the same x would have. */
static inline q8x_t q8x_from(const q8x_t *a, int64_t r) {
    q8x_t b = *a;
    b.q += r * a->k;
    b.d += r * (a->k / 32);
    b.ds += r * (a->k / 16);
    b.bs += r * (a->k / 16);
    b.ds32 += r * (a->k / 32);
    return b;
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

#endif
