/* Matrix products and dequantization for the GGUF types of 32-value blocks (Q4_0, Q4_1, Q8_0), read
   straight from the memory-mapped blocks. */
#include "common.h"

/* One block of 32 values as floats (before the scale): q - offset for Q4_0/Q8_0, q for Q4_1. */
static inline void values(int type, const uint8_t *b, float *v) {
    if (type == 0) {
        for (int j = 0; j < 16; j++) { v[j] = (float)((b[2 + j] & 15) - 8); v[j + 16] = (float)((b[2 + j] >> 4) - 8); }
    } else if (type == 1) {
        for (int j = 0; j < 16; j++) { v[j] = (float)(b[4 + j] & 15); v[j + 16] = (float)(b[4 + j] >> 4); }
    } else {
        for (int j = 0; j < 32; j++) v[j] = (float)(int8_t)b[2 + j];
    }
}

#ifdef __AVX512F__
/* The 32 values of one Q8_0 block times x, folded to 16 lanes (before the block's scale). */
static inline __m512 q8_block_dot(const uint8_t *blk, const float *xb) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
}
#endif

static float row_dot(int type, const uint8_t *row, int64_t nb, const float *x, const float *xsum) {
    const int64_t size = type == 0 ? 18 : type == 1 ? 20 : 34;
#ifdef __AVX512F__
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
#else
    float acc = 0.0f, v[32];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * size;
        values(type, blk, v);
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += v[j] * x[b * 32 + j];
        acc += f16(blk) * s;
        if (type == 1) acc += f16(blk + 2) * xsum[b];
    }
    return acc;
#endif
}

/* y[m, n] = x[m, nb * 32] @ W^T, W given as n rows of nb blocks, row_bytes apart; xsum: scratch [m, nb]. */
void poot_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
               float *y, float *xsum, int threads) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += x[r * nb * 32 + b * 32 + j];
            xsum[r * nb + b] = s;
        }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++)
        for (int64_t r = 0; r < m; r++)
            y[r * n + o] = row_dot(type, w + o * row_bytes, nb, x + r * nb * 32, xsum + r * nb);
}

/* out[rows, nb * 32] = dequantized rows, exactly as ggml defines them (d * q, or d * q + m for Q4_1). */
void poot_dequant(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < rows; o++) {
        float v[32];
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + o * row_bytes + b * (type == 0 ? 18 : type == 1 ? 20 : 34);
            float d = f16(blk), mn = type == 1 ? f16(blk + 2) : 0.0f;
            values(type, blk, v);
            float *dst = out + o * nb * 32 + b * 32;
            for (int j = 0; j < 32; j++) dst[j] = type == 1 ? d * v[j] + mn : d * v[j];
        }
    }
}
