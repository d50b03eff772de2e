"""The executor both GPU backends share: weights uploaded as stored, graphs bound to the Triton kernels, KV
on the device.

torch on ROCm exposes an AMD GPU as device "cuda" and Triton compiles the same kernels for HIP, so one
class serves NVIDIA and AMD. A backend sets its name, the tuning its kernels launch with (None: let the
device pick, `tuning_for_device`) and whether one-token steps are replayed from a captured graph (a CUDA
graph, or a HIP graph through the same torch.cuda API), and may refuse weights its device cannot compute
with by overriding `check_weight`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from poot_core import (
    Capabilities,
    Graph,
    Reason,
    RunDefaults,
    Unsupported,
    Weight,
    inverse_frequencies,
    require_ops,
    rope_attention_factor,
)
from poot_core.graph import StateSpec, handled_ops

from .host import DeviceIds
from .program import GRAPH_TOKENS, Binder, TritonProgram
from .tuning import Tuning
from .weights import DENSE_KINDS, DeviceWeights, activation_dtype, check_kind, packed_kinds, to_device, weight_bytes

TRITON_OPS = handled_ops(Binder)  # the vocabulary ops Binder has an op_<name> handler for
# KV layouts: "paged" (pools of blocks, StepShape.paging) through paged_step; latent attention has no paged form
# and refuses such a step by name (Binder.op_mla_attention)
LAYOUTS = frozenset({"contiguous", "paged"})
# Kept free beyond weights and KV: activations, graph pools, the allocator's slack.
HEADROOM = 1 << 30


def _state_dtype(spec: StateSpec, act_dtype: torch.dtype) -> torch.dtype:
    """KV in the activations' dtype; recurrent state (convolution windows, SSM and delta states) in float32, as
    the CPU executor keeps it: it sums a sequence's whole past."""
    return torch.float32 if spec.recurrent else act_dtype


