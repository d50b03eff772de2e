"""RMSNorm (with the residual add before it) and rope in C, for steps of a few tokens.

At decode these ops touch a few KB, so torch's per-call cost (several small ops each, about 8-11 us per call
for SmolLM2) outweighs the arithmetic many times over; one C call costs about 2 us. The arithmetic is the
same float32 arithmetic as ops.rms_norm and ops.rope (only the order of the sum of squares differs). Each
function returns None where it does not apply, and the caller uses torch.
"""

from __future__ import annotations

import ctypes

import torch

from poot_core.cpu.c_kernels import kernels

# Up to this many values per call the C route pays; above it (prefill) torch's vectorized ops are as fast.
MAX_VALUES = 1 << 16

C_SOURCE = r"""
#include <math.h>

/* For each of rows rows of n values: if y, sum = x + y (written to sum_out); then
   norm_out = sum / sqrt(mean(sum^2) + eps) * w. */
void poot_add_rms_norm(const float *x, const float *y, const float *w, int64_t rows, int64_t n, float eps,
                       float *sum_out, float *norm_out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *s = y ? sum_out + r * n : (float *)xr;
        if (y)
            for (int64_t i = 0; i < n; i++) s[i] = xr[i] + y[r * n + i];
        float lanes[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += s[i + l] * s[i + l];
        float total = 0.0f;
        for (; i < n; i++) total += s[i] * s[i];
        for (int l = 0; l < 16; l++) total += lanes[l];
        const float inv = 1.0f / sqrtf(total / (float)n + eps);
        for (int64_t j = 0; j < n; j++) norm_out[r * n + j] = s[j] * inv * w[j];
    }
}

/* x [rows, heads, head_dim]; rotates the first 2 * half features of each head by the angle table of its row
   (cos, sin [rows, half]): pairs (2i, 2i + 1) when interleaved, else (i, i + half). The rest is copied. */
void poot_rope(const float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t half, const float *cos_t,
               const float *sin_t, int interleaved, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + (r * heads + h) * head_dim;
            float *oh = out + (r * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
                const float a = xh[ia], b = xh[ib];
                oh[ia] = a * c[i] - b * s[i];
                oh[ib] = b * c[i] + a * s[i];
            }
            for (int64_t i = 2 * half; i < head_dim; i++) oh[i] = xh[i];
        }
    }
}
"""


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of this module's C functions (called by poot_core.cpu.c_kernels once it loads them)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.poot_add_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float, p, p]
    lib.poot_add_rms_norm.restype = None
    lib.poot_rope.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_int, p]
    lib.poot_rope.restype = None


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= MAX_VALUES for t in tensors)


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
                          total.data_ptr(), norm.data_ptr())
    return total, norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """x [R, T, H, Dh] rotated by cos, sin [R, T, 1, half] (as ops.rope_tables gives them); None where the C
    route does not apply."""
    lib = kernels()
    if lib is None or not _fits(x, cos, sin) or x.dim() != 4:
        return None
    rows, tokens, heads, head_dim = x.shape
    half = cos.shape[-1]
    out = torch.empty_like(x)
    lib.poot_rope(x.data_ptr(), rows * tokens, heads, head_dim, half, cos.data_ptr(), sin.data_ptr(),
                  int(interleaved), out.data_ptr())
    return out
