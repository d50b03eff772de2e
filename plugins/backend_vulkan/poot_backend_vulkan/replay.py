"""Record a step's dispatches once, replay them every step.

WebGPU cannot resubmit a command buffer, so "replay" here means: the pipelines, uniform buffers and bind
groups of every dispatch are built once; a step only rewrites the few uniforms that depend on the step's
start position, encodes the prebuilt dispatches into one compute pass, and submits once.

The kernel entry points (kernels/*.py) take a `Batch`; a `Recorder` stands in for it and keeps what they
would have dispatched. An `Emitter` is a function (recorder, start) -> None that calls one kernel entry point
for a given start position; one whose parameters change with the start is recorded at two starts and the
changing uniform is refilled from it each step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from poot_core import Unsupported
from poot_core.errors import Reason

from .kernels.runtime import Runtime

Emitter = Callable[["Recorder", int], None]


@dataclass
class Dispatch:
    pipeline: Any
    buffers: list[Any]
    params: bytes
    groups: tuple[int, int, int]


class Recorder:
    """Stands in for kernels.runtime.Batch: keeps the dispatches instead of encoding them."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.dispatches: list[Dispatch] = []

    def dispatch(self, pipeline: Any, buffers: list[Any], params: bytes, groups: tuple[int, int, int]) -> None:
        self.dispatches.append(Dispatch(pipeline, list(buffers), bytes(params), tuple(groups)))


@dataclass(frozen=True)
class Slot:
    """A placeholder for a buffer known only when the program runs (a KV-cache buffer of the state)."""

    name: str