class TritonExecutor:
    """Runs traced graphs with the shared Triton kernels on one torch device.

    Class attributes are the defaults a backend subclass overrides; `on_interpreter()` builds an instance on
    the CPU for TRITON_INTERPRET=1 (the tests, or checking a kernel change on a machine without a GPU).
    """

    name = "triton"
    tuning: Tuning | None = None  # None: the kernels pick tiles from the device they run on
    use_cuda_graphs = True  # False runs decode steps eagerly (debugging, profiling each kernel)
    # A mixed serving step (prefill chunks beside decode tokens) reads nothing on the host either: its attention
    # splits decode and prefill tokens on the device. Captured, each step size holds a graph's memory (on the
    # H200 an engine's 16 sizes took about 9 GiB more than eager steps with one pool shared by the captures, which
    # then failed an allocator assertion once a first engine's graphs were freed; a pool a capture, as here, may
    # take more); whether capturing pays is not settled: one
    # call measured 3398 / 3509 output tok/s (ahead / pipelined) with captures, another 2977 / 3156 without, on
    # machines that differ by up to 25% from call to call. Off until measured in one call (gpu_serve.py
    # --capture-mixed against a run without it).
    capture_mixed_steps = False
    # Step sizes for a GPU (DriverOptions left unset take them): prompts in chunks of 2048 tokens; serving
    # steps of up to 2048 tokens over up to 256 sequences (on the H200, 64 x (512 + 256) ran at 3159 output
    # tok/s with a 2048-token budget against 1306 with the CPU's 256), and a KV pool of 80% of the memory the
    # weights leave free (the rest: activations, CUDA graph pools, an encoder beside it in `poot serve`).
    run_defaults = RunDefaults(prefill_chunk=2048, step_tokens=2048, max_running=256, kv_fraction=0.8)
    notes = "Triton kernels; decode steps replayed as CUDA graphs"

    def __init__(
        self,
        device: int | str | torch.device = 0,
        *,
        name: str | None = None,
        tuning: Tuning | None = None,
        use_graphs: bool | None = None,
    ) -> None:
        if name is not None:
            self.name = name
        if tuning is not None:
            self.tuning = tuning
        if use_graphs is not None:
            self.use_cuda_graphs = use_graphs
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._state_bytes = 0

    @classmethod
    def on_interpreter(cls) -> TritonExecutor:
        """This executor on the CPU, for TRITON_INTERPRET=1: the same binding and kernels, steps run eagerly
        (no CUDA graphs), memory reported as unlimited."""
        ex = cls.__new__(cls)
        ex.device = torch.device("cpu")
        ex._tables = {}
        ex._state_bytes = 0
        ex.use_cuda_graphs = False
        ex.run_defaults = RunDefaults()  # the core's (CPU-sized) steps: the interpreter runs on the CPU
        ex.memory = lambda: {"total": 1 << 40, "free": 1 << 40}  # type: ignore[method-assign]
        return ex

    # --- protocol --------------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(TRITON_OPS, DENSE_KINDS | packed_kinds(), notes=self.notes, layouts=LAYOUTS,
                            defaults=self.run_defaults)

    def memory(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return {"total": int(total), "free": int(free)}

    def check_weight(self, name: str, w: Weight) -> None:
        """Refuse a weight this backend cannot compute with, before anything is copied."""
        check_kind(name, w, self.name)

    def upload(self, store: Any) -> DeviceWeights:
        """Check layouts and room first, then copy each weight as stored."""
        host = {name: store.get(name) for name in store.names()}
        for name, w in host.items():
            self.check_weight(name, w)
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

    def prepare(self, graph: Graph, weights: DeviceWeights) -> TritonProgram:
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
        binder = Binder(graph, weights, self._rope_tables, self.name)
        steps = binder.bind_all()
        # a step whose binding reads device values on the host (the grouped moe route's counts per expert,
        # latent attention's start positions, a mixed step's runs of recurrent sequences or of image groups)
        # runs eagerly; the others are captured as CUDA graphs: decode-sized steps, steps without state of any
        # size (a vision tower, an encoder: their inputs are all copied through the captured buffers), and steps
        # their caller marks as replayed (a vision runtime's prompt: a prefill the Driver runs once is not worth
        # a capture's memory)
        shape = graph.shape
        if shape.paging is not None:
            mixed = self.capture_mixed_steps and not (shape.embedded or shape.sections or shape.grouped)
            capturable = shape.paging.decode or mixed
        else:
            capturable = shape.tokens <= GRAPH_TOKENS or not graph.state or shape.replayed
        use_graph = self.use_cuda_graphs and capturable and not binder.host_syncs
        return TritonProgram(graph, steps, self.device, use_graph, self.tuning, binder.host_checks)

    def allocate_state(self, graph: Graph) -> dict[str, torch.Tensor]:
        dtype = getattr(self, "_act_dtype", torch.bfloat16)
        need = self.state_bytes(graph, dtype)
        if need + HEADROOM > self.memory()["free"]:
            raise Unsupported(Reason.CAPACITY, f"KV cache of {need / 2**30:.2f} GiB", "does not fit free GPU memory")
        self._state_bytes += need
        return {name: torch.zeros(spec.shape, dtype=_state_dtype(spec, dtype), device=self.device)
                for name, spec in graph.state.items()}

    def copy_state_rows(self, state: dict[str, torch.Tensor], src_row: int, dst_row: int, length: int) -> None:
        for buf in state.values():
            buf[dst_row, :, :length] = buf[src_row, :, :length]

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().float().cpu().numpy()

    def greedy_token(self, value: torch.Tensor) -> int:
        """The argmax over the vocabulary of row 0's last position, computed on the GPU: one id crosses."""
        return int(self._argmax(value[0, -1:].reshape(1, -1)).item())

    def greedy_rows(self, value: torch.Tensor) -> np.ndarray:
        """The argmax of each sequence slot of a paged step's logits [1, slots, vocab], on the GPU: the ids
        cross to the host, not the logits."""
        return self._argmax(value.reshape(-1, value.shape[-1])).cpu().numpy()

    def mask_logits(self, value: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Constraint masks (packed int32 words) applied to rows of a logits output [1, R, vocab] on the GPU, in
        place (poot_core.executor.MaskOnDevice): the words cross to the device, one kernel writes -inf."""
        from .sampling import apply_bitmask
        from .tuning import use_tuning

        logits = value[0]
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64) % logits.shape[0]).to(self.device)
        words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32)).to(self.device)
        with torch.inference_mode(), use_tuning(self.tuning) if self.tuning is not None else contextlib.nullcontext():
            apply_bitmask(logits, words, index)
        return value

    def _argmax(self, rows: torch.Tensor) -> torch.Tensor:
        from .sampling import greedy
        from .tuning import use_tuning

        with use_tuning(self.tuning) if self.tuning is not None else contextlib.nullcontext():
            return greedy(rows)

    def state_nbytes(self, graph: Graph, weights: DeviceWeights) -> int:
        """The bytes allocate_state(graph) takes for these weights: state is kept in the activation type."""
        return self.state_bytes(graph, weights.act_dtype)

    # --- steps fed from the device (poot_core.executor.FedSteps: the serving engine's steps ahead) ----------
    def greedy_ids(self, value: torch.Tensor) -> DeviceIds:
        """The argmax of each sequence slot of a paged step's logits [1, slots, vocab], computed on the GPU, and
        its copy to the host queued right behind it (host.DeviceIds: reading it waits for this step alone)."""
        return DeviceIds(self._argmax(value.reshape(-1, value.shape[-1])))

    def read_ids(self, ids: DeviceIds) -> np.ndarray:
        return ids.numpy()

    def run_fed(self, program: TritonProgram, state: dict[str, torch.Tensor], inputs: dict[str, np.ndarray],
                ids: DeviceIds, at: np.ndarray, rows: np.ndarray) -> list[Any]:
        """The step with tokens[0, at[i]] = ids[rows[i]] written on the GPU before it runs (captured steps
        included: the ids go into the replayed graph's input buffer after the host's inputs)."""
        return program.run(state, inputs, feed=(ids.device, at, rows))

    # --- helpers ---------------------------------------------------------------------------------------
    @staticmethod
    def state_bytes(graph: Graph, dtype: torch.dtype) -> int:
        return sum(int(np.prod(spec.shape)) * _state_dtype(spec, dtype).itemsize for spec in graph.state.values())

    def _rope_tables(
        self, theta: float, dim: int, scaling: dict[str, Any], positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (float(theta), int(dim), tuple(sorted(scaling.items())), int(positions))
        tables = self._tables.get(key)
        if tables is None:
            inv = inverse_frequencies(float(theta), int(dim), tuple(sorted(scaling.items())))
            angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
            factor = rope_attention_factor(scaling)  # YaRN scales cos and sin; 1 for the other scalings
            cos, sin = angles.cos() * factor, angles.sin() * factor
            tables = (cos.to(self.device).contiguous(), sin.to(self.device).contiguous())
            self._tables[key] = tables
        return tables


__all__ = ["HEADROOM", "TRITON_OPS", "TritonExecutor"]
