/* Attention over the float32 key/value cache: a few queries (decode) and blocks of queries (prefill). */
#include "common.h"

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#elif POOT_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* o[0..n) += w[j] * v[j * n ..] for the rows j < count in order: each value of o one chain of multiply-adds
   (fused where the machine has FMA) in row order, held in registers across the rows. */
static inline void axpy_rows_f32(float *o, const float *w, const float *v, int64_t count, int64_t n) {
    int64_t i = 0;
#if POOT_AVX2
    for (; i + 64 <= n; i += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(o + i + 8 * c);
        for (int64_t j = 0; j < count; j++) {
            const __m256 wj = _mm256_set1_ps(w[j]);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + j * n + i + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + i + 8 * c, a[c]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(o + i);
        for (int64_t j = 0; j < count; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * n + i), a);
        _mm256_storeu_ps(o + i, a);
    }
#endif
    for (; i < n; i++) {
        float a = o[i];
        for (int64_t j = 0; j < count; j++) a += w[j] * v[j * n + i];
        o[i] = a;
    }
}

/* s[i] = exp(s[i] - top) for i < n, returning the sum (exp16 or exp8 of common.h; expf for the tail). */
static inline float exp_shifted(float *s, int64_t n, float top) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), t));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#elif POOT_AVX2
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), t));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = hsum8(sum);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - top);
        total += s[i];
    }
    return total;
}

/* Writes the step's keys and values k [R, T, Hkv, Dk], v [R, T, Hkv, Dv] into the caches [R, Hkv, C, Dk|Dv]
   (contiguous) at their positions [R, T], then out[R, T, Hq, Dv] = softmax(scale * q . k) v for
   q [R, T, Hq, Dk]. With cos_t, q and k are first rotated by rope (angles [R, T, half]; q_rotated: room for
   q). Query t of row r sees the keys at max(0, p - window + 1) .. p, p = positions[r, t]
   (window <= 0: no window); softcap > 0 applies softcap * tanh(score / softcap). scratch: [threads, C]. */
void poot_attend_few(const float *q, const float *k, const float *v, int64_t rows, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t dk, int64_t dv, float *k_cache, float *v_cache, int64_t capacity,
                     const int64_t *positions, float scale, int64_t window, float softcap, float *out,
                     float *scratch, int threads, const float *cos_t, const float *sin_t, int64_t half,
                     int interleaved, float *q_rotated) {
    const int64_t units = rows * tokens * heads, group = heads / kv_heads;
    for (int64_t rt = 0; rt < rows * tokens; rt++) {
        if (cos_t)  /* rope first (see rope_row): q into q_rotated, k straight into the cache below */
            rope_row(q + rt * heads * dk, heads, dk, half, cos_t + rt * half, sin_t + rt * half, interleaved,
                     q_rotated + rt * heads * dk);
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = ((rt / tokens) * kv_heads + g) * capacity + positions[rt];
            if (cos_t)
                rope_row(k + (rt * kv_heads + g) * dk, 1, dk, half, cos_t + rt * half, sin_t + rt * half, interleaved,
                         k_cache + at * dk);
            else
                memcpy(k_cache + at * dk, k + (rt * kv_heads + g) * dk, sizeof(float) * (size_t)dk);
            memcpy(v_cache + at * dv, v + (rt * kv_heads + g) * dv, sizeof(float) * (size_t)dv);
        }
    }
    if (cos_t) q = q_rotated;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        float *s = scratch + (int64_t)omp_get_thread_num() * capacity;
        const int64_t h = u % heads, rt = u / heads, r = rt / tokens;
        const int64_t p = positions[rt];
        const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0, n = p - first + 1;
        const float *qv = q + u * dk;
        const float *kb = k_cache + ((r * kv_heads + h / group) * capacity + first) * dk;
        const float *vb = v_cache + ((r * kv_heads + h / group) * capacity + first) * dv;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float score = dot_f32(qv, kb + j * dk, dk) * scale;
            if (softcap > 0.0f) score = tanhf(score / softcap) * softcap;
            s[j] = score;
            if (score > top) top = score;
        }
        const float inv = 1.0f / exp_shifted(s, n, top);
        float *o = out + u * dv;
        for (int64_t d = 0; d < dv; d++) o[d] = 0.0f;
        axpy_rows_f32(o, s, vb, n, dv);
        for (int64_t d = 0; d < dv; d++) o[d] *= inv;
    }
}

