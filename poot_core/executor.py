"""The Executor protocol, backend specs and automatic backend selection.

A backend plugin registers a `BackendSpec`: a name (and aliases), a priority for automatic selection, a
`probe()` that says whether its device is present (never raising for absence), and a factory that opens
the executor. The executor uploads weights as stored, prepares traced graphs into programs (or refuses them
by name before any work), and runs them.

`Executor` lists what every backend defines. A backend may also define optional methods, each declared by
its own protocol below with the behaviour callers fall back to when a backend lacks it; callers reach them
through the helper beside that protocol, never by probing attribute names themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

from poot_core.errors import Reason, RequestError, Unsupported
from poot_core.graph import Graph, StepShape


@dataclass(frozen=True)
class RunDefaults:
    """The step sizes an executor runs well with: DriverOptions fields left as None take these. The core's
    values suit the CPU; a GPU wants thousands of tokens a step (on the H200 a serving step budget of 256
    tokens gave 1306 output tok/s where 2048 gave 3159 on the same 64-request workload)."""

    prefill_chunk: int = 128  # new tokens of one prompt per prefill step
    step_tokens: int = 256  # token budget of one serving step (decode tokens and prefill chunks)
    max_running: int = 32  # sequences one serving step may hold
    kv_fraction: float = 0.25  # share of the free device memory the serving KV pool takes


@dataclass(frozen=True)
class Capabilities:
    ops: frozenset[str]
    # Weight kinds it computes from: torch dtype names ("bfloat16") and PackedWeight kinds ("gguf.Q4_K").
    weight_kinds: frozenset[str]
    notes: str = ""
    # KV layouts its attention ops run: "contiguous" (a buffer per row), "paged" (pools of blocks, StepShape.paging)
    layouts: frozenset[str] = frozenset({"contiguous"})
    defaults: RunDefaults = RunDefaults()


# What callers hand back to the executor without looking inside; each backend chooses its own types.
Weights: TypeAlias = Any  # what upload() returns: the weights placed (maybe re-laid-out) on the device
State: TypeAlias = Any  # what allocate_state() returns: the KV cache and other state buffers of a graph
Output: TypeAlias = Any  # an executor-native array that Program.run returns (logits or hidden states)


class Program(Protocol):
    """A prepared graph. `run` takes the step's inputs (numpy int arrays named as the graph's inputs)
    and the executor's state object, and returns the graph's outputs as executor-native arrays."""

    def run(self, state: State, inputs: dict[str, np.ndarray]) -> list[Output]: ...


class Executor(Protocol):
    """What every backend defines. Optional methods (declared below, each with its default): greedy_token,
    greedy_rows, mask_logits."""

    name: str

    def capabilities(self) -> Capabilities: ...

    def upload(self, store: Any) -> Weights:
        """Place the weights on the device; returns the executor's handle to them."""

    def prepare(self, graph: Graph, weights: Weights) -> Program: ...

    def allocate_state(self, graph: Graph) -> State:
        """Allocate the graph's state buffers (KV cache), zeroed."""

    def copy_state_rows(self, state: State, src_row: int, dst_row: int, length: int) -> None: ...

    def to_numpy(self, value: Output) -> np.ndarray: ...

    def memory(self) -> dict[str, int]:
        """{"total": bytes, "free": bytes} of the device."""


# --- optional executor methods ---------------------------------------------------------------------------


@runtime_checkable
class GreedyOnDevice(Protocol):
    """Optional `greedy_token(output)`: the id of the largest logit at the last position of row 0 of a logits
    output, picked on the device so that one id crosses to the host instead of the logits.

    Default for a backend without it: the caller reads the logits with `to_numpy` and picks on the host (the
    Driver's Sampler takes the same argmax), at the cost of copying the logits."""

    def greedy_token(self, output: Output) -> int: ...


def device_greedy(executor: Executor) -> Callable[[Output], int] | None:
    """The executor's `greedy_token`, or None when it has none (then pick on the host from `to_numpy`)."""
    return executor.greedy_token if isinstance(executor, GreedyOnDevice) else None


