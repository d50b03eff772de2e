"""The CPU executor's C kernels: one shared library, built at first use with the system C compiler.

The C sources are package data in `csrc/` (every `*.c` there is one part of the library; `common.h` holds
the helpers the parts share). They are compiled together once per source text, flags and machine
(-march=native, OpenMP) into a cached library, loaded, and their argument types declared from SIGNATURES.
Where there is no compiler, the build fails (a warning, once, with the compiler's first error lines), or
POOT_CPU_KERNELS=0, `kernels()` is None and every caller uses its torch route instead.

`python -m poot_core.cpu.c_kernels` builds and reports the library, its flags and kernels, or the error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("csrc")
_log = logging.getLogger(__name__)

# -falign-loops=32: where the linker happens to place a hot loop otherwise decides its speed (the bf16 GEMV
# took 40 or 66 us on the same matrix, in two builds differing only in code placement on an AMD EPYC).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-falign-loops=32", "-shared", "-fPIC")
# How much of the compiler's output a failed build shows.
ERROR_LINES = 12

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Every exported C function: (argument types, result type). The callers are packed_linear (matrix products from
# packed or 16-bit weights), c_attention (attention over the cache) and small_ops (norms, rope, silu).
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    # quant32.c: y = x @ W^T and dequantization for the 32-value block types (see packed_linear.CKernel)
    "poot_gemv": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    "poot_dequant": ([_i32, _p, _i64, _i64, _i64, _p, _i32], None),
    "poot_gemv_many": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),  # any number of rows
    # kquant.c: the same for the 256-value K-quant types
    "poot_gemv_k": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    "poot_dequant_k": ([_i32, _p, _i64, _i64, _i64, _p, _i32], None),
    # kquant_low.c: the same for Q2_K, Q3_K and IQ4_XS
    "poot_gemv_kl": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    "poot_dequant_kl": ([_i32, _p, _i64, _i64, _i64, _p, _i32], None),
    # q8dot.c: decode products with x quantized to 8 bits per 32 values (LoadOptions(cpu_activations="q8"))
    "poot_gemv_q8": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    "poot_quantize_q8": ([_p, _i64, _i64, _p, _p, _p], None),
    "poot_gemm_q8": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),  # any number of rows (prefill)
    # gemm.c: exact products of many rows (prefill) through dequantized panels (a dequant function by address)
    "poot_gemm_panels": ([_p, _i32, _i32, _p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    "poot_widen16": ([_i32, _p, _i64, _i64, _i64, _p, _i32], None),
    # dense16.c: bf16 / f16 weights
    "poot_gemv16": ([_p, _i64, _i64, _i64, _p, _i64, _p, _i32, _i32], None),
    # attention.c
    "poot_attend_few": ([_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _p, _f32, _i64, _f32, _p,
                         _p, _i32, _p, _p, _i64, _i32, _p], None),
    "poot_attend_blocks": ([_p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _p, _f32, _i64, _f32, _p, _p,
                            _i32], _i32),
    "poot_attend_paged_blocks": ([_p, _i64, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _p, _i64, _p, _f32, _i64, _f32,
                                  _p, _p, _i64, _i32], _i32),
    "poot_attend_paged": ([_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _p, _p, _f32, _i64,
                           _f32, _p, _p, _i64, _i32], None),
    # small_ops.c
    "poot_add_rms_norm": ([_p, _p, _p, _i64, _i64, _f32, _p, _p, _i32], None),
    "poot_rope": ([_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i32, _p, _i32], None),
    "poot_silu_mul": ([_p, _i64, _p, _i64, _i64, _i64, _p, _i32], None),
    # gather.c: rows by index through one of the dequant functions above (its address first)
    "poot_gather_rows": ([_p, _i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], None),
    # rows.c: a decode product over any number of rows (its gemv by address first)
    "poot_gemv_rows": ([_p, _i32, _p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _p, _i32], None),
    # features.c
    "poot_features": ([], _i32),
}
# The bits of poot_features().
FEATURE_BITS = {"avx512f": 1, "avx2": 2, "fma": 4, "f16c": 8}


class KernelBuildError(RuntimeError):
    """The C kernels could not be built or loaded; the message carries the compiler's first error lines."""


class KernelBuildWarning(RuntimeWarning):
    """Shown once when the C kernels cannot be built: the CPU executor then takes its (slower) torch routes."""


def cache_dir() -> Path:
    root = os.environ.get("POOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "poot"
    )
    return Path(root) / "kernels"


def compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def _cpuinfo_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not there)."""
    return frozenset(_cpuinfo_flags_line().partition(":")[2].split())


def _machine_key() -> str:
    return platform.machine() + _cpuinfo_flags_line()


def sources(src_dir: Path) -> list[Path]:
    """The files the library is built from: every .c (compiled) and .h (included) in src_dir, in name order."""
    return sorted(p for p in src_dir.iterdir() if p.suffix in (".c", ".h"))


def library_path(src_dir: Path = SOURCE_DIR, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library built from src_dir with flags lives in the cache: keyed by the sources' names and
    bytes, the compiler, the flags and the machine."""
    digest = hashlib.sha256()
    for path in sources(src_dir):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update((compiler() + " " + " ".join(flags) + _machine_key()).encode())
    return cache_dir() / f"cpu_kernels_{digest.hexdigest()[:16]}.so"