/* The paged layout's decode attention: n tokens, token i of sequence seqs[i] at positions[i], q [n, Hq, Dk],
   k [n, Hkv, Dk], v [n, Hkv, Dv]; pools [blocks, Hkv, B, Dk|Dv]; tables [S, table_stride] the blocks of each
   sequence. Writes each token's key and value into its block, then attends each query over its sequence's
   keys through the table, with the arithmetic of poot_attend_few key for key (the same dot, exp and sum
   order), so a token gives the bits the contiguous layout gives. scratch: [threads, scratch_len], scratch_len
   at least the longest span of keys a query sees. */
void poot_attend_paged(const float *q, const float *k, const float *v, int64_t n, int64_t heads, int64_t kv_heads,
                       int64_t dk, int64_t dv, float *k_pool, float *v_pool, int64_t block, const int64_t *tables,
                       int64_t table_stride, const int64_t *seqs, const int64_t *positions, float scale,
                       int64_t window, float softcap, float *out, float *scratch, int64_t scratch_len, int threads) {
    const int64_t group = heads / kv_heads;
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = positions[i], b = tables[seqs[i] * table_stride + p / block], off = p % block;
        for (int64_t g = 0; g < kv_heads; g++) {
            memcpy(k_pool + ((b * kv_heads + g) * block + off) * dk, k + (i * kv_heads + g) * dk,
                   sizeof(float) * (size_t)dk);
            memcpy(v_pool + ((b * kv_heads + g) * block + off) * dv, v + (i * kv_heads + g) * dv,
                   sizeof(float) * (size_t)dv);
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < n * heads; u++) {
        float *s = scratch + (int64_t)omp_get_thread_num() * scratch_len;
        const int64_t h = u % heads, i = u / heads, g = h / group;
        const int64_t *table = tables + seqs[i] * table_stride;
        const int64_t p = positions[i];
        const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0, count = p - first + 1;
        const float *qv = q + u * dk;
        float top = -INFINITY;
        for (int64_t j = first; j <= p;) {  /* a run of keys inside one block at a time */
            const int64_t off = j % block, run = (block - off < p + 1 - j) ? block - off : p + 1 - j;
            const float *kb = k_pool + ((table[j / block] * kv_heads + g) * block + off) * dk;
            for (int64_t t = 0; t < run; t++) {
                float score = dot_f32(qv, kb + t * dk, dk) * scale;
                if (softcap > 0.0f) score = tanhf(score / softcap) * softcap;
                s[j - first + t] = score;
                if (score > top) top = score;
            }
            j += run;
        }
        const float inv = 1.0f / exp_shifted(s, count, top);
        float *o = out + u * dv;
        for (int64_t d = 0; d < dv; d++) o[d] = 0.0f;
        for (int64_t j = first; j <= p;) {
            const int64_t off = j % block, run = (block - off < p + 1 - j) ? block - off : p + 1 - j;
            const float *vb = v_pool + ((table[j / block] * kv_heads + g) * block + off) * dv;
            axpy_rows_f32(o, s + j - first, vb, run, dv);
            j += run;
        }
        for (int64_t d = 0; d < dv; d++) o[d] *= inv;
    }
}

#ifdef __AVX512F__
#define QB 4   /* queries per register tile */
#define KB 64  /* keys per register tile: 4 vectors of 16 */

/* tanh(x) = 1 - 2 / (exp(2x) + 1), vectorized through exp16 */
static inline __m512 tanh16(__m512 x) {
    __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}

