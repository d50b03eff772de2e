"""Integer codes packed into 32-bit words as GPTQ / AWQ store them, and float8 e4m3fn decoded from the format."""

from __future__ import annotations

import numpy as np


def e4m3_to_float(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float32, from the format: 1 sign, 4 exponent (bias 7), 3 mantissa, S.1111.111 NaN."""
    b = bits.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * value).astype(np.float32)


def pack_along_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """[r, c] codes -> int32 [r * bits / 32, c]: value i of a word from row i, lowest bits first."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for i in range(per):
        out |= q[i::per].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def pack_along_cols(q: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    per = 32 // bits
    order = order or list(range(per))
    out = np.zeros((q.shape[0], q.shape[1] // per), dtype=np.uint32)
    for i in range(per):  # slot i of each word holds column order[i] of its group
        out |= q[:, order[i] :: per].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)
