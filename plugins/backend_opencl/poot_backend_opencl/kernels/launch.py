"""A kernel with its arguments bound once, and the device arrays and weights the arguments name.

A step is a list of `Launch`es. Scalars and buffers are set on the kernel object when the launch is made; a
`Slot` argument (a KV cache, which belongs to the caller's state) is set when the program is first run on that
state, and again only if the state changes. Enqueueing a step is then one call per kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Arr:
    """A device array of float32 (or uint32 ids) values."""

    buf: Any
    shape: tuple[int, ...]
    dtype: str = "f32"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def view(self, shape: tuple[int, ...]) -> Arr:
        return Arr(self.buf, tuple(shape), self.dtype)


@dataclass(frozen=True)
class Slot:
    """A state buffer named by the graph (a KV cache), bound at run time."""

    name: str


@dataclass
class DeviceWeight:
    """A [rows, cols] matrix in its stored format `fmt` (f32, f16, bf16 or a GGUF block type), rows row0..
    of the buffer (an expert of a stacked [experts, rows, cols] tensor is a row range of it)."""

    buf: Any
    fmt: str
    rows: int
    cols: int
    row_bytes: int
    row0: int = 0

    def rows_of(self, start: int, count: int) -> DeviceWeight:
        return DeviceWeight(self.buf, self.fmt, count, self.cols, self.row_bytes, self.row0 + start)


def _scalar(value: Any) -> Any:
    if isinstance(value, bool | int | np.integer):
        return np.int32(value)
    if isinstance(value, float | np.floating):
        return np.float32(value)
    return value


class Launch:
    def __init__(self, runtime: Any, kernel: Any, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                 args: list[Any]) -> None:
        self.runtime, self.kernel = runtime, kernel
        self.global_size, self.local_size = tuple(int(g) for g in global_size), local_size
        self.slots: list[tuple[int, str]] = []
        self.args = args  # OpenCL does not keep a buffer alive for a kernel that names it: the launch does
        for i, arg in enumerate(args):
            if isinstance(arg, Slot):
                self.slots.append((i, arg.name))
                continue
            if isinstance(arg, Arr):
                arg = arg.buf
            elif isinstance(arg, DeviceWeight):
                arg = arg.buf
            kernel.set_arg(i, _scalar(arg))

    def bind(self, state: dict[str, Any]) -> None:
        for i, name in self.slots:
            self.kernel.set_arg(i, state[name])

    def enqueue(self, queue: Any) -> Any:
        """The kernel's event (None for an empty range); the step drops it, a profiling pass reads it."""
        if all(self.global_size):
            return self.runtime.cl.enqueue_nd_range_kernel(queue, self.kernel, self.global_size, self.local_size)
        return None


def rounded(n: int, multiple: int = 64) -> int:
    return -(-int(n) // multiple) * multiple
