"""The CPU executor's C library in two builds, for tests that call its kernels directly: the machine's own
(-march=native: its vector routes) and one without vector instructions (the portable C)."""

from __future__ import annotations

import ctypes

from poot_core.cpu import c_kernels

PORTABLE = tuple("-march=x86-64" if f == "-march=native" else f for f in c_kernels.FLAGS)
BUILDS = {"native": c_kernels.FLAGS, "portable": PORTABLE}
_libs: dict[str, ctypes.CDLL] = {}


def library(build: str) -> ctypes.CDLL:
    """The loaded library of `build` (a key of BUILDS), built at its first use (c_kernels caches the build)."""
    if build not in _libs:
        _libs[build] = c_kernels.load(c_kernels.build(flags=BUILDS[build]))
    return _libs[build]
