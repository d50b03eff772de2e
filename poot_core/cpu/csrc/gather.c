/* Rows of a packed matrix picked by index and dequantized: the token embedding lookup. */
#include "common.h"

/* The dequantization functions' common signature (poot_dequant, poot_dequant_k, ...). */
typedef void (*poot_dequant_fn)(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t nb,
                                float *out, int threads);

/* out[i] = row index[i] of w, dequantized by dequant (one of the functions above, passed by address), for
   i < count; each row has nb blocks (row_elems values) and lies row_bytes after the previous one. The
   caller checks the indices. */
void poot_gather_rows(poot_dequant_fn fn, int type, const uint8_t *w, int64_t row_bytes, int64_t nb,
                      int64_t row_elems, const int64_t *index, int64_t count, float *out, int threads) {
    if (count <= 8) {  /* decode: no parallel region for a row or two */
        for (int64_t i = 0; i < count; i++)
            fn(type, w + index[i] * row_bytes, row_bytes, 1, nb, out + i * row_elems, 1);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++) fn(type, w + index[i] * row_bytes, row_bytes, 1, nb, out + i * row_elems, 1);
}
