"""The CPU executor's C kernels: one shared library, built at first use with the system C compiler.

The C text lives beside the Python that calls it (packed_linear for matrix products from packed or 16-bit
weights, decode_attention for attention over the cache, small_ops for norms and rope). Here it is joined,
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
    from poot_core.cpu import decode_attention, packed_linear, small_ops  # they import this module at load time

    parts = (packed_linear, decode_attention, small_ops)
    source = "".join(part.C_SOURCE for part in parts)
    tag = hashlib.sha256((source + _machine_key()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels_{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(source)
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(out), str(src), "-lm"]
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
