"""One OpenCL device: its context and queue, the limits the kernels are chosen by, and its built programs.

Programs are built once per (device, source, defines) and kept for the life of the runtime; pyopencl's binary
cache keeps the compiled binaries across processes too, so pocl's LLVM compile is paid once per machine.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from poot_core.errors import CapacityError, Reason, Unsupported

CPU_TYPE = 2  # CL_DEVICE_TYPE_CPU (pyopencl.device_type.CPU), kept here so the probe needs no enum lookups
GROUP = 64  # the work-group size the kernels are written for, when the device allows it
GEMV_GROUP = 256  # the one-token products' work-groups (cl/gemv.cl): several rows each, when the device allows it


def opencl_devices() -> list[Any]:
    """Every OpenCL device of every platform; [] when pyopencl, the ICD loader or a driver is missing."""
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.LogicError:  # no platform: the ICD loader found no driver
        return []
    devices = []
    for platform in platforms:
        try:
            devices.extend(platform.get_devices())
        except cl.Error:
            continue
    return devices


def is_cpu_device(device: Any) -> bool:
    return bool(int(device.type) & CPU_TYPE)


def describe(device: Any) -> str:
    kind = "CPU" if is_cpu_device(device) else "GPU" if int(device.type) & 4 else "other"
    return (f"{device.platform.name.strip()} / {device.name.strip()} ({kind}, {device.global_mem_size >> 20} MiB, "
            f"work-group {device.max_work_group_size}, local {device.local_mem_size >> 10} KiB)")


def pick_device(devices: list[Any]) -> Any:
    """A GPU first (the device with most memory among them), else whatever is there."""
    gpus = [d for d in devices if not is_cpu_device(d)]
    return max(gpus or devices, key=lambda d: int(d.global_mem_size))


@dataclass(frozen=True)
class Limits:
    """What the kernels need to know of the device, read once."""

    group: int  # work-group size of the reduction kernels (a power of two)
    gemv_group: int  # work-group size of the one-token products (a power of two, >= group)
    local_bytes: int
    max_alloc: int
    fp16: bool  # cl_khr_fp16 (arithmetic in half); f16 weights are read with vload_half, core OpenCL
    subgroups: bool

    @classmethod
    def of(cls, device: Any) -> Limits:
        limit = int(device.max_work_group_size)
        largest = 1 << int(math.log2(max(limit, 1)))
        group = min(GROUP, largest)
        extensions = device.extensions.split()
        return cls(group, min(GEMV_GROUP, largest), int(device.local_mem_size), int(device.max_mem_alloc_size),
                   "cl_khr_fp16" in extensions, "cl_khr_subgroups" in extensions or "cl_intel_subgroups" in extensions)


@functools.cache
def kernel_source(name: str) -> str:
    return (resources.files("poot_backend_opencl.kernels") / "cl" / f"{name}.cl").read_text()


class Runtime:
    def __init__(self, device: Any | None = None, profiling: bool = False) -> None:
        """`profiling`: a queue whose events carry device times (a benchmark's timing pass)."""
        import pyopencl as cl

        self.cl = cl
        if device is None:
            devices = opencl_devices()
            if not devices:
                raise Unsupported(Reason.BACKEND, "opencl", "no OpenCL device found (install an OpenCL driver; "
                                  "pocl-opencl-icd for the CPU)")
            device = pick_device(devices)
        self.device = device
        self.limits = Limits.of(device)
        if self.limits.group < 16 or self.limits.local_bytes < 4096:
            raise Unsupported(Reason.BACKEND, "opencl", f"the device {device.name.strip()} has work-groups of "
                              f"{self.limits.group} and {self.limits.local_bytes} bytes of local memory; the "
                              "kernels need 16 and 4096")
        self.context = cl.Context([device])
        props = cl.command_queue_properties.PROFILING_ENABLE if profiling else 0
        self.queue = cl.CommandQueue(self.context, properties=props)
        self._programs: dict[tuple[tuple[str, ...], tuple[tuple[str, Any], ...]], Any] = {}
        self._dummy: Any | None = None

    @property
    def is_cpu(self) -> bool:
        return is_cpu_device(self.device)

    def program(self, sources: tuple[str, ...], **defines: Any) -> Any:
        """The built program of the concatenated `sources` (names of cl/*.cl) with `defines`, built once."""
        key = (sources, tuple(sorted(defines.items())))
        found = self._programs.get(key)
        if found is None:
            defines = {"GROUP": self.limits.group, **defines}
            text = "\n".join(f"#define {k} {v}" for k, v in sorted(defines.items()))
            text += "\n" + "\n".join(kernel_source(s) for s in sources)
            found = self._programs[key] = self.cl.Program(self.context, text).build(options=["-cl-std=CL1.2"])
        return found

    def kernel(self, sources: tuple[str, ...], name: str, **defines: Any) -> Any:
        """A fresh kernel object (its arguments are its own, bound once by the caller)."""
        return self.cl.Kernel(self.program(sources, **defines), name)

    def buffer(self, nbytes: int) -> Any:
        nbytes = max(4, int(nbytes))
        if nbytes > self.limits.max_alloc:
            raise CapacityError(f"a buffer of {nbytes} bytes exceeds the OpenCL device's largest allocation "
                                f"({self.limits.max_alloc} bytes)")
        return self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, nbytes)

    def upload(self, host: np.ndarray) -> Any:
        host = np.ascontiguousarray(host)
        buf = self.buffer(host.nbytes)
        if host.nbytes:
            self.cl.enqueue_copy(self.queue, buf, host, is_blocking=True)
        return buf

    def zeros(self, nbytes: int) -> Any:
        buf = self.buffer(nbytes)
        self.cl.enqueue_fill_buffer(self.queue, buf, np.uint32(0), 0, max(4, int(nbytes)) // 4 * 4)
        return buf

    def read(self, buf: Any, count: int, dtype: Any = np.float32, offset: int = 0) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        if count:
            self.cl.enqueue_copy(self.queue, out, buf, src_offset=offset * out.itemsize, is_blocking=True)
        return out

    def write(self, buf: Any, host: np.ndarray) -> None:
        self.cl.enqueue_copy(self.queue, buf, np.ascontiguousarray(host), is_blocking=True)

    def copy(self, src: Any, dst: Any, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> None:
        self.cl.enqueue_copy(self.queue, dst, src, byte_count=int(nbytes), src_offset=int(src_offset),
                             dst_offset=int(dst_offset))

    @property
    def dummy(self) -> Any:
        """A 4-byte buffer for an absent optional argument (a kernel's flag says it is not read)."""
        if self._dummy is None:
            self._dummy = self.zeros(4)
        return self._dummy

    def finish(self) -> None:
        self.queue.finish()