@runtime_checkable
class GreedyRowsOnDevice(Protocol):
    """Optional `greedy_rows(output)`: int64 [slots], the id of the largest logit of each sequence slot of a
    paged serving step's logits output [1, slots, vocab] (lowest id on ties, as numpy's argmax), picked on the
    device so that the ids cross to the host instead of the logits.

    Default for a backend without it: the serving engine reads the logits with `to_numpy` and each row's
    Sampler picks on the host."""

    def greedy_rows(self, output: Output) -> np.ndarray: ...


def device_greedy_rows(executor: Executor) -> Callable[[Output], np.ndarray] | None:
    """The executor's `greedy_rows`, or None when it has none."""
    return executor.greedy_rows if isinstance(executor, GreedyRowsOnDevice) else None


@runtime_checkable
class MaskOnDevice(Protocol):
    """Optional `mask_logits(output, bitmask, rows)`: in a logits output [1, R, vocab], set to -inf every token
    of row rows[i] whose bit is 0 in bitmask[i] (int32 [n, ceil(vocab / 32)], bit b of word w is token 32 w + b,
    llguidance's packed layout; rows int64 [n] in 0..R-1), on the device and in place; returns the output. Only
    the packed words cross to the device (vocab / 8 bytes a row), never a vocabulary-sized mask.

    Default for a backend without it: the caller reads the logits with `to_numpy` and masks them on the host
    (poot_core.driver.token_masks does both, with the same result)."""

    def mask_logits(self, output: Output, bitmask: np.ndarray, rows: np.ndarray) -> Output: ...


def device_mask(executor: Executor) -> Callable[[Output, np.ndarray, np.ndarray], Output] | None:
    """The executor's `mask_logits`, or None when it has none."""
    return executor.mask_logits if isinstance(executor, MaskOnDevice) else None


@runtime_checkable
class StateBytes(Protocol):
    """Optional `state_nbytes(graph, weights)`: the bytes `allocate_state(graph)` would take for a model
    uploaded as `weights` (the element types are the backend's choice: Triton keeps K/V in the model's
    16-bit type and recurrent state in float32).

    Default for a backend without it: 4 bytes (float32) a value, as the CPU stores state."""

    def state_nbytes(self, graph: Graph, weights: Weights) -> int: ...


def state_nbytes(executor: Executor, graph: Graph, weights: Weights) -> int:
    """The bytes of `graph`'s state on `executor` (its `state_nbytes`, else float32 values)."""
    if isinstance(executor, StateBytes):
        return executor.state_nbytes(graph, weights)
    return sum(4 * int(np.prod(spec.shape)) for spec in graph.state.values())


@runtime_checkable
class FedSteps(Protocol):
    """Optional: a paged serving step fed by the argmax of the step before it on the device, so that it can be
    launched before that step's ids are read (the serving engine's steps ahead, driver/ahead.py).

    `greedy_ids(output)`: the argmax of each sequence slot of a logits output [1, slots, vocab] (lowest id on
    ties), left on the device and not waited for. `read_ids(ids)`: those ids on the host, int64 [slots] (waits
    for the step). `run_fed(program, state, inputs, ids, at, rows)`: `program.run(state, inputs)` with
    tokens[0, at[i]] set to ids[rows[i]] on the device first (at, rows: int64 [n]); the token values the inputs
    hold there are placeholders.

    Default for a backend without it: the engine reads each step's ids before it schedules the next one."""

    def greedy_ids(self, output: Output) -> Any: ...

    def read_ids(self, ids: Any) -> np.ndarray: ...

    def run_fed(self, program: Program, state: State, inputs: dict[str, np.ndarray], ids: Any, at: np.ndarray,
                rows: np.ndarray) -> list[Output]: ...


def fed_steps(executor: Executor) -> FedSteps | None:
    """The executor when it feeds steps from the device (FedSteps), else None."""
    return executor if isinstance(executor, FedSteps) else None


