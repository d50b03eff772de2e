"""Shape checks shared by the kernel entry points (a wrong shape is a typed refusal, not a crash)."""

from __future__ import annotations

import math

from poot_core.errors import Reason, Unsupported

from .runtime import DeviceArray


def check(name: str, array: DeviceArray, shape: tuple[int, ...], dtype: str = "f32") -> None:
    if array.size != math.prod(shape) or array.dtype != dtype:
        raise Unsupported(Reason.SHAPE, name, f"expected {dtype} {shape}, got {array.dtype} {array.shape}")