/* Keys first_key + j, j < n_keys, of one key/value head (kb: its cache rows) laid out for tile(): feature e of
   key first_key + j at kt[e * ld + j]. Keys from end_key on (masked anyway) read as zeros. */
static void transpose_keys(const float *kb, int64_t first_key, int64_t end_key, int64_t n_keys, int64_t d,
                           float *kt, int64_t ld) {
    for (int64_t j = 0; j < n_keys; j++)
        for (int64_t e = 0; e < d; e++)
            kt[e * ld + j] = first_key + j < end_key ? kb[(first_key + j) * d + e] : 0.0f;
}

/* One tile: up to QB queries (rows q, positions p[i]) of one head against keys [k0, k0 + KB) of its key/value
   head; kt: those keys transposed, kt[d * ld + j]; v: the value rows. Updates the online softmax state. */
static void tile(const float *q, int64_t q_stride, int nq, const int64_t *p, int64_t k0, int64_t first_key,
                 int64_t window, const float *kt, int64_t ld, const float *v, int64_t d, float scale, float softcap,
                 float *top, float *total, float *o) {
    __m512 acc[QB][4];
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e++) {
        const float *row = kt + e * ld + (k0 - first_key);
        __m512 k4[4] = {_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16), _mm512_loadu_ps(row + 32),
                        _mm512_loadu_ps(row + 48)};
        for (int i = 0; i < QB; i++) {
            __m512 qe = _mm512_set1_ps(i < nq ? q[i * q_stride + e] : 0.0f);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_fmadd_ps(qe, k4[c], acc[i][c]);
        }
    }
    float w[QB][KB];
    for (int i = 0; i < nq; i++) {
        __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const float last = (float)(p[i] - k0), lowest = window > 0 ? (float)(p[i] - window + 1 - k0) : -1e30f;
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < 4; c++) {
            __m512 sc = _mm512_mul_ps(acc[i][c], _mm512_set1_ps(scale));
            if (softcap > 0.0f)
                sc = _mm512_mul_ps(tanh16(_mm512_div_ps(sc, _mm512_set1_ps(softcap))), _mm512_set1_ps(softcap));
            __m512 at = _mm512_add_ps(lane, _mm512_set1_ps((float)(16 * c)));
            __mmask16 keep = _mm512_cmp_ps_mask(at, _mm512_set1_ps(last), _CMP_LE_OQ) &
                             _mm512_cmp_ps_mask(at, _mm512_set1_ps(lowest), _CMP_GE_OQ);
            acc[i][c] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), sc);
            best = _mm512_max_ps(best, acc[i][c]);
        }
        const float tile_top = _mm512_reduce_max_ps(best);
        if (tile_top == -INFINITY) {  /* no key of this tile is visible to this query */
            for (int j = 0; j < KB; j++) w[i][j] = 0.0f;
            continue;
        }
        const float new_top = tile_top > top[i] ? tile_top : top[i];
        const float shrink = top[i] == -INFINITY ? 0.0f : expf(top[i] - new_top);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            __m512 e = exp16(_mm512_sub_ps(acc[i][c], _mm512_set1_ps(new_top)));
            _mm512_storeu_ps(w[i] + 16 * c, e);
            sum = _mm512_add_ps(sum, e);
        }
        total[i] = total[i] * shrink + _mm512_reduce_add_ps(sum);
        top[i] = new_top;
        for (int64_t e = 0; e < d; e++) o[i * d + e] *= shrink;
    }
    for (int i = nq; i < QB; i++)
        for (int j = 0; j < KB; j++) w[i][j] = 0.0f;
    for (int64_t c0 = 0; c0 < d; c0 += 16) {  /* o[i, c0:c0+16] += sum_j w[i][j] * v[j, c0:c0+16] */
        __m512 oa[QB];
        for (int i = 0; i < QB; i++) oa[i] = _mm512_loadu_ps(o + i * d + c0);
        for (int j = 0; j < KB; j++) {
            __m512 vj = _mm512_loadu_ps(v + j * d + c0);
            for (int i = 0; i < QB; i++) oa[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][j]), vj, oa[i]);
        }
        for (int i = 0; i < QB; i++) _mm512_storeu_ps(o + i * d + c0, oa[i]);
    }
}
#elif POOT_AVX2
#define QB 4   /* queries per tile, as on AVX-512 */
#define KB 64  /* keys per tile: 8 vectors of 8, met 16 at a time (11 registers: 8 sums, 2 keys, a query) */

