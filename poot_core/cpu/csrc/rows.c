/* Decode products of more rows of x than the decode kernels take at once (a batched serving step). */
#include "common.h"

/* The decode products' common signature (poot_gemv, poot_gemv_k, poot_gemv_kl, poot_gemv_q8):
   y [m, n] = x [m, k] @ W^T for m <= 4, W n rows of row_bytes, nb blocks each. */
typedef void (*poot_gemv_fn)(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb, const float *x,
                             int64_t m, float *y, int threads);

/* Bytes of weight rows one call reads: small enough that the rows stay in the core's cache while every group
   of few rows of x meets them, so the matrix is read from memory once per step, not once per group. */
#define CHUNK_BYTES (32 * 1024)

/* y [m, n] = x [m, k] @ W^T through gemv (passed by address), any m: output rows in chunks that stay in
   cache, each chunk meeting x `few` rows at a time (1..4), so every row of y is computed exactly as a decode
   call of `few` rows computes it (the same kernel over the same blocks in the same order). The caller picks
   `few` so that this is also what a decode call of one row computes: then a row's result does not depend on
   how many rows share the step. */
void poot_gemv_rows(poot_gemv_fn gemv, int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,
                    const float *x, int64_t m, int64_t k, int64_t few, float *y, int threads) {
    if (few < 1 || few > 4) few = 1;
    int64_t chunk = CHUNK_BYTES / (row_bytes > 0 ? row_bytes : 1);
    const int64_t share = (n + 2 * threads - 1) / (2 * threads);  /* at least two chunks a thread */
    if (chunk > share) chunk = share;
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (n + chunk - 1) / chunk;
    #pragma omp parallel num_threads(threads)
    {
        float *part = malloc(sizeof(float) * (size_t)(few * chunk));
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t o0 = c * chunk, rows = (n - o0 < chunk) ? n - o0 : chunk;
            for (int64_t r0 = 0; r0 < m; r0 += few) {
                const int64_t group = (m - r0 < few) ? m - r0 : few;
                if (!part) {
                    for (int64_t r = 0; r < group; r++)
                        for (int64_t o = 0; o < rows; o++) y[(r0 + r) * n + o0 + o] = NAN;
                    continue;
                }
                gemv(type, w + o0 * row_bytes, row_bytes, rows, nb, x + r0 * k, group, part, 1);
                for (int64_t r = 0; r < group; r++)
                    memcpy(y + (r0 + r) * n + o0, part + r * rows, sizeof(float) * (size_t)rows);
            }
        }
        free(part);
    }
}
