"""The Vulkan executor: weights as stored in wgpu buffers, each step a recorded list of WGSL dispatches."""

from __future__ import annotations

from typing import Any

import numpy as np
import psutil

from poot_core import Capabilities, Graph, Reason, RequestError, Unsupported, require_ops

from .kernels.runtime import DeviceArray, Runtime
from .program import VULKAN_OPS, Output, VulkanProgram
from .upload import WEIGHT_KINDS, DeviceWeights, upload_store


class VulkanExecutor:
    name = "vulkan"

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.runtime = runtime or Runtime()

    def capabilities(self) -> Capabilities:
        features = ", ".join(sorted(self.runtime.features)) or "none"
        return Capabilities(
            VULKAN_OPS, WEIGHT_KINDS, notes=f"{self.runtime.adapter.info.get('device', '?')}; features: {features}"
        )

    def upload(self, store: Any) -> DeviceWeights:
        return upload_store(self.runtime, store)

    def prepare(self, graph: Graph, weights: DeviceWeights) -> VulkanProgram:
        require_ops(graph, self.capabilities(), self.name)
        return VulkanProgram(self.runtime, graph, weights)

    def allocate_state(self, graph: Graph) -> dict[str, DeviceArray]:
        """KV buffers [capacity, kv_heads, head_dim] per layer (the kernels' layout), zeroed by WebGPU."""
        state = {}
        for name, spec in graph.state.items():
            rows, heads, capacity, dim = spec.shape
            if rows != 1:
                raise Unsupported(Reason.SHAPE, f"rows={rows}", "the vulkan backend runs one sequence per step")
            state[name] = self.runtime.empty((capacity, heads, dim))
        return state

    def copy_state_rows(self, state: dict[str, DeviceArray], src_row: int, dst_row: int, length: int) -> None:
        if src_row != 0 or dst_row != 0:
            raise Unsupported(Reason.SHAPE, f"KV row {max(src_row, dst_row)}", "the vulkan state has one row")
        # copying row 0 onto itself leaves it as it is

    def to_numpy(self, value: Output | DeviceArray) -> np.ndarray:
        if isinstance(value, DeviceArray):
            return self.runtime.read(value)
        raw = self.runtime.device.queue.read_buffer(value.buffer, 0, 4 * int(np.prod(value.shape)))
        return np.frombuffer(raw, dtype=np.float32).reshape(value.shape).copy()

    def greedy_token(self, output: Output) -> int:
        """The argmax of the last position's logits (row 0), computed on the device: reads back 4 bytes.
        Ties go to the lowest id, as numpy's argmax."""
        if output.ids is None:
            raise RequestError("greedy_token takes the logits output of a step")
        positions = int(np.prod(output.shape[:-1]))
        raw = self.runtime.device.queue.read_buffer(output.ids, 4 * (positions - 1), 4)
        return int(np.frombuffer(raw, dtype=np.uint32)[0])

    def memory(self) -> dict[str, int]:
        """WebGPU does not report device memory; a CPU adapter (lavapipe) uses the host's."""
        if self.runtime.adapter.info.get("adapter_type") == "CPU":
            vm = psutil.virtual_memory()
            return {"total": int(vm.total), "free": int(vm.available)}
        return {"total": 0, "free": 0}