/* tanh(x) = 1 - 2 / (exp(2x) + 1), vectorized through exp8 */
static inline __m256 tanh8(__m256 x) {
    __m256 e = exp8(_mm256_mul_ps(x, _mm256_set1_ps(2.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
}

/* The largest of the 8 lanes of v. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Rows r[0..8) of 8 floats become its columns: r[n][m] = r[m][n] before. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int m = 0; m < 8; m += 2) {
        t[m] = _mm256_unpacklo_ps(r[m], r[m + 1]);
        t[m + 1] = _mm256_unpackhi_ps(r[m], r[m + 1]);
    }
    for (int m = 0; m < 8; m += 4) {
        s[m] = _mm256_shuffle_ps(t[m], t[m + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[m + 1] = _mm256_shuffle_ps(t[m], t[m + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[m + 2] = _mm256_shuffle_ps(t[m + 1], t[m + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[m + 3] = _mm256_shuffle_ps(t[m + 1], t[m + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int n = 0; n < 4; n++) {
        r[n] = _mm256_permute2f128_ps(s[n], s[n + 4], 0x20);
        r[n + 4] = _mm256_permute2f128_ps(s[n], s[n + 4], 0x31);
    }
}

/* Keys first_key + j, j < n_keys (a multiple of 16), of one key/value head (kb: its cache rows) laid out for
   tile(): in groups of 16 keys, each group d rows of 16 (feature e of key first_key + j at
   kt[((j / 16) * d + e) * 16 + j % 16]), so that a pass over 16 keys reads one contiguous block. Keys from
   end_key on (masked anyway) read as zeros. ld is unused (the AVX-512 layout's row length). */
static void transpose_keys(const float *kb, int64_t first_key, int64_t end_key, int64_t n_keys, int64_t d,
                           float *kt, int64_t ld) {
    (void)ld;
    static const float zeros[8];
    for (int64_t j = 0; j < n_keys; j += 8)
        for (int64_t e = 0; e < d; e += 8) {
            __m256 r[8];
            for (int m = 0; m < 8; m++)
                r[m] = _mm256_loadu_ps(first_key + j + m < end_key ? kb + (first_key + j + m) * d + e : zeros);
            transpose8(r);
            for (int n = 0; n < 8; n++) _mm256_storeu_ps(kt + ((j / 16) * d + e + n) * 16 + j % 16, r[n]);
        }
}

/* The AVX-512 tile's work (see there) in 256-bit vectors: the 4 x 64 scores in four passes of 4 x 16 (kt in
   the layout of transpose_keys above). */
static void tile(const float *q, int64_t q_stride, int nq, const int64_t *p, int64_t k0, int64_t first_key,
                 int64_t window, const float *kt, int64_t ld, const float *v, int64_t d, float scale, float softcap,
                 float *top, float *total, float *o) {
    __m256 sc[QB][KB / 8];
    (void)ld;
    const float *qi[QB];  /* rows past nq repeat the first: their scores are never read */
    for (int i = 0; i < QB; i++) qi[i] = q + (i < nq ? i : 0) * q_stride;
    /* keys of the tile the last query sees: passes of 16 keys past them are not computed (masked below) and
       their value rows not read */
    const int64_t reach = p[nq - 1] - k0 + 1 < KB ? p[nq - 1] - k0 + 1 : KB;
    const int passes = (int)((reach + 15) / 16);
    for (int i = 0; i < QB; i++)
        for (int c = 2 * passes; c < KB / 8; c++) sc[i][c] = _mm256_setzero_ps();
    for (int c = 0; c < 2 * passes; c += 2) {
        __m256 acc[QB][2];
        for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        const float *col = kt + ((k0 - first_key) / KB * 4 + c / 2) * d * 16;
        for (int64_t e = 0; e < d; e++) {
            __m256 ka = _mm256_loadu_ps(col + e * 16), kb = _mm256_loadu_ps(col + e * 16 + 8);
            POOT_ROUNDED(ka); POOT_ROUNDED(kb);  /* in registers: gcc would load them again for each query */
            for (int i = 0; i < QB; i++) {
                const __m256 qe = _mm256_broadcast_ss(qi[i] + e);
                acc[i][0] = _mm256_fmadd_ps(qe, ka, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(qe, kb, acc[i][1]);
            }
        }
        for (int i = 0; i < QB; i++) { sc[i][c] = acc[i][0]; sc[i][c + 1] = acc[i][1]; }
    }
    float w[QB][KB];
    for (int i = 0; i < nq; i++) {
        const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        const float last = (float)(p[i] - k0), lowest = window > 0 ? (float)(p[i] - window + 1 - k0) : -1e30f;
        const int whole = last >= KB - 1 && lowest <= 0.0f;  /* every key of the tile is visible: no mask */
        __m256 best = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < KB / 8; c++) {
            __m256 s = _mm256_mul_ps(sc[i][c], _mm256_set1_ps(scale));
            if (softcap > 0.0f)
                s = _mm256_mul_ps(tanh8(_mm256_div_ps(s, _mm256_set1_ps(softcap))), _mm256_set1_ps(softcap));
            if (!whole) {
                const __m256 at = _mm256_add_ps(lane, _mm256_set1_ps((float)(8 * c)));
                const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(at, _mm256_set1_ps(last), _CMP_LE_OQ),
                                                  _mm256_cmp_ps(at, _mm256_set1_ps(lowest), _CMP_GE_OQ));
                s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, keep);
            }
            sc[i][c] = s;
            best = _mm256_max_ps(best, s);
        }
        const float tile_top = hmax8(best);
        if (tile_top == -INFINITY) {  /* no key of this tile is visible to this query */
            for (int j = 0; j < KB; j++) w[i][j] = 0.0f;
            continue;
        }
        const float new_top = tile_top > top[i] ? tile_top : top[i];
        const float shrink = top[i] == -INFINITY ? 0.0f : expf(top[i] - new_top);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < KB / 8; c++) {
            __m256 e = exp8(_mm256_sub_ps(sc[i][c], _mm256_set1_ps(new_top)));
            _mm256_storeu_ps(w[i] + 8 * c, e);
            sum = _mm256_add_ps(sum, e);
        }
        total[i] = total[i] * shrink + hsum8(sum);
        top[i] = new_top;
        if (shrink != 1.0f)
            for (int64_t e = 0; e < d; e++) o[i * d + e] *= shrink;
    }
    for (int i = nq; i < QB; i++)
        for (int j = 0; j < KB; j++) w[i][j] = 0.0f;
    for (int64_t c0 = 0; c0 < d; c0 += 16) {  /* o[i, c0:c0+16] += sum_j w[i][j] * v[j, c0:c0+16] */
        __m256 oa[QB][2];
        for (int i = 0; i < QB; i++) {
            oa[i][0] = _mm256_loadu_ps(o + i * d + c0);
            oa[i][1] = _mm256_loadu_ps(o + i * d + c0 + 8);
        }
        for (int j = 0; j < reach; j++) {
            __m256 va = _mm256_loadu_ps(v + j * d + c0), vb = _mm256_loadu_ps(v + j * d + c0 + 8);
            POOT_ROUNDED(va); POOT_ROUNDED(vb);
            for (int i = 0; i < QB; i++) {
                const __m256 wij = _mm256_broadcast_ss(&w[i][j]);
                oa[i][0] = _mm256_fmadd_ps(wij, va, oa[i][0]);
                oa[i][1] = _mm256_fmadd_ps(wij, vb, oa[i][1]);
            }
        }
        for (int i = 0; i < QB; i++) {
            _mm256_storeu_ps(o + i * d + c0, oa[i][0]);
            _mm256_storeu_ps(o + i * d + c0 + 8, oa[i][1]);
        }
    }
}
#endif

