"""Enqueueing a step's kernels with the least host work: the OpenCL library's clEnqueueNDRangeKernel called
directly, with the work sizes packed once and no event asked for.

A decode step is a few hundred launches whose arguments never change, so the host time per launch is what is
left: pyopencl's enqueue makes and later frees an event per call and converts the sizes each time. Here each
launch is (kernel handle, dimensions, packed global and local sizes), made once when the step is prepared; a
step is one library call per kernel. Where the library's entry point cannot be found (or the sizes are empty)
the launch goes through pyopencl as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

from poot_core.errors import Reason, Unsupported

SUCCESS = 0


@functools.cache
def library_enqueue() -> Any | None:
    """clEnqueueNDRangeKernel of the OpenCL ICD loader pyopencl already loaded; None when not found."""
    for name in ("libOpenCL.so.1", ctypes.util.find_library("OpenCL")):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).clEnqueueNDRangeKernel
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def sizes(values: tuple[int, ...] | None) -> Any:
    return None if values is None else (ctypes.c_size_t * len(values))(*values)


class Enqueuer:
    """Enqueues prepared launches (objects with .kernel, .global_size, .local_size) on one queue."""

    def __init__(self, queue: Any, launches: list[Any], direct: bool = True) -> None:
        self.queue, self.launches = queue, launches
        fn = library_enqueue() if direct else None
        self.direct = fn is not None
        self._fn = fn
        live = [launch for launch in launches if all(launch.global_size)]  # an empty range launches nothing
        self._calls = [(launch.kernel.int_ptr, len(launch.global_size), sizes(launch.global_size),
                        sizes(launch.local_size)) for launch in live]
        self._live = live
        self._queue_ptr = queue.int_ptr

    def __call__(self) -> None:
        if not self.direct:
            for launch in self._live:
                launch.enqueue(self.queue)
            return
        fn, queue = self._fn, self._queue_ptr
        for kernel, dims, global_size, local_size in self._calls:
            status = fn(queue, kernel, dims, None, global_size, local_size, 0, None, None)
            if status != SUCCESS:
                self._fail(status, kernel)

    def _fail(self, status: int, kernel: int) -> None:
        name = next(launch.kernel.function_name for launch in self._live if launch.kernel.int_ptr == kernel)
        raise Unsupported(Reason.BACKEND, f"opencl kernel {name}", f"the device refused its launch (status {status})")
