"""The wgpu runtime the WGSL kernels run on: device, buffers, cached pipelines, batched dispatches.

Nothing here knows about models. A `Runtime` opens one Vulkan device; `Batch` records many
dispatches into one command encoder so that a whole decode step is a single queue submit.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from poot_core.errors import CapacityError, Reason, Unsupported

WORKGROUP = 64  # threads per workgroup used by every kernel
MAX_GROUPS = 65535  # maxComputeWorkgroupsPerDimension guaranteed by WebGPU

# Limits raised to whatever the adapter offers (the WebGPU defaults are far below what Vulkan drivers give).
_RAISED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
)
_DTYPES = {"f32": np.float32, "u32": np.uint32, "i32": np.int32}


def _import_wgpu() -> Any:
    if not os.environ.get("XDG_RUNTIME_DIR"):
        # Mesa's drivers print "XDG_RUNTIME_DIR is invalid or not set" on every start without it (servers,
        # containers, CI): give them a private directory so a probe stays silent.
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="poot-xdg-")
    try:
        import wgpu
    except ImportError as error:  # the package is an optional dependency of the whole project
        raise Unsupported(Reason.BACKEND, "vulkan", f"the wgpu package is not installed: {error}") from error
    return wgpu


def vulkan_adapters() -> list[Any]:
    """Every adapter that wgpu reaches through Vulkan (lavapipe counts: it is a Vulkan driver)."""
    wgpu = _import_wgpu()
    return [a for a in wgpu.gpu.enumerate_adapters_sync() if a.info.get("backend_type") == "Vulkan"]


def _adapter_rank(adapter: Any) -> int:
    order = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
    return order.get(adapter.info.get("adapter_type", ""), 4)


@dataclass
class DeviceArray:
    """A dense f32/u32/i32 array living in one wgpu storage buffer (row-major)."""

    buffer: Any
    shape: tuple[int, ...]
    dtype: str = "f32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class Runtime:
    """One wgpu device on a Vulkan adapter, with a pipeline cache.

    `max_binding_bytes` lowers the storage binding limit the kernels plan with (tests use it to force
    large weights to be split across several bindings); it never raises it above the device limit.
    """

    def __init__(self, adapter: Any | None = None, max_binding_bytes: int | None = None) -> None:
        self.wgpu = _import_wgpu()
        if adapter is None:
            adapters = sorted(vulkan_adapters(), key=_adapter_rank)
            if not adapters:
                raise Unsupported(Reason.BACKEND, "vulkan", "no Vulkan adapter was found")
            adapter = adapters[0]
        self.adapter = adapter
        offered = set(adapter.features)
        wanted = [f for f in ("shader-f16", "subgroup") if f in offered]
        limits = {k: adapter.limits[k] for k in _RAISED_LIMITS if k in adapter.limits}
        self.device = adapter.request_device_sync(required_features=wanted, required_limits=limits)
        self.features = frozenset(self.device.features)
        self.has_f16 = "shader-f16" in self.features
        self.has_subgroups = "subgroup" in self.features
        # subgroupAdd reductions assume a subgroup fits within the 64 threads that share a row
        info = adapter.info
        widest = info.get("subgroup_max_size", info.get("stackgroup_max_size", 0)) or 0
        # the one subgroup width known for certain (wgpu reports a range); 0 when not known
        self.subgroup_width = 32 if self.has_subgroups and info.get("vendor_id") == 0x10DE else 0  # NVIDIA
        if self.subgroup_width:
            widest = self.subgroup_width
        self.gemv_subgroups = self.has_subgroups and 0 < int(widest) <= 64
        device_binding = int(self.device.limits["max-storage-buffer-binding-size"])
        self.max_binding_bytes = min(device_binding, max_binding_bytes or device_binding)
        self.max_buffer_bytes = int(self.device.limits["max-buffer-size"])
        self._pipelines: dict[tuple[str, str], Any] = {}
        self._scratch: dict[str, Any] = {}
        self._usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC | self.wgpu.BufferUsage.COPY_DST

    # -- buffers -----------------------------------------------------------------------------------

    def raw_buffer(self, nbytes: int) -> Any:
        size = max(4, (int(nbytes) + 3) // 4 * 4)
        if size > self.max_buffer_bytes:
            raise CapacityError(f"a {size}-byte buffer exceeds the device's maxBufferSize {self.max_buffer_bytes}")
        return self.device.create_buffer(size=size, usage=self._usage)

    def raw_upload(self, data: bytes | memoryview | np.ndarray) -> Any:
        payload = np.ascontiguousarray(data).view(np.uint8).reshape(-1) if isinstance(data, np.ndarray) else data
        nbytes = len(memoryview(payload).cast("B"))
        if nbytes % 4 or nbytes == 0:  # buffers are read as u32 words: pad the tail with zeros
            padded = np.zeros(max(4, (nbytes + 3) // 4 * 4), dtype=np.uint8)
            padded[:nbytes] = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
            payload = padded
        buffer = self.raw_buffer(len(memoryview(payload).cast("B")))
        self.device.queue.write_buffer(buffer, 0, payload)
        return buffer

    def scratch(self, name: str, nbytes: int) -> Any:
        """A reusable work buffer of at least `nbytes`, kept per name (grows, never shrinks)."""
        found = self._scratch.get(name)
        if found is None or found.size < nbytes:
            found = self._scratch[name] = self.raw_buffer(nbytes)
        return found

    def empty(self, shape: tuple[int, ...] | int, dtype: str = "f32") -> DeviceArray:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        return DeviceArray(self.raw_buffer(4 * count), shape, dtype)

    def upload(self, array: np.ndarray, dtype: str = "f32") -> DeviceArray:
        host = np.ascontiguousarray(array, dtype=_DTYPES[dtype])
        return DeviceArray(self.raw_upload(host), tuple(host.shape), dtype)

    def write(self, target: DeviceArray, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array, dtype=_DTYPES[target.dtype])
        if host.size != target.size:
            raise CapacityError(f"writing {host.size} values into an array of {target.size}")
        self.device.queue.write_buffer(target.buffer, 0, host)

    def read(self, array: DeviceArray) -> np.ndarray:
        raw = self.device.queue.read_buffer(array.buffer, 0, 4 * array.size)
        return np.frombuffer(raw, dtype=_DTYPES[array.dtype]).reshape(array.shape).copy()

    # -- pipelines ---------------------------------------------------------------------------------

    def pipeline(self, name: str, source: str, variant: str = "") -> Any:
        """Compile a WGSL compute shader once per (name, variant) and keep it."""
        key = (name, variant)
        found = self._pipelines.get(key)
        if found is None:
            module = self.device.create_shader_module(label=name, code=source)
            found = self.device.create_compute_pipeline(
                label=f"{name}{variant}", layout="auto", compute={"module": module, "entry_point": "main"}
            )
            self._pipelines[key] = found
        return found

    def batch(self) -> Batch:
        return Batch(self)


def shader_source(*names: str) -> str:
    """Concatenate .wgsl files from the package's wgsl/ folder (shared helpers first)."""
    folder = resources.files(__package__) / "wgsl"
    return "\n".join((folder / f"{name}.wgsl").read_text() for name in names)