#if defined(__AVX512F__) || POOT_AVX2
/* One unit of the prefill attention: the queries [t0, t1) (consecutive positions pos[t0..t1)) of every query
   head of key/value head g against its keys; kb, vb: the key and value rows of positions base, base + 1, ...
   (base <= the first key read, a multiple of KB). kt: scratch of d * ld floats for the transposed keys. */
static void attend_unit(const float *q, int64_t q_stride, int64_t t0, int64_t t1, const int64_t *pos, int64_t heads,
                        int64_t g, int64_t group, int64_t d, const float *kb, const float *vb, int64_t base,
                        float scale, int64_t window, float softcap, float *out, float *kt, int64_t ld) {
    const int64_t last = pos[t1 - 1];
    int64_t first_key = window > 0 && pos[t0] - window + 1 > 0 ? pos[t0] - window + 1 : 0;
    first_key -= first_key % KB;
    const int64_t end_key = last + 1, n_keys = ((end_key - first_key + KB - 1) / KB) * KB;
    transpose_keys(kb + (first_key - base) * d, 0, end_key - first_key, n_keys, d, kt, ld);
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        for (int64_t t = t0; t < t1; t += QB) {
            const int nq = (int)(t1 - t < QB ? t1 - t : QB);
            const float *qt = q + t * q_stride + h * d;
            float top[QB], total[QB], o[QB * 256];
            for (int i = 0; i < QB; i++) { top[i] = -INFINITY; total[i] = 0.0f; }
            for (int64_t e = 0; e < QB * d; e++) o[e] = 0.0f;
            const int64_t lo = window > 0 && pos[t] - window + 1 > first_key ? pos[t] - window + 1 : first_key;
            for (int64_t k0 = first_key + ((lo - first_key) / KB) * KB; k0 <= pos[t + nq - 1]; k0 += KB) {
                float vtile[KB * 256];
                const float *v = vb + (k0 - base) * d;
                if (k0 + KB > end_key) {  /* the last tile: copy the real value rows, zeros after */
                    for (int64_t j = 0; j < KB; j++)
                        for (int64_t e = 0; e < d; e++)
                            vtile[j * d + e] = k0 + j < end_key ? v[j * d + e] : 0.0f;
                    v = vtile;
                }
                tile(qt, q_stride, nq, pos + t, k0, first_key, window, kt, ld, v, d, scale, softcap, top, total, o);
            }
            for (int i = 0; i < nq; i++) {
                float *dst = out + ((t + i) * heads + h) * d;
                const float inv = 1.0f / total[i];
                for (int64_t e = 0; e < d; e++) dst[e] = o[i * d + e] * inv;
            }
        }
    }
}
#endif

