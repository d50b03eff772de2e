"""Enqueueing a step's kernels with the least host work: the OpenCL library's clEnqueueNDRangeKernel called
directly, with the work sizes packed once and no event asked for.

A decode step is a few hundred launches whose arguments never change, so the host time per launch is what is
left: pyopencl's enqueue asks the driver for an event per call (and frees it when dropped). Here each launch is
(kernel handle, dimensions, packed global and local sizes) as ctypes values made once when the step is
prepared; a step is one library call per kernel, asking for no event. On pocl the two cost about the same host
time (about 1 us a launch: pocl's enqueue is light, the ctypes call slightly dearer than pyopencl's); the gain
is meant for drivers whose events are dear, and bench/opencl_decode.py times both on the device. Where the
library's entry point cannot be found the launches go through pyopencl.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

from poot_core.errors import Reason, Unsupported

SUCCESS = 0


def loaded_loaders() -> list[str]:
    """Paths of the OpenCL ICD loaders mapped into this process (pyopencl's wheels bring their own), Linux only."""
    import pyopencl  # noqa: F401  (maps its loader)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libOpenCL" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


@functools.cache
def library_enqueue() -> Any | None:
    """clEnqueueNDRangeKernel of the OpenCL ICD loader pyopencl uses (else the system's); None when not found."""
    for name in (*loaded_loaders(), "libOpenCL.so.1", ctypes.util.find_library("OpenCL")):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).clEnqueueNDRangeKernel
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int  # no argtypes: every argument is passed as an already made ctypes value
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
        self._calls = [(ctypes.c_void_p(launch.kernel.int_ptr), ctypes.c_uint(len(launch.global_size)),
                        sizes(launch.global_size), sizes(launch.local_size)) for launch in live]
        self._live = live
        self._queue_ptr = ctypes.c_void_p(queue.int_ptr)
        self._none = ctypes.c_uint(0)

    def __call__(self) -> None:
        if not self.direct:
            for launch in self._live:
                launch.enqueue(self.queue)
            return
        fn, queue, none = self._fn, self._queue_ptr, self._none
        for kernel, dims, global_size, local_size in self._calls:
            status = fn(queue, kernel, dims, None, global_size, local_size, none, None, None)
            if status != SUCCESS:
                self._fail(status, kernel.value)

    def _fail(self, status: int, kernel: int | None) -> None:
        name = next(launch.kernel.function_name for launch in self._live if launch.kernel.int_ptr == kernel)
        raise Unsupported(Reason.BACKEND, f"opencl kernel {name}", f"the device refused its launch (status {status})")