class RecordedStep:
    """The dispatches of one step shape with their uniforms; bound to a state's buffers on demand.

    Uniforms that do not depend on the start are shared buffers written once. Those that do are affine in
    the start (positions, lengths); they live at aligned offsets of one buffer, and a step computes all of
    them as base + slope * start in u32 arithmetic and writes them with a single queue write. The affine
    form is checked at a third start when the capacity leaves room for one.
    """

    def __init__(
        self, runtime: Runtime, emitters: list[Emitter], starts: tuple[int, int], check_start: int | None = None
    ) -> None:
        self.runtime = runtime
        uniform_usage = runtime.wgpu.BufferUsage.UNIFORM | runtime.wgpu.BufferUsage.COPY_DST
        align = int(runtime.device.limits.get("min-uniform-buffer-offset-alignment", 256))
        static: dict[bytes, Any] = {}
        dynamic: dict[tuple[bytes, bytes], int] = {}  # (params at both starts) -> offset in the shared buffer
        rows: list[tuple[Dispatch, Any]] = []  # (dispatch, static buffer or dynamic offset)
        bases: list[np.ndarray] = []
        slopes: list[np.ndarray] = []
        size = 0
        span = starts[1] - starts[0]
        for emit in emitters:
            first, second = Recorder(runtime), Recorder(runtime)
            emit(first, starts[0])
            emit(second, starts[1])
            third = None
            if check_start is not None:
                third = Recorder(runtime)
                emit(third, check_start)
            if len(first.dispatches) != len(second.dispatches):
                raise Unsupported(Reason.SHAPE, "vulkan step", "a kernel's dispatch count depends on the position")
            for index, (a, b) in enumerate(zip(first.dispatches, second.dispatches, strict=True)):
                if a.groups != b.groups or a.buffers != b.buffers:
                    raise Unsupported(Reason.SHAPE, "vulkan step", "a kernel's grid depends on the position")
                if a.params == b.params:  # identical uniforms are shared by every dispatch that uses them
                    uniform = static.get(a.params)
                    if uniform is None:
                        uniform = static[a.params] = runtime.device.create_buffer_with_data(
                            data=a.params, usage=uniform_usage
                        )
                    rows.append((a, uniform))
                    continue
                offset = dynamic.get((a.params, b.params))
                if offset is None:
                    base, slope = _affine(a.params, b.params, starts[0], span)
                    if third is not None and third.dispatches[index].params != _at(base, slope, check_start):
                        raise Unsupported(Reason.SHAPE, "vulkan step", "a kernel's uniform is not affine in the start")
                    offset = dynamic[(a.params, b.params)] = size
                    words = -(-len(a.params) // align * align) // 4
                    bases.append(np.pad(base, (0, words - base.size)))
                    slopes.append(np.pad(slope, (0, words - slope.size)))
                    size += 4 * words
                rows.append((a, (offset, len(a.params))))
        self._base = np.concatenate(bases) if bases else np.zeros(0, np.uint32)
        self._slope = np.concatenate(slopes) if slopes else np.zeros(0, np.uint32)
        self._dynamic = runtime.device.create_buffer(size=max(size, 16), usage=uniform_usage) if size else None
        self._records = rows
        # (the slot buffers, kept alive so their ids stay theirs; the bound dispatches)
        self._bound: tuple[list[Any], list[tuple[Any, Any, tuple[int, int, int]]]] | None = None

    @property
    def dispatch_count(self) -> int:
        return len(self._records)

    def bind(self, slots: dict[str, Any]) -> list[tuple[Any, Any, tuple[int, int, int]]]:
        """(pipeline, bind group, grid) per dispatch, with each Slot replaced by slots[name]; the last
        binding is kept for the next step with the same slot buffers."""
        buffers = [slots[name] for name in sorted(slots)]
        if self.bound_to(slots):
            return self._bound[1]
        device = self.runtime.device
        bound = []
        for dispatch, uniform in self._records:
            if isinstance(uniform, tuple):
                offset, size = uniform
                entries = [{"binding": 0, "resource": {"buffer": self._dynamic, "offset": offset, "size": size}}]
            else:
                entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": 0, "size": uniform.size}}]
            for binding, buffer in enumerate(dispatch.buffers, start=1):
                real = slots[buffer.name] if isinstance(buffer, Slot) else buffer
                entries.append({"binding": binding, "resource": {"buffer": real, "offset": 0, "size": real.size}})
            group = device.create_bind_group(layout=dispatch.pipeline.get_bind_group_layout(0), entries=entries)
            bound.append((dispatch.pipeline, group, dispatch.groups))
        self._bound = (buffers, bound)
        return bound

    def bound_to(self, slots: dict[str, Any]) -> bool:
        buffers = [slots[name] for name in sorted(slots)]
        return self._bound is not None and all(a is b for a, b in zip(self._bound[0], buffers, strict=True))

    def write_uniforms(self, start: int) -> None:
        """Fill the position-dependent uniforms for `start` (one queue write, ordered before the next submit)."""
        if self._dynamic is not None:
            self.runtime.device.queue.write_buffer(self._dynamic, 0, _at(self._base, self._slope, start))

    def command_buffer(self, slots: dict[str, Any]) -> Any:
        """Every dispatch in one compute pass, as a finished command buffer. It holds no position: the same
        buffer serves any start once write_uniforms(start) has been queued before it is submitted."""
        encoder = self.runtime.device.create_command_encoder()
        self.encode_into(encoder, slots)
        return encoder.finish()

    def encode_into(self, encoder: Any, slots: dict[str, Any]) -> None:
        compute = encoder.begin_compute_pass()
        bound = self.bind(slots)
        raw = _native_pass_calls()
        current = None
        if raw is not None and hasattr(compute, "_internal"):
            # wgpu-native's C calls directly: wgpu-py's wrappers (offset lists, error capture per call) cost about
            # as much again as the encoding itself; an encoding error still surfaces at encoder.finish(). The
            # pipelines and bind groups stay alive in self._bound.
            set_pipeline, set_bind_group, dispatch, null = raw
            handle = compute._internal
            for pipeline, group, (gx, gy, gz) in bound:
                if pipeline is not current:
                    set_pipeline(handle, pipeline._internal)
                    current = pipeline
                set_bind_group(handle, 0, group._internal, 0, null)
                dispatch(handle, gx, gy, gz)
        else:
            for pipeline, group, grid in bound:
                if pipeline is not current:
                    compute.set_pipeline(pipeline)
                    current = pipeline
                compute.set_bind_group(0, group)
                compute.dispatch_workgroups(*grid)
        compute.end()

    def encode(self, encoder: Any, start: int, slots: dict[str, Any]) -> None:
        """Refill the position-dependent uniforms for `start`, then encode every dispatch in one pass."""
        self.write_uniforms(start)
        self.encode_into(encoder, slots)


@functools.cache
def _native_pass_calls() -> tuple[Any, Any, Any, Any] | None:
    """(set pipeline, set bind group, dispatch, NULL) of wgpu-native's compute pass, or None when wgpu runs
    on another backend or its module layout changed (the public calls are used then)."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib
    except ImportError:
        return None
    names = ("wgpuComputePassEncoderSetPipeline", "wgpuComputePassEncoderSetBindGroup",
             "wgpuComputePassEncoderDispatchWorkgroups")
    if not all(hasattr(lib, name) for name in names):
        return None
    return (*(getattr(lib, name) for name in names), ffi.NULL)


def _affine(a: bytes, b: bytes, start: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, slope) as u32 words with a(start) = base + slope * start, from params at start and start+span."""
    wa, wb = np.frombuffer(a, dtype=np.uint32), np.frombuffer(b, dtype=np.uint32)
    slope = (wb - wa) // np.uint32(span) if span != 1 else wb - wa
    return wa - slope * np.uint32(start), slope


def _at(base: np.ndarray, slope: np.ndarray, start: int) -> bytes:
    return (base + slope * np.uint32(start)).astype(np.uint32).tobytes()
