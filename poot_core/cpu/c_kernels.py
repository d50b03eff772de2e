"""The CPU executor's C kernels: one shared library, built at first use with the system C compiler.

The C text lives beside the Python that calls it (packed_linear for matrix products from packed or 16-bit
weights, c_attention for attention over the cache, small_ops for norms and rope). Here it is joined,
compiled once per source text and machine (-march=native, OpenMP) into a cached library, and loaded. Where
there is no compiler, or POOT_CPU_KERNELS=0, `kernels()` is None and every caller uses its torch route instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

# Included once, before every part: the headers and the helpers more than one part uses.
PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for 16 floats: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (about
   2 ulp, as vectorized exp libraries are); inputs below -104 give 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f),
                                _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#endif

/* Rope for one token: its heads of head_dim values (x; out may lie elsewhere, even in the cache), the first
   2 * half features of each rotated by (c, s): pairs (2i, 2i + 1) when interleaved, else (i, i + half); the
   rest copied. */
static void rope_row(const float *x, int64_t heads, int64_t head_dim, int64_t half, const float *c, const float *s,
                     int interleaved, float *out) {
    for (int64_t h = 0; h < heads; h++) {
        const float *xh = x + h * head_dim;
        float *oh = out + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
            const float a = xh[ia], b = xh[ib];
            oh[ia] = a * c[i] - b * s[i];
            oh[ib] = b * c[i] + a * s[i];
        }
        for (int64_t i = 2 * half; i < head_dim; i++) oh[i] = xh[i];
    }
}
"""

# -falign-loops=32: where the linker happens to place a hot loop otherwise decides its speed (the bf16 GEMV
# took 40 or 66 us on the same matrix, in two builds differing only in code placement on an AMD EPYC).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-falign-loops=32", "-shared", "-fPIC")

_lib: ctypes.CDLL | None = None
_lib_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("POOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "poot"
    )
    return Path(root) / "kernels"


def _machine_key() -> str:
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> ctypes.CDLL:
    from poot_core.cpu import c_attention, packed_linear, small_ops  # they import this module at load time

    parts = (packed_linear, c_attention, small_ops)
    source = PRELUDE + "".join(part.C_SOURCE for part in parts)
    tag = hashlib.sha256((source + " ".join(FLAGS) + _machine_key()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels_{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(source)
            cc = os.environ.get("CC", "cc")
            cmd = [cc, *FLAGS, "-o", str(out), str(src), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(out, target)  # atomic: a parallel builder ends with the same file
    lib = ctypes.CDLL(str(target))
    for part in parts:
        part.declare(lib)
    return lib


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are disabled or cannot be built (then torch does the work)."""
    global _lib, _lib_tried
    if os.environ.get("POOT_CPU_KERNELS", "1") == "0":
        return None
    if not _lib_tried:
        with _lock:
            if not _lib_tried:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError):
                    _lib = None
                _lib_tried = True
    return _lib
