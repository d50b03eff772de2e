"""One door through which every kernel is launched.

Routing all launches through `launch` lets ahead-of-time builds record the exact launches the public
functions make (kernel, arguments, tile) without running them, then compile those for any target.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from poot_core.errors import Reason, RequestError, Unsupported

from .tuning import Tile


@dataclass
class Launch:
    """A recorded launch: the jitted kernel, its arguments by name, and the launch settings."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int
    num_stages: int
    extra: dict[str, int]


_recorder: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("poot_triton_recorder", default=None)


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within this block kernels are not run: each launch is appended to the yielded list instead."""
    launches: list[Launch] = []
    token = _recorder.set(launches)
    try:
        yield launches
    finally:
        _recorder.reset(token)


def launch(
    kernel: Any,
    grid: Sequence[int],
    tile: Tile,
    *,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **args: Any,
) -> None:
    warps = tile.num_warps if num_warps is None else num_warps
    stages = tile.num_stages if num_stages is None else num_stages
    grid = tuple(int(g) for g in grid)
    recording = _recorder.get()
    if recording is not None:
        recording.append(Launch(kernel, grid, args, warps, stages, dict(tile.extra)))
        return
    if min(grid) == 0:
        return
    kernel[grid](**args, num_warps=warps, num_stages=stages, **tile.extra)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_TYPES:
        raise Unsupported(Reason.OPERATION, f"{name}:{t.dtype}", "expected float32, float16 or bfloat16")


def check_dims(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise RequestError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RequestError(f"tensors are on different devices: {sorted(str(d) for d in devices)}")


def require(cond: bool, message: str) -> None:
    if not cond:
        raise RequestError(message)


def unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


Kernel = Callable[..., Any]