/* Prefill attention for d % 16 == 0 (keys and values of one size d): q [R, T, Hq, d] with token rows
   q_stride apart, the caches [R, Hkv, C, d] already holding this step's keys and values, positions [R, T]
   consecutive per row. out [R, T, Hq, d]. scratch: per thread, d * (C + KB) floats for the transposed keys.
   Returns 0, or -1 where neither AVX-512 nor AVX2 + FMA is there (the caller uses torch). */
int poot_attend_blocks(const float *q, int64_t q_stride, int64_t rows, int64_t tokens, int64_t heads,
                       int64_t kv_heads, int64_t d, const float *k_cache, const float *v_cache, int64_t capacity,
                       const int64_t *positions, float scale, int64_t window, float softcap, float *out,
                       float *scratch, int threads) {
#if defined(__AVX512F__) || POOT_AVX2
    const int64_t group = heads / kv_heads, chunk = 64, chunks = (tokens + chunk - 1) / chunk;
    const int64_t units = rows * kv_heads * chunks, ld = capacity + KB;
    /* big chunks first: the last queries of a causal prompt see the most keys */
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        float *kt = scratch + (int64_t)omp_get_thread_num() * d * ld;
        const int64_t ch = chunks - 1 - u % chunks, g = (u / chunks) % kv_heads, r = u / (chunks * kv_heads);
        const int64_t t0 = ch * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        attend_unit(q + r * tokens * q_stride, q_stride, t0, t1, positions + r * tokens, heads, g, group, d,
                    k_cache + (r * kv_heads + g) * capacity * d, v_cache + (r * kv_heads + g) * capacity * d, 0,
                    scale, window, softcap, out + r * tokens * heads * d, kt, ld);
    }
    return 0;
