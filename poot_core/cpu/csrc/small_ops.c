/* RMSNorm (with the residual add before it), rope and silu(gate) * up. */
#include "common.h"

/* Runs body(r) for r < rows: serially for a few rows (decode: even an OpenMP region that runs on one thread
   costs a call into the runtime), over the threads for more (prefill). */
#define POOT_ROWS(rows, threads, body)                                       \
    if ((rows) > 8) {                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")    \
        for (int64_t r = 0; r < (rows); r++) body;                           \
    } else {                                                                 \
        for (int64_t r = 0; r < (rows); r++) body;                           \
    }

static void add_rms_norm_row(const float *x, const float *y, const float *w, int64_t n, float eps,
                             float *sum_out, float *norm_out) {
    float *s = y ? sum_out : (float *)x;
    if (y)
        for (int64_t i = 0; i < n; i++) s[i] = x[i] + y[i];
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += s[i + l] * s[i + l];
    float total = 0.0f;
    for (; i < n; i++) total += s[i] * s[i];
    for (int l = 0; l < 16; l++) total += lanes[l];
    const float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (int64_t j = 0; j < n; j++) norm_out[j] = s[j] * inv * w[j];
}

/* For each of rows rows of n values: if y, sum = x + y (written to sum_out); then
   norm_out = sum / sqrt(mean(sum^2) + eps) * w. */
void poot_add_rms_norm(const float *x, const float *y, const float *w, int64_t rows, int64_t n, float eps,
                       float *sum_out, float *norm_out, int threads) {
    POOT_ROWS(rows, threads, add_rms_norm_row(x + r * n, y ? y + r * n : 0, w, n, eps, sum_out + r * n,
                                              norm_out + r * n))
}

/* x: rows of heads * head_dim values, x_stride apart (a view into a joined q/k/v product); out [rows, heads,
   head_dim]. Rotates the first 2 * half features of each head by the angle table of its row (cos, sin
   [rows, half]): pairs (2i, 2i + 1) when interleaved, else (i, i + half). The rest is copied. */
void poot_rope(const float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t head_dim, int64_t half,
               const float *cos_t, const float *sin_t, int interleaved, float *out, int threads) {
    const int64_t width = heads * head_dim;
    POOT_ROWS(rows, threads, rope_row(x + r * x_stride, heads, head_dim, half, cos_t + r * half, sin_t + r * half,
                                      interleaved, out + r * width))
}

static void silu_mul_row(const float *g, const float *u, int64_t n, float *o) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
#elif POOT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] for rows of n values, gate and up rows g_stride and u_stride apart
   (views into one joined gate/up product). silu(g) = g / (1 + exp(-g)). */
void poot_silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, int64_t rows,
                   int64_t n, float *out, int threads) {
    POOT_ROWS(rows, threads, silu_mul_row(gate + r * g_stride, up + r * u_stride, n, out + r * n))
}