def pack_params(*values: int | float) -> bytes:
    """Pack scalar kernel parameters as 4-byte u32 (Python int) or f32 (Python float), padded to 16."""
    fields = "".join("I" if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else "f" for v in values)
    data = struct.pack("<" + fields, *[int(v) if f == "I" else float(v) for f, v in zip(fields, values, strict=True)])
    return data + b"\0" * (16 - len(data) % 16 if len(data) % 16 or not data else 0)


def grid_1d(groups: int) -> tuple[int, int, int]:
    """Spread `groups` workgroups over x and y when they exceed the per-dimension limit."""
    groups = max(1, groups)
    if groups <= MAX_GROUPS:
        return groups, 1, 1
    return MAX_GROUPS, -(-groups // MAX_GROUPS), 1


class Batch:
    """Records dispatches into one command encoder; `submit()` sends them as one queue submission."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.encoder = runtime.device.create_command_encoder()
        self._pass = self.encoder.begin_compute_pass()
        self.dispatches = 0

    def dispatch(self, pipeline: Any, buffers: list[Any], params: bytes, groups: tuple[int, int, int]) -> None:
        """Bind params at binding 0 (uniform) and `buffers` at bindings 1.., then dispatch."""
        device = self.runtime.device
        uniform = device.create_buffer_with_data(data=params, usage=self.runtime.wgpu.BufferUsage.UNIFORM)
        entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": 0, "size": uniform.size}}]
        for index, buffer in enumerate(buffers, start=1):
            entries.append({"binding": index, "resource": {"buffer": buffer, "offset": 0, "size": buffer.size}})
        group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
        self._pass.set_pipeline(pipeline)
        self._pass.set_bind_group(0, group)
        self._pass.dispatch_workgroups(*groups)
        self.dispatches += 1

    def submit(self) -> None:
        self._pass.end()
        self.runtime.device.queue.submit([self.encoder.finish()])
