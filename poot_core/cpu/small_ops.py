"""RMSNorm (with the residual add before it), rope and silu(gate) * up in C.

At decode these ops touch a few KB, so torch's per-call cost (several small ops each, about 8-11 us per call
for SmolLM2) outweighs the arithmetic many times over; one C call costs about 2 us. At prefill one pass over
the rows on every core replaces several torch passes over memory. The arithmetic is the float32 arithmetic of
ops.rms_norm, ops.rope and ops.gated (the order of the sum of squares differs, and silu's exp is the
prelude's 2-ulp exp16). Each function returns None where it does not apply, and the caller uses torch.
"""

from __future__ import annotations

import ctypes

import torch

from poot_core.cpu.c_kernels import kernels

C_SOURCE = r"""
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
#endif
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] for rows of n values, gate and up rows g_stride and u_stride apart
   (views into one joined gate/up product). silu(g) = g / (1 + exp(-g)). */
void poot_silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, int64_t rows,
                   int64_t n, float *out, int threads) {
    POOT_ROWS(rows, threads, silu_mul_row(gate + r * g_stride, up + r * u_stride, n, out + r * n))
}
"""


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of this module's C functions (called by poot_core.cpu.c_kernels once it loads them)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.poot_add_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float, p, p, i32]
    lib.poot_rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, i32, p, i32]
    lib.poot_silu_mul.argtypes = [p, i64, p, i64, i64, i64, p, i32]
    for fn in (lib.poot_add_rms_norm, lib.poot_rope, lib.poot_silu_mul):
        fn.restype = None


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + y, rms_norm(x + y) * w) for float32 x, y [..., n] and a float32 scale w [n]; with y None the first
    value is x itself. None where the C route does not apply."""
    lib = kernels()
    if lib is None or not _fits(x, w) or (y is not None and (not _fits(y) or y.shape != x.shape)):
        return None
    n = x.shape[-1]
    total = torch.empty_like(x) if y is not None else x
    norm = torch.empty_like(x)
    lib.poot_add_rms_norm(x.data_ptr(), None if y is None else y.data_ptr(), w.data_ptr(), x.numel() // n, n, eps,
                          total.data_ptr(), norm.data_ptr(), torch.get_num_threads())
    return total, norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """x [R, T, H, Dh] rotated by cos, sin [R, T, 1, half] (as ops.rope_tables gives them); None where the C
    route does not apply."""
    lib = kernels()
    if lib is None or x.dim() != 4 or x.dtype != torch.float32 or not _fits(cos, sin):
        return None
    rows, tokens, heads, head_dim = x.shape
    # each token's heads lie together; tokens may lie apart (q or k inside a joined q/k/v product)
    if x.stride(3) != 1 or x.stride(2) != head_dim or (rows > 1 and x.stride(0) != tokens * x.stride(1)):
        return None
    half = cos.shape[-1]
    out = torch.empty(x.shape)
    lib.poot_rope(x.data_ptr(), x.stride(1), rows * tokens, heads, head_dim, half, cos.data_ptr(), sin.data_ptr(),
                  int(interleaved), out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for float32 [..., n] tensors whose rows may lie apart (views into one joined gate/up
    product, each row's n values contiguous); None where the C route does not apply."""
    lib = kernels()
    if (lib is None or gate.dtype != torch.float32 or up.dtype != torch.float32 or gate.shape != up.shape
            or gate.dim() < 2):
        return None
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views where the leading dimensions allow it
    if g.stride(1) != 1 or u.stride(1) != 1:
        return None
    out = torch.empty(gate.shape)
    lib.poot_silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.shape[0], n, out.data_ptr(),
                      torch.get_num_threads())
    return out
