"""x @ W^T for a packed W, computed from the packed bytes, never from a float copy of the whole matrix.

Routes:
- GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K: a small C kernel, built once per machine with the system C
  compiler and cached, reads the memory-mapped blocks directly. For a few rows (decode) Q4_0/Q4_1/Q8_0 compute
  y = sum_b d_b * (q_b . x_b) + m_b * sum(x_b) per output row with AVX-512 (float32), and the K-quants decode
  each 256-value super-block to floats in L1 and dot it; for many rows (prefill) tiles of rows are dequantized
  into a reused float32 buffer for torch's matmul.
- every other layout and type, or no C compiler: tiles of a few MB are dequantized by
  poot_core.checkpoint.quant.dequantize (vectorized torch) and multiplied with torch's matmul.
All routes multiply exactly dequantized weights with float32 accumulation; they differ only in summation order.
Set POOT_CPU_KERNELS=0 to force the torch route. The C library is built by poot_core.cpu.c_kernels.

`fast=True` is an explicit, less exact option for the 4-bit GGUF types with an affine form (Q4_0, Q4_1, Q4_K):
their codes are re-laid once, losslessly, into torch's packed int4 CPU format (same 4 bits per weight) and the
product runs in torch's int4 kernel with bfloat16 activations and scales (about 1e-3 relative error). On the
2-core AVX-512 development machine that kernel is far slower than the C route (6 ms against 0.03 ms for a
1536 x 576 matrix-vector product), so it is not the default anywhere.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.checkpoint.quant import gguf_blocks as gb
from poot_core.cpu.c_kernels import kernels

TILE_BYTES = 4 << 20
# Up to this many input rows the fused kernel (which re-reads each weight row once per input row, from cache)
# beats dequantize-then-matmul.
FUSED_MAX_ROWS = 4
# GGUF type -> (elements, bytes) per block. FUSED_MAX_ROWS bounds the K-quant kernel's accumulators too.
C_TYPES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float f16(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

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
            v[e] = dl * (float)q - ml;
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

/* y[m, n] = x[m, nb * 256] @ W^T for the K-quant types: each block is decoded to floats in L1, then dotted
   (one x takes the vector routes above). */
void poot_gemv_k(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x, int64_t m,
                 float *y, int threads) {
#ifdef __AVX512F__
    if (m == 1 && type == 5) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < n; o++) y[o] = row_dot_q6k(w + o * row_bytes, nb, x);
        return;
    }
    if (m == 1) {
        float *xsum32 = malloc(sizeof(float) * (size_t)(nb * 8 + 1));
        if (xsum32) {
            for (int64_t i = 0; i < nb * 8; i++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[32 * i + j];
                xsum32[i] = s;
            }
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t o = 0; o < n; o++) y[o] = row_dot_q45k(type, w + o * row_bytes, nb, x, xsum32);
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
            for (int64_t r = 0; r < m; r++) {
                const float *xb = x + r * nb * 256 + b * 256;
                float s = 0.0f;
                for (int j = 0; j < 256; j++) s += v[j] * xb[j];
                acc[r] += s;
            }
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

/* y[m, n] = x[m, k] @ W^T for W stored as 16-bit floats [n, k] (bf16, or f16 when half != 0), rows
   row_elems apart: each weight is widened exactly to float32 in registers and summed in float32, so the
   result is that of the float32 product, read at the 16-bit weights' memory cost. */
static inline float wide16(uint16_t v, int half) {
    if (half) { uint8_t b[2]; memcpy(b, &v, 2); return f16(b); }
    uint32_t bits = (uint32_t)v << 16; float f; memcpy(&f, &bits, 4); return f;
}

void poot_gemv16(const uint16_t *w, int64_t row_elems, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                 int half, int threads) {
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
"""

_TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of this module's C functions (called by poot_core.cpu.c_kernels once it loads them)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.poot_gemv.argtypes = [i32, p, i64, i64, i64, p, i64, p, p, i32]
    lib.poot_dequant.argtypes = [i32, p, i64, i64, i64, p, i32]
    lib.poot_gemv_k.argtypes = [i32, p, i64, i64, i64, p, i64, p, i32]
    lib.poot_dequant_k.argtypes = [i32, p, i64, i64, i64, p, i32]
    lib.poot_gemv16.argtypes = [p, i64, i64, i64, p, i64, p, i32, i32]
    for fn in (lib.poot_gemv, lib.poot_dequant, lib.poot_gemv_k, lib.poot_dequant_k, lib.poot_gemv16):
        fn.restype = None


_plans: weakref.WeakKeyDictionary[PackedWeight, tuple[int, int, int, int, int]] = weakref.WeakKeyDictionary()


def _plan(w: PackedWeight) -> tuple[int, int, int, int, int]:
    """(type id, address of the blocks, bytes per row, rows, blocks per row), worked out once per weight."""
    plan = _plans.get(w)
    if plan is None:
        blocks = w.parts["blocks"]
        elements = C_TYPES[w.meta["type"]][0]
        plan = (_TYPE_IDS[w.meta["type"]], blocks.data_ptr(), blocks.stride(0), w.shape[0], w.shape[1] // elements)
        _plans[w] = plan
    return plan


def _c_route(flat: torch.Tensor, w: PackedWeight, lib: ctypes.CDLL) -> torch.Tensor:
    type_id, address, row_bytes, out_features, nb = _plan(w)
    threads = torch.get_num_threads()
    m = flat.shape[0]
    k_quant = type_id >= 3
    in_features = nb * (256 if k_quant else 32)
    if m <= FUSED_MAX_ROWS:
        x = flat.contiguous()
        y = torch.empty(m, out_features)
        if k_quant:
            lib.poot_gemv_k(type_id, address, row_bytes, out_features, nb, x.data_ptr(), m, y.data_ptr(), threads)
        else:
            xsum = torch.empty(m, nb)
            lib.poot_gemv(
                type_id, address, row_bytes, out_features, nb, x.data_ptr(), m, y.data_ptr(), xsum.data_ptr(), threads
            )
        return y
    dequant = lib.poot_dequant_k if k_quant else lib.poot_dequant
    tile = max(1, min(out_features, TILE_BYTES // (4 * in_features)))
    buffer = torch.empty(tile, in_features)
    out = torch.empty(m, out_features)
    for start in range(0, out_features, tile):
        rows = min(tile, out_features - start)
        dequant(type_id, address + start * row_bytes, row_bytes, rows, nb, buffer.data_ptr(), threads)
        out[:, start : start + rows] = flat @ buffer[:rows].T
    return out


def few_rows_product(w: PackedWeight) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """For a weight the C kernel reads, a function of float32 x [..., in] giving x @ W^T with the per-call
    lookups and checks of packed_linear done once, here (they cost more than a small decode product). It
    returns None for more than FUSED_MAX_ROWS rows, and the caller uses packed_linear."""
    if not uses_c_kernel(w):
        return None
    lib = kernels()
    assert lib is not None  # uses_c_kernel checked it
    type_id, address, row_bytes, n, nb = _plan(w)
    in_features = w.shape[1]

    def product(x: torch.Tensor) -> torch.Tensor | None:
        flat = x.reshape(-1, in_features)
        m = flat.shape[0]
        if m > FUSED_MAX_ROWS or flat.dtype != torch.float32:
            return None
        flat = flat.contiguous()
        y = torch.empty(m, n)
        if type_id >= 3:
            lib.poot_gemv_k(type_id, address, row_bytes, n, nb, flat.data_ptr(), m, y.data_ptr(),
                            torch.get_num_threads())
        else:
            xsum = torch.empty(m, nb)
            lib.poot_gemv(type_id, address, row_bytes, n, nb, flat.data_ptr(), m, y.data_ptr(), xsum.data_ptr(),
                          torch.get_num_threads())
        return y.reshape(*x.shape[:-1], n)

    return product


def dense16_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """float32 x [..., k] (at most FUSED_MAX_ROWS rows) @ W^T for a bf16/f16 W [n, k] with unit column stride,
    computed as the float32 product (weights widened exactly in registers); None where the C kernels are not
    available or the shapes do not fit, and the caller uses torch."""
    lib = kernels()
    flat = x.reshape(-1, x.shape[-1])
    if (lib is None or w.dim() != 2 or w.dtype not in (torch.bfloat16, torch.float16) or w.stride(1) != 1
            or flat.shape[0] > FUSED_MAX_ROWS or flat.dtype != torch.float32):
        return None
    flat = flat.contiguous()
    n, k = w.shape
    y = torch.empty(flat.shape[0], n)
    lib.poot_gemv16(w.data_ptr(), w.stride(0), n, k, flat.data_ptr(), flat.shape[0], y.data_ptr(),
                    int(w.dtype == torch.float16), torch.get_num_threads())
    return y.reshape(*x.shape[:-1], n)


def tile_rows(in_features: int) -> int:
    """Output rows per torch tile: about TILE_BYTES of float32, a multiple of 16."""
    return max(16, (TILE_BYTES // (4 * max(in_features, 1))) // 16 * 16)


def _tiled(flat: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    in_features = w.shape[-1]
    out_features = w.shape[0] if len(w.shape) == 2 else int(torch.tensor(w.shape[:-1]).prod())
    out = torch.empty(flat.shape[0], out_features)
    tile = tile_rows(in_features)
    for start in range(0, out_features, tile):
        rows = slice(start, min(start + tile, out_features))
        out[:, rows] = flat @ dequantize(w, rows).T
    return out


def uses_c_kernel(w: PackedWeight) -> bool:
    blocks = w.parts.get("blocks")
    return (
        w.layout == "gguf"
        and len(w.shape) == 2
        and w.meta.get("type") in C_TYPES
        and blocks is not None
        and blocks.dim() == 2
        and blocks.stride(1) == 1
        and w.shape[1] % C_TYPES[w.meta["type"]][0] == 0
        and tuple(blocks.shape) == (w.shape[0], w.shape[1] // C_TYPES[w.meta["type"]][0] * C_TYPES[w.meta["type"]][1])
        and kernels() is not None
    )


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT4_CACHE: weakref.WeakKeyDictionary[PackedWeight, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _int4_codes_and_affine(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes int32 [out, in] in 0..15 and per-32 group scale, offset [out, in / 32] with value = code * s + o."""
    kind, out_f = w.meta["type"], w.shape[0]
    b = w.parts["blocks"].reshape(-1, gb.BLOCK_SIZES[kind][1])
    if kind == "Q4_K":
        codes = gb._k_nibbles(b[:, 16:144])
        scales, mins = gb._k4_scales(b[:, 4:16])
        s, o = gb._f16(b, 0) * scales.float(), -(gb._f16(b, 2) * mins.float())
    else:
        start = 2 if kind == "Q4_0" else 4
        codes = gb._nibbles(b[:, start : start + 16])
        s = gb._f16(b, 0)
        o = -8 * s if kind == "Q4_0" else gb._f16(b, 2)
    return codes.reshape(out_f, -1).to(torch.int32), s.reshape(out_f, -1), o.reshape(out_f, -1)


def _int4_packed(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    cached = _INT4_CACHE.get(w)
    if cached is None:
        codes, s, o = _int4_codes_and_affine(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # torch's int4 kernel computes (code - 8) * scale + zero.
        scales_zeros = torch.stack((s, o + 8 * s), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        cached = _INT4_CACHE[w] = (packed, scales_zeros)
    return cached


def packed_linear(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, fast: bool = False
) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out]; fast=True trades exactness for speed where a route exists."""
    in_features = w.shape[-1]
    if fast and w.layout == "gguf" and w.meta.get("type") in INT4_TYPES and len(w.shape) == 2:
        packed, scales_zeros = _int4_packed(w)
        flat16 = x.reshape(-1, in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat16, packed, 32, scales_zeros).float()
    else:
        flat = x.reshape(-1, in_features).float()
        lib = kernels() if (w in _plans or uses_c_kernel(w)) else None
        y = _c_route(flat, w, lib) if lib is not None else _tiled(flat, w)
    if bias is not None:
        y += bias.float()
    return y.reshape(*x.shape[:-1], y.shape[-1])