def _first_error_lines(output: str) -> str:
    lines = output.splitlines()
    start = next((i for i, ln in enumerate(lines) if "error" in ln.lower()), 0)
    return "\n".join(lines[start : start + ERROR_LINES])


def build(src_dir: Path = SOURCE_DIR, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library built from src_dir (compiled now unless the cache has it); KernelBuildError if it fails.
    Other flags than FLAGS are for tests (a build without vector instructions, say)."""
    target = library_path(src_dir, flags)
    if target.exists():
        return target
    c_files = [str(p) for p in sources(src_dir) if p.suffix == ".c"]
    if not c_files:
        raise KernelBuildError(f"no C sources in {src_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "k.so"
        cmd = [compiler(), *flags, "-o", str(out), *c_files, "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:
            raise KernelBuildError(f"no C compiler: {cmd[0]!r} not found (set CC)") from None
        except subprocess.TimeoutExpired:
            raise KernelBuildError(f"the compiler took over 300 s: {' '.join(cmd)}") from None
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                                   + _first_error_lines(done.stderr or done.stdout))
        os.replace(out, target)  # atomic: a parallel builder ends with the same file
    return target


def load(path: Path) -> ctypes.CDLL:
    """The library at path with the argument types of SIGNATURES declared; KernelBuildError if one is missing."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from None
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise KernelBuildError(f"{path} lacks {', '.join(missing)}")
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


# Every kernel has a vector route for these (AVX-512 machines have them too); without them the portable C
# routes are slower than torch (measured on an AVX2 machine: bf16 GEMV 16x, decode attention 7x), so the
# library is not used there.
REQUIRED_FEATURES = frozenset({"avx2", "fma", "f16c"})


class Loader:
    """Builds and loads the library from one source folder at the first get(), once; a failure warns once and
    leaves get() None from then on, as does a build without REQUIRED_FEATURES (with an info log line)."""

    def __init__(self, src_dir: Path = SOURCE_DIR) -> None:
        self.src_dir = src_dir
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        lib = load(build(self.src_dir))
                        lacking = REQUIRED_FEATURES - features(lib)
                        if lacking:
                            _log.info("poot: the CPU C kernels are not used: this machine lacks %s",
                                      ", ".join(sorted(lacking)))
                        else:
                            self._lib = lib
                    except KernelBuildError as e:
                        warnings.warn(f"poot: the CPU C kernels are unavailable, the slower torch routes are used "
                                      f"instead. {e}", KernelBuildWarning, stacklevel=3)
                    self._tried = True
        return self._lib


_default = Loader()


def features(lib: ctypes.CDLL) -> frozenset[str]:
    """The instruction sets the library was compiled for (names of FEATURE_BITS); the kernels pick their vector
    routes at compile time (AVX-512 where it is there, else AVX2 + FMA)."""
    bits = lib.poot_features()
    return frozenset(name for name, bit in FEATURE_BITS.items() if bits & bit)


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are disabled or cannot be built (then torch does the work)."""
    if os.environ.get("POOT_CPU_KERNELS", "1") == "0":
        return None
    return _default.get()


def main() -> int:
    """Build (or find in the cache) the library and report it, or the compiler's error."""
    print(f"sources:  {SOURCE_DIR} ({', '.join(p.name for p in sources(SOURCE_DIR))})")
    print(f"compiler: {compiler()} {' '.join(FLAGS)}")
    if os.environ.get("POOT_CPU_KERNELS", "1") == "0":
        print("note:     POOT_CPU_KERNELS=0 is set, so the executor does not use the library")
    cached = library_path().exists()
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except (KernelBuildError, OSError) as e:
        print(f"build failed: {e}")
        return 1
    print(f"library:  {path} ({'cached' if cached else 'built now'})")
    if hasattr(lib, "poot_features"):
        lib.poot_features.restype = ctypes.c_int
        print(f"uses:     {', '.join(sorted(features(lib))) or 'no vector extensions'}")
        lacking = REQUIRED_FEATURES - features(lib)
        if lacking:
            print(f"note:     the executor does not use the library: it lacks {', '.join(sorted(lacking))}")
    for name in SIGNATURES:
        print(f"  {name:<20} {'present' if hasattr(lib, name) else 'MISSING'}")
    from poot_core.cpu.packed_linear import C_TYPES

    print(f"block types with a C kernel: {', '.join(C_TYPES)}")
    return 0 if all(hasattr(lib, name) for name in SIGNATURES) else 1


if __name__ == "__main__":
    sys.exit(main())