#else
    return -1;
#endif
}

/* The paged layout's prefill chunks: runs[3 * i ..] = (sequence slot, first token, end token) of n_runs runs
   of consecutive positions in a step of tokens q [N, Hq, d] (token rows q_stride apart), whose keys and values
   are already in their blocks (pools [blocks, Hkv, B, d], tables [S, table_stride]). Each unit (run, key/value
   head, chunk of 64 queries) copies the key and value rows it reads out of the blocks into scratch, then
   attends as poot_attend_blocks does over a contiguous cache: query for query the same arithmetic. out
   [N, Hq, d] (the runs' tokens only). scratch: per thread, d * (3 * span + KB) floats, span the most
   positions a run reads (a multiple of KB). Returns 0, or -1 without AVX-512 or AVX2 + FMA. */
int poot_attend_paged_blocks(const float *q, int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t d,
                             const float *k_pool, const float *v_pool, int64_t block, const int64_t *tables,
                             int64_t table_stride, const int64_t *runs, int64_t n_runs, const int64_t *positions,
                             float scale, int64_t window, float softcap, float *out, float *scratch, int64_t span,
                             int threads) {
#if defined(__AVX512F__) || POOT_AVX2
    const int64_t group = heads / kv_heads, chunk = 64, ld = span + KB;
    int64_t units = 0;
    for (int64_t i = 0; i < n_runs; i++) units += (runs[3 * i + 2] - runs[3 * i + 1] + chunk - 1) / chunk;
    units *= kv_heads;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        float *kt = scratch + (int64_t)omp_get_thread_num() * d * (ld + 2 * span);
        float *kc = kt + d * ld, *vc = kc + d * span;
        /* unit u: key/value head u % kv_heads of the (u / kv_heads)-th chunk, runs in order */
        const int64_t g = u % kv_heads;
        int64_t c = u / kv_heads, i = 0;
        for (;; i++) {
            const int64_t count = (runs[3 * i + 2] - runs[3 * i + 1] + chunk - 1) / chunk;
            if (c < count) break;
            c -= count;
        }
        const int64_t *table = tables + runs[3 * i] * table_stride;
        const int64_t r0 = runs[3 * i + 1], r1 = runs[3 * i + 2];
        const int64_t t0 = r0 + c * chunk, t1 = t0 + chunk < r1 ? t0 + chunk : r1;
        int64_t base = window > 0 && positions[t0] - window + 1 > 0 ? positions[t0] - window + 1 : 0;
        base -= base % KB;
        for (int64_t p = base; p <= positions[t1 - 1]; p++) {  /* the rows this unit reads, out of the blocks */
            const int64_t at = ((table[p / block] * kv_heads + g) * block + p % block) * d;
            memcpy(kc + (p - base) * d, k_pool + at, sizeof(float) * (size_t)d);
            memcpy(vc + (p - base) * d, v_pool + at, sizeof(float) * (size_t)d);
        }
        attend_unit(q, q_stride, t0, t1, positions, heads, g, group, d, kc, vc, base, scale, window, softcap, out,
                    kt, ld);
    }
    return 0;
#else
    return -1;
#endif
}
