/* Products of many rows of x (prefill) from weights the exact way: y = x @ W^T with W dequantized exactly, a
   panel at a time, and float32 sums. A panel is PANEL_N weight rows x PANEL_K values, dequantized once by the
   type's own dequant function (quant32.c, kquant.c, kquant_low.c, or poot_widen16 below) and laid out k-major,
   then every MR rows of x meet it in a micro-kernel that keeps MR x PANEL_N sums in registers (AVX2: 12 of the
   16 vector registers, one FMA per weight per row). Each y[i, j] is one float32 FMA chain over k in index order
   starting from 0 (carried through y between panels of k), so a row's result does not depend on how many rows
   share the call or where the row sits in it. The portable build sums in the same order with separate
   multiplies and adds. */
#include "common.h"

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

/* y[m, n] = x[m, k] @ W^T, k = nb * block: W's n rows (row_bytes apart, nb blocks of block values and
   block_bytes bytes each) dequantized exactly by fn, PANEL_N rows by PANEL_K values at a time; OpenMP over
   panels of rows. */
void poot_gemm_panels(poot_dequant_fn fn, int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,
                      int64_t block, int64_t block_bytes, const float *x, int64_t m, float *y, int threads) {
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
                fn(type, w + j0 * row_bytes + k0 / block * block_bytes, row_bytes, nr, kc / block, raw, 1);
                for (int64_t kk = 0; kk < kc; kk++)
                    for (int64_t j = 0; j < PANEL_N; j++) pack[kk * PANEL_N + j] = j < nr ? raw[j * kc + kk] : 0.0f;
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
