/* Products of many rows of x (prefill) from weights the exact way: y = x @ W^T with W dequantized exactly, a
   panel at a time, and float32 sums. A panel is PANEL_N weight rows x PANEL_K values, dequantized once by the
   type's own dequant function (quant32.c, kquant.c, kquant_low.c, or poot_widen16 below) and laid out k-major,
   then every MR rows of x meet it in a micro-kernel that keeps MR x PANEL_N sums in registers (AVX2: 12 of the
   16 vector registers, one FMA per weight per row). Each y[i, j] is one float32 FMA chain over k in index order
   starting from 0 (carried through y between panels of k), so a row's result does not depend on how many rows
   share the call or where the row sits in it. The portable build sums in the same order with separate
   multiplies and adds. */
#include "blocks.h"

typedef void (*poot_dequant_fn)(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb,
                                float *out, int threads);

#define MR 6
#define PANEL_N 16
#define PANEL_K 512  /* a multiple of every block size (32, 256); 16 x 512 floats = 32 KiB, one core's L1 */

/* c [MR][PANEL_N] += x [kc][MR] (MR rows of x, packed k-major) times the panel p [kc][PANEL_N], each sum one
   FMA chain over k in order. The accumulators are named variables: in arrays GCC keeps them in memory. */
static void micro(const float *x, const float *p, int64_t kc, float *c) {
#if POOT_AVX2
#define POOT_ROW_ACC(r) __m256 a##r##0 = _mm256_loadu_ps(c + 16 * r), a##r##1 = _mm256_loadu_ps(c + 16 * r + 8)
    POOT_ROW_ACC(0); POOT_ROW_ACC(1); POOT_ROW_ACC(2); POOT_ROW_ACC(3); POOT_ROW_ACC(4); POOT_ROW_ACC(5);
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 w0 = _mm256_loadu_ps(p + kk * PANEL_N), w1 = _mm256_loadu_ps(p + kk * PANEL_N + 8);
        __m256 xv;
#define POOT_ROW_FMA(r)                                    \
        xv = _mm256_broadcast_ss(x + kk * MR + r);         \
        a##r##0 = _mm256_fmadd_ps(xv, w0, a##r##0);        \
        a##r##1 = _mm256_fmadd_ps(xv, w1, a##r##1)
        POOT_ROW_FMA(0); POOT_ROW_FMA(1); POOT_ROW_FMA(2); POOT_ROW_FMA(3); POOT_ROW_FMA(4); POOT_ROW_FMA(5);
    }
#define POOT_ROW_STORE(r) _mm256_storeu_ps(c + 16 * r, a##r##0); _mm256_storeu_ps(c + 16 * r + 8, a##r##1)
    POOT_ROW_STORE(0); POOT_ROW_STORE(1); POOT_ROW_STORE(2); POOT_ROW_STORE(3); POOT_ROW_STORE(4); POOT_ROW_STORE(5);
#undef POOT_ROW_ACC
#undef POOT_ROW_FMA
#undef POOT_ROW_STORE
#else
    for (int64_t kk = 0; kk < kc; kk++)
        for (int r = 0; r < MR; r++) {
            const float xv = x[kk * MR + r];
            for (int j = 0; j < PANEL_N; j++) c[r * PANEL_N + j] += xv * p[kk * PANEL_N + j];
        }
#endif
}

/* y (mr x nr, ldy apart) = or += (unless first) the tile's product, through micro on a padded copy. */
static void micro_tile(int64_t mr, const float *x, const float *p, int64_t kc, float *y, int64_t ldy, int64_t nr,
                       int first) {
    float c[MR * PANEL_N] __attribute__((aligned(32)));
    memset(c, 0, sizeof c);
    if (!first)
        for (int64_t r = 0; r < mr; r++) memcpy(c + r * PANEL_N, y + r * ldy, sizeof(float) * (size_t)nr);
    micro(x, p, kc, c);
    for (int64_t r = 0; r < mr; r++) memcpy(y + r * ldy, c + r * PANEL_N, sizeof(float) * (size_t)nr);
}

#if POOT_AVX2
/* Rows j < nr of a panel, nbk blocks of type t (an A_ id of blocks.h) from block b0 of each row, dequantized
   exactly into raw [nr][kc]: D * c, or (D * s) * c for 16-value sub-scales, the product rounded before the
   minimum term is added, bit for bit as the gguf package computes them (tests/cpu/test_cpu_prefill_gemm.py). */
static inline __attribute__((always_inline)) void decode_panel_t(const int t, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t nr, int64_t b0, int64_t nbk, float *raw) {
    const int G = a_groups(t);
    const int64_t kc = nbk * 32 * G;
    scales_t sc;
    for (int64_t j = 0; j < nr; j++) {
        const uint8_t *row = w + j * row_bytes + b0 * A_BYTES[t];
        for (int64_t b = 0; b < nbk; b++) {
            const uint8_t *blk = row + b * A_BYTES[t];
            block_scales(t, blk, &sc);
            for (int g = 0; g < G; g++) {
                const __m256i cv = group_codes_v(t, blk, g);
                const __m128i lo = _mm256_castsi256_si128(cv), hi = _mm256_extracti128_si256(cv, 1);
                const __m256i c[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                                      _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
                float *dst = raw + j * kc + (b * G + g) * 32;
                for (int q = 0; q < 4; q++) {
                    const int h = 2 * g + q / 2;  /* the 16-value half */
                    const __m256 d = _mm256_set1_ps(a_sub16(t) ? sc.D[g] * (float)sc.s[h] : sc.D[g]);
                    __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(c[q]));
                    if (a_has_min(t)) {
                        POOT_ROUNDED(v);
                        v = _mm256_add_ps(v, _mm256_set1_ps(a_sub16(t) ? sc.M[0] * (float)sc.n[h] : sc.M[g]));
                    }
                    _mm256_storeu_ps(dst + 8 * q, v);
                }
            }
        }
    }
}