@dataclass
class BackendSpec:
    name: str
    open: Callable[[], Executor]
    probe: Callable[[], bool]
    priority: int  # higher wins in automatic selection: cuda 40, rocm 30, vulkan 20, cpu 0
    aliases: tuple[str, ...] = ()
    description: str = ""
    # Whether AUTO may pick it: a backend can be present yet a poor default (a software Vulkan device).
    # None means "when probe() is true".
    auto_probe: Callable[[], bool] | None = None
    distribution: str = field(default="", compare=False)


class BackendChoice(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    VULKAN = "vulkan"


def installed_backends() -> list[BackendSpec]:
    from poot_core.plugins import discover

    specs = []
    for record, spec in discover().backends():
        spec.distribution = record.distribution
        specs.append(spec)
    return sorted(specs, key=lambda s: -s.priority)


def _safe_probe(spec: BackendSpec, auto: bool = False) -> bool:
    probe = spec.auto_probe if auto and spec.auto_probe is not None else spec.probe
    try:
        return bool(probe())
    except Exception:  # a probe must never raise for absence; treat a failing probe as absence
        return False


def _open(spec: BackendSpec) -> Executor:
    try:
        return spec.open()
    except Unsupported:
        raise
    except Exception as exc:  # a broken backend plugin is a typed refusal, not a traceback
        raise Unsupported(Reason.BACKEND, spec.name, f"it failed to open: {type(exc).__name__}: {exc}") from exc


def open_executor(choice: BackendChoice | str = BackendChoice.AUTO,
                  backends: list[BackendSpec] | None = None) -> Executor:
    """AUTO picks the highest-priority backend whose probe finds its device (CUDA, then ROCm, then Vulkan,
    then the CPU). A named backend that is not installed or whose device is absent is a typed refusal."""
    specs = installed_backends() if backends is None else sorted(backends, key=lambda s: -s.priority)
    wanted = choice.value if isinstance(choice, BackendChoice) else str(choice).lower()
    if wanted == BackendChoice.AUTO.value:
        failures = []
        for spec in specs:
            if _safe_probe(spec, auto=True):
                try:
                    return _open(spec)
                except Unsupported as exc:  # try the next one; say why if none opens
                    failures.append(str(exc))
        raise Unsupported(Reason.BACKEND, "auto", "no installed backend opened a device" +
                          (f": {'; '.join(failures)}" if failures else ""))
    for spec in specs:
        if wanted == spec.name or wanted in spec.aliases:
            if not _safe_probe(spec):
                raise Unsupported(Reason.BACKEND, spec.name, "its device is not present on this machine")
            return _open(spec)
    names = ", ".join(s.name for s in specs) or "none"
    raise Unsupported(Reason.BACKEND, wanted, f"no installed backend has that name; installed: {names}")


def require_ops(graph: Graph, caps: Capabilities, backend: str) -> None:
    """Refuse, by name, the first op a graph uses that a backend cannot run."""
    for op in sorted(graph.ops()):
        if op not in caps.ops:
            raise Unsupported(Reason.OPERATION, op, f"the {backend} backend has no kernel for it")


def check_positions(graph: Graph, inputs: dict[str, Any]) -> None:
    """Refuse a step whose positions fall outside the KV cache, before any kernel runs: kernels index the
    cache by position, most of them without bounds checks of their own."""
    positions = inputs.get("positions")
    if positions is None or not graph.state or np.size(positions) == 0:
        return
    low, high, capacity = int(np.min(positions)), int(np.max(positions)), graph.shape.capacity
    if low < 0 or high >= capacity:
        raise RequestError(f"positions {low}..{high} fall outside the KV cache's {capacity} positions")


__all__ = ["BackendChoice", "BackendSpec", "Capabilities", "Executor", "FedSteps", "GreedyOnDevice",
           "GreedyRowsOnDevice", "MaskOnDevice", "Output", "Program", "State", "StepShape", "Weights",
           "check_positions", "device_greedy", "device_greedy_rows", "device_mask", "fed_steps", "installed_backends",
           "open_executor", "require_ops"]
