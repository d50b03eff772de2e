"""The OpenCL executor: weights as stored in OpenCL buffers, each step a list of kernels bound once."""

from __future__ import annotations

from typing import Any

import numpy as np
import psutil

from poot_core import Capabilities, Graph, Reason, RequestError, Unsupported, require_ops

from .kernels.runtime import Runtime, describe
from .program import OPENCL_OPS, OpenCLProgram
from .replay import Output
from .upload import WEIGHT_KINDS, DeviceWeights, upload_store


class OpenCLExecutor:
    name = "opencl"

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.runtime = runtime or Runtime()

    def capabilities(self) -> Capabilities:
        limits = self.runtime.limits
        notes = (f"{describe(self.runtime.device)}; kernels in work-groups of {limits.group}; "
                 f"cl_khr_fp16 {'yes' if limits.fp16 else 'no'}")
        return Capabilities(OPENCL_OPS, WEIGHT_KINDS, notes=notes)

    def upload(self, store: Any) -> DeviceWeights:
        return upload_store(self.runtime, store)

    def prepare(self, graph: Graph, weights: DeviceWeights) -> OpenCLProgram:
        require_ops(graph, self.capabilities(), self.name)
        return OpenCLProgram(self.runtime, graph, weights)

    def allocate_state(self, graph: Graph) -> dict[str, Any]:
        """KV buffers [capacity, kv_heads, head_dim] per layer (the kernels' layout), zeroed."""
        state = {}
        for name, spec in graph.state.items():
            if len(spec.shape) != 4:
                raise Unsupported(Reason.SHAPE, f"state {name} {spec.shape}", "the opencl state is KV caches")
            rows, heads, capacity, dim = spec.shape
            if rows != 1:
                raise Unsupported(Reason.SHAPE, f"rows={rows}", "the opencl backend runs one sequence per step")
            state[name] = self.runtime.zeros(4 * capacity * heads * dim)
        return state

    def copy_state_rows(self, state: dict[str, Any], src_row: int, dst_row: int, length: int) -> None:
        if src_row != 0 or dst_row != 0:
            raise Unsupported(Reason.SHAPE, f"KV row {max(src_row, dst_row)}", "the opencl state has one row")

    def to_numpy(self, value: Output) -> np.ndarray:
        count = int(np.prod(value.shape))
        return self.runtime.read(value.buf, count).reshape(value.shape)

    def greedy_token(self, output: Output) -> int:
        """The argmax of the last position's logits (row 0), computed on the device: reads back 4 bytes.
        Ties go to the lowest id, as numpy's argmax."""
        if output.ids is None:
            raise RequestError("greedy_token takes the logits output of a step")
        positions = int(np.prod(output.shape[:-1]))
        return int(self.runtime.read(output.ids, 1, np.uint32, offset=positions - 1)[0])

    def greedy_rows(self, output: Output) -> np.ndarray:
        """int64, the argmax of every logits row of the output (lowest id on ties), picked on the device."""
        if output.ids is None:
            raise RequestError("greedy_rows takes the logits output of a step")
        positions = int(np.prod(output.shape[:-1]))
        return self.runtime.read(output.ids, positions, np.uint32).astype(np.int64)

    def memory(self) -> dict[str, int]:
        """A CPU device (pocl) uses the host's memory; a GPU reports its global memory (OpenCL has no free
        figure)."""
        if self.runtime.is_cpu:
            vm = psutil.virtual_memory()
            return {"total": int(vm.total), "free": int(vm.available)}
        total = int(self.runtime.device.global_mem_size)
        return {"total": total, "free": total}
