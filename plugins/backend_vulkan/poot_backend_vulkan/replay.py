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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class _Dynamic:
    emitter: Emitter
    index: int  # which of the emitter's dispatches owns the uniform
    uniform: Any


class RecordedStep:
    """The dispatches of one step shape with their uniforms; bound to a state's buffers on demand."""

    def __init__(self, runtime: Runtime, emitters: list[Emitter], starts: tuple[int, int]) -> None:
        self.runtime = runtime
        uniform_usage = runtime.wgpu.BufferUsage.UNIFORM | runtime.wgpu.BufferUsage.COPY_DST
        static: dict[bytes, Any] = {}
        dynamic: dict[tuple[bytes, bytes], _Dynamic] = {}
        self._records: list[tuple[Dispatch, Any]] = []
        for emit in emitters:
            first, second = Recorder(runtime), Recorder(runtime)
            emit(first, starts[0])
            emit(second, starts[1])
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
                else:  # params are affine in the start, so agreeing at two starts means agreeing at all
                    found = dynamic.get((a.params, b.params))
                    if found is None:
                        size = len(a.params)
                        found = dynamic[(a.params, b.params)] = _Dynamic(
                            emit, index, runtime.device.create_buffer(size=size, usage=uniform_usage)
                        )
                    uniform = found.uniform
                self._records.append((a, uniform))
        self._dynamic = list(dynamic.values())
        # (the slot buffers, kept alive so their ids stay theirs; the bound dispatches)
        self._bound: tuple[list[Any], list[tuple[Any, Any, tuple[int, int, int]]]] | None = None

    @property
    def dispatch_count(self) -> int:
        return len(self._records)

    def bind(self, slots: dict[str, Any]) -> list[tuple[Any, Any, tuple[int, int, int]]]:
        """(pipeline, bind group, grid) per dispatch, with each Slot replaced by slots[name]; the last
        binding is kept for the next step with the same slot buffers."""
        buffers = [slots[name] for name in sorted(slots)]
        if self._bound is not None and all(a is b for a, b in zip(self._bound[0], buffers, strict=True)):
            return self._bound[1]
        device = self.runtime.device
        bound = []
        for dispatch, uniform in self._records:
            entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": 0, "size": uniform.size}}]
            for binding, buffer in enumerate(dispatch.buffers, start=1):
                real = slots[buffer.name] if isinstance(buffer, Slot) else buffer
                entries.append({"binding": binding, "resource": {"buffer": real, "offset": 0, "size": real.size}})
            group = device.create_bind_group(layout=dispatch.pipeline.get_bind_group_layout(0), entries=entries)
            bound.append((dispatch.pipeline, group, dispatch.groups))
        self._bound = (buffers, bound)
        return bound

    def encode(self, encoder: Any, start: int, slots: dict[str, Any]) -> None:
        """Refill the position-dependent uniforms for `start`, then encode every dispatch in one pass."""
        queue = self.runtime.device.queue
        for dyn in self._dynamic:
            recorder = Recorder(self.runtime)
            dyn.emitter(recorder, start)
            queue.write_buffer(dyn.uniform, 0, recorder.dispatches[dyn.index].params)
        compute = encoder.begin_compute_pass()
        current = None
        for pipeline, group, grid in self.bind(slots):
            if pipeline is not current:
                compute.set_pipeline(pipeline)
                current = pipeline
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(*grid)
        compute.end()