#define POOT_DECODE_PANEL(T) case T: decode_panel_t(T, w, row_bytes, nr, b0, nbk, raw); return;
static void decode_panel(int t, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t b0, int64_t nbk, float *raw) {
    switch (t) {
    POOT_DECODE_PANEL(A_Q4_0) POOT_DECODE_PANEL(A_Q4_1) POOT_DECODE_PANEL(A_Q8_0) POOT_DECODE_PANEL(A_Q5_0)
    POOT_DECODE_PANEL(A_Q5_1) POOT_DECODE_PANEL(A_IQ4_NL) POOT_DECODE_PANEL(A_Q4_K) POOT_DECODE_PANEL(A_Q5_K)
    POOT_DECODE_PANEL(A_Q6_K) POOT_DECODE_PANEL(A_IQ4_XS) POOT_DECODE_PANEL(A_Q2_K) POOT_DECODE_PANEL(A_Q3_K)
    }
}
#undef POOT_DECODE_PANEL

/* dst[i * ld_dst + j] = src[j * ld_src + i] for an 8 x 8 tile. */
static inline void transpose8(const float *src, int64_t ld_src, float *dst, int64_t ld_dst) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld_src);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}
#endif

/* pack [kc][PANEL_N] = raw [PANEL_N][kc] transposed (raw's rows from nr on are zeros). */
static void pack_panel(const float *raw, int64_t kc, float *pack) {
    int64_t kk = 0;
#if POOT_AVX2
    for (; kk + 8 <= kc; kk += 8)
        for (int j0 = 0; j0 < PANEL_N; j0 += 8) transpose8(raw + j0 * kc + kk, kc, pack + kk * PANEL_N + j0, PANEL_N);
#endif
    for (; kk < kc; kk++)
        for (int64_t j = 0; j < PANEL_N; j++) pack[kk * PANEL_N + j] = raw[j * kc + kk];
}

/* y[m, n] = x[m, k] @ W^T, k = nb * block: W's n rows (row_bytes apart, nb blocks of block values and
   block_bytes bytes each) dequantized exactly, PANEL_N rows by PANEL_K values at a time, by fn (type its first
   argument), or in AVX2 builds where block_type is an A_ id (blocks.h) by the vector decoders of blocks.h;
   OpenMP over panels of rows. */
void poot_gemm_panels(poot_dequant_fn fn, int type, int block_type, const uint8_t *w, int64_t row_bytes, int64_t n,
                      int64_t nb, int64_t block, int64_t block_bytes, const float *x, int64_t m, float *y,
                      int threads) {
    const int64_t k = nb * block, panels = (n + PANEL_N - 1) / PANEL_N;
    int64_t kc_max = PANEL_K / block * block;
    if (kc_max < block) kc_max = block;
    /* x in tiles of MR rows, each k-major [k][MR] (the last tile padded with zeros), so that the micro-kernel
       reads it in one stream */
    const int64_t tiles = (m + MR - 1) / MR;
    float *xp = malloc(sizeof(float) * (size_t)(tiles * MR * k));
    if (!xp) {
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r = 0; r < MR; r++) {
                const int64_t i = t * MR + r;
                float *dst = xp + t * MR * k + r;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * MR] = i < m ? x[i * k + kk] : 0.0f;
            }
        float *raw = malloc(sizeof(float) * (size_t)(PANEL_N * kc_max));
        float *pack = malloc(sizeof(float) * (size_t)(PANEL_N * kc_max));
        #pragma omp for schedule(static)
        for (int64_t pj = 0; pj < panels; pj++) {
            const int64_t j0 = pj * PANEL_N, nr = n - j0 < PANEL_N ? n - j0 : PANEL_N;
            if (!raw || !pack) {
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < nr; j++) y[i * n + j0 + j] = NAN;
                continue;
            }
            for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                const int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
#if POOT_AVX2
                if (block_type >= 0)
                    decode_panel(block_type, w + j0 * row_bytes, row_bytes, nr, k0 / block, kc / block, raw);
                else
#endif
                    fn(type, w + j0 * row_bytes + k0 / block * block_bytes, row_bytes, nr, kc / block, raw, 1);
                if (nr < PANEL_N) memset(raw + nr * kc, 0, sizeof(float) * (size_t)((PANEL_N - nr) * kc));
                pack_panel(raw, kc, pack);
                for (int64_t t = 0; t < tiles; t++)
                    micro_tile(m - t * MR < MR ? m - t * MR : MR, xp + t * MR * k + k0 * MR, pack, kc,
                               y + t * MR * n + j0, n, nr, k0 == 0);
            }
        }
        free(raw);
        free(pack);
    }
    free(xp);
}

/* The dequant signature for 16-bit float weights (bf16, or f16 when type != 0), blocks of one value:
   out[rows, nb] = the rows widened exactly to float32. */
void poot_widen16(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < rows; o++) {
        const uint16_t *src = (const uint16_t *)(w + o * row_bytes);
        float *dst = out + o * nb;
        int64_t j = 0;
#if POOT_AVX2
        for (; j + 8 <= nb; j += 8) {
            const __m128i r = _mm_loadu_si128((const __m128i *)(src + j));
            _mm256_storeu_ps(dst + j, type ? _mm256_cvtph_ps(r)
                                           : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16)));
        }
#endif
        for (; j < nb; j++) {
            if (type) {
                dst[j] = f16((const uint8_t *)(src + j));
            } else {
                const uint32_t bits = (uint32_t)src[j] << 16;
                memcpy(dst + j, &bits, 4);
            }
        }
    }
}
