"""The CUDA executor: weights uploaded as stored, graphs bound to the shared Triton kernels, KV on the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from poot_backend_cuda.plugin import probe
from poot_backend_cuda.program import Binder, CudaProgram
from poot_backend_cuda.weights import (
    DENSE_KINDS,
    DeviceWeights,
    activation_dtype,
    check_kind,
    packed_kinds,
    to_device,
    weight_bytes,
)
from poot_core import Capabilities, Graph, Reason, Unsupported, inverse_frequencies, require_ops

CUDA_OPS = frozenset(
    {
        "embed",
        "rms_norm",
        "linear",
        "reshape",
        "rope",
        "attention",
        "gated",
        "activation",
        "add",
        "mul",
        "scale",
        "last_position",
        "logits",
    }
)
# Kept free beyond weights and KV: activations, CUDA graph pools, the allocator's slack.
HEADROOM = 1 << 30


class CudaExecutor:
    name = "cuda"

    def __init__(self, device: int | str | torch.device = 0) -> None:
        if not probe():
            raise Unsupported(Reason.BACKEND, "cuda", "torch sees no CUDA device on this machine")
        try:
            import poot_kernels_triton  # noqa: F401
        except Exception as exc:  # Triton missing or broken: the backend cannot run
            raise Unsupported(Reason.BACKEND, "cuda", f"the Triton kernels do not import: {exc}") from exc
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._state_bytes = 0
        # Set False to run decode steps eagerly (debugging, profiling each kernel).
        self.use_cuda_graphs = True

    # --- protocol --------------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(
            CUDA_OPS, DENSE_KINDS | packed_kinds(), notes="Triton kernels; decode steps replayed as CUDA graphs"
        )

    def memory(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return {"total": int(total), "free": int(free)}

    def upload(self, store: Any) -> DeviceWeights:
        """Check layouts and room first, then copy each weight as stored."""
        host = {name: store.get(name) for name in store.names()}
        for name, w in host.items():
            check_kind(name, w)
        need = sum(weight_bytes(w) for w in host.values())
        free = self.memory()["free"]
        if need + HEADROOM > free:
            raise Unsupported(
                Reason.CAPACITY,
                f"weights of {need / 2**30:.2f} GiB",
                f"the GPU has {free / 2**30:.2f} GiB free (keeping {HEADROOM / 2**30:.0f} GiB for activations)",
            )
        tensors = {name: to_device(w, self.device) for name, w in host.items()}
        return DeviceWeights(tensors, activation_dtype(host), self.device)

    def prepare(self, graph: Graph, weights: DeviceWeights) -> CudaProgram:
        require_ops(graph, self.capabilities(), self.name)
        kv = self.state_bytes(graph, weights.act_dtype)
        free = self.memory()["free"] + self._state_bytes  # a state already allocated is reused
        if kv + HEADROOM > free:
            raise Unsupported(
                Reason.CAPACITY,
                f"KV cache of {kv / 2**30:.2f} GiB for step {graph.shape}",
                f"the GPU has {free / 2**30:.2f} GiB free after the weights; lower the capacity",
            )
        self._act_dtype = weights.act_dtype
        steps = Binder(graph, weights, self._rope_tables).bind_all()
        use_graph = self.use_cuda_graphs and graph.shape.tokens == 1
        return CudaProgram(graph, steps, self.device, use_graph)

    def allocate_state(self, graph: Graph) -> dict[str, torch.Tensor]:
        dtype = getattr(self, "_act_dtype", torch.bfloat16)
        need = self.state_bytes(graph, dtype)
        if need + HEADROOM > self.memory()["free"]:
            raise Unsupported(Reason.CAPACITY, f"KV cache of {need / 2**30:.2f} GiB", "does not fit free GPU memory")
        self._state_bytes += need
        return {name: torch.zeros(spec.shape, dtype=dtype, device=self.device) for name, spec in graph.state.items()}

    def copy_state_rows(self, state: dict[str, torch.Tensor], src_row: int, dst_row: int, length: int) -> None:
        for buf in state.values():
            buf[dst_row, :, :length] = buf[src_row, :, :length]

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().float().cpu().numpy()

    def greedy_token(self, value: torch.Tensor) -> int:
        """The argmax over the vocabulary of row 0's last position, computed on the GPU: one id crosses."""
        from poot_kernels_triton import greedy

        last = value[0, -1:].reshape(1, -1)
        return int(greedy(last).item())

    # --- helpers ---------------------------------------------------------------------------------------
    @staticmethod
    def state_bytes(graph: Graph, dtype: torch.dtype) -> int:
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(int(np.prod(spec.shape)) * size for spec in graph.state.values())

    def _rope_tables(
        self, theta: float, dim: int, scaling: dict[str, Any], positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (float(theta), int(dim), tuple(sorted(scaling.items())), int(positions))
        tables = self._tables.get(key)
        if tables is None:
            try:
                inv = inverse_frequencies(float(theta), int(dim), tuple(sorted(scaling.items())))
            except ValueError as exc:
                raise Unsupported(Reason.OPERATION, f"rope scaling {scaling}", str(exc)) from exc
            angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
            tables = (angles.cos().to(self.device).contiguous(), angles.sin().to(self.device).contiguous())
            self._tables[key] = tables
        return tables
