"""Attention for a few queries per row (decode), read straight from the float32 key/value cache.

torch's scaled_dot_product_attention is built for many queries: for one query over a few hundred cached keys
it spends most of its time outside the arithmetic (about 110 us per layer for SmolLM2 at position 600, where
the keys and values are under 1 MB). This C kernel does the plain thing instead: per query head, the scores
against the kept keys of its key/value head, a float32 softmax, and the weighted sum of the values. Heads that
share a key/value head run back to back on one thread, so those keys are read from cache. The arithmetic is
float32 throughout; only the order of the sums differs from torch's.
"""

from __future__ import annotations

import ctypes

import torch

from poot_core.cpu.c_kernels import kernels

# Up to this many queries per row the kernel beats torch's; more (prefill) go to torch.
MAX_QUERIES = 4

C_SOURCE = r"""

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* o[0..n) += w * v[0..n) */
static inline void axpy_f32(float *o, float w, const float *v, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 wv = _mm512_set1_ps(w);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o + i)));
#endif
    for (; i < n; i++) o[i] += w * v[i];
}

/* s[i] = exp(s[i] - top) for i < n, returning the sum (exp16 of the prelude; expf for the tail). */
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
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - top);
        total += s[i];
    }
    return total;
}

/* Writes the step's keys and values k [R, T, Hkv, Dk], v [R, T, Hkv, Dv] into the caches [R, Hkv, C, Dk|Dv]
   (contiguous) at their positions [R, T], then out[R, T, Hq, Dv] = softmax(scale * q . k) v for
   q [R, T, Hq, Dk]. Query t of row r sees the keys at max(0, p - window + 1) .. p, p = positions[r, t]
   (window <= 0: no window); softcap > 0 applies softcap * tanh(score / softcap). scratch: [threads, C]. */
void poot_attend_few(const float *q, const float *k, const float *v, int64_t rows, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t dk, int64_t dv, float *k_cache, float *v_cache, int64_t capacity,
                     const int64_t *positions, float scale, int64_t window, float softcap, float *out,
                     float *scratch, int threads) {
    const int64_t units = rows * tokens * heads, group = heads / kv_heads;
    for (int64_t rt = 0; rt < rows * tokens; rt++)
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = ((rt / tokens) * kv_heads + g) * capacity + positions[rt];
            memcpy(k_cache + at * dk, k + (rt * kv_heads + g) * dk, sizeof(float) * (size_t)dk);
            memcpy(v_cache + at * dv, v + (rt * kv_heads + g) * dv, sizeof(float) * (size_t)dv);
        }
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
        for (int64_t j = 0; j < n; j++) axpy_f32(o, s[j], vb + j * dv, dv);
        for (int64_t d = 0; d < dv; d++) o[d] *= inv;
    }
}
"""


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of this module's C function (called by poot_core.cpu.c_kernels once it loads them)."""
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.poot_attend_few.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, p, p, i64, p, f32, i64, f32, p, p,
                                    ctypes.c_int]
    lib.poot_attend_few.restype = None


def attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor | None:
    """Writes k, v [R, T, Hkv, D] into the caches [R, Hkv, C, D] at positions [R, T], then attends q [R, T, Hq, Dk]
    over the kept keys. Returns [R, T, Hq, Dv], or None where the kernel does not apply, having written
    nothing (then the caller uses torch)."""
    lib = kernels()
    rows, tokens, heads, dk = q.shape
    f32 = torch.float32
    if (lib is None or tokens > MAX_QUERIES or any(t.dtype != f32 for t in (q, k, v, k_cache, v_cache))
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or heads % k_cache.shape[1] != 0):
        return None
    kv_heads, capacity, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = positions.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    out = torch.empty(rows, tokens, heads, dv)
    scratch = torch.empty(threads, capacity)
    lib.poot_attend_few(q.data_ptr(), k.data_ptr(), v.data_ptr(), rows, tokens, heads, kv_heads, dk, dv,
                        k_cache.data_ptr(), v_cache.data_ptr(), capacity, pos.data_ptr(), scale, window or 0,
                        softcap or 0.0, out.data_ptr(), scratch.data_ptr(), threads)
    return out
