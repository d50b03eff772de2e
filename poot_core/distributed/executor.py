"""The executor a placed Driver runs on: the rank's own executor, seeing only the rank's part of each step.

The Driver stays as it is: it traces whole steps, and this wrapper turns each into the rank's share (a layer
stage, or a tensor-parallel slice) before the inner executor prepares it, and uploads only the weights (or
weight slices) that share reads. Every rank runs the same Driver calls in the same order, so the collectives
inside steps and in `to_numpy`/`greedy_token` line up.

Pipeline: a rank receives the hidden state from the rank before it, runs its stage and sends the result on; the
last rank holds the logits. Reading them (`to_numpy`) broadcasts them from the last rank; a greedy pick
(`greedy_token`) is made on the last rank and only the token id is broadcast.
Tensor parallel: the logits are gathered inside the step, so every rank holds all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from poot_core.distributed.capacity import Plan
from poot_core.distributed.coordinator import Coordinator
from poot_core.distributed.placement import Placement
from poot_core.distributed.shards import rank_store, splittable
from poot_core.executor import Capabilities, device_greedy
from poot_core.graph import Graph, StepShape
from poot_core.graph import pipeline as stages
from poot_core.graph import tensor_parallel as tp


@dataclass
class Parts:
    """A serving step run as several smaller ones (a pipeline's micro-batches): each one's output and how many of
    its first rows belong to the step, in the step's row order."""

    outs: list[Any]
    rows: list[int]


class Remote:
    """An output that lives on another rank (the last stage's logits), by its shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class PipelineProgram:
    def __init__(self, inner: Any, local: Graph, executor: PlacedExecutor) -> None:
        self.inner, self.local, self.placed = inner, local, executor
        # the hidden state from the stage before: the one input the whole step does not have
        self.hidden = next((n for n in local.inputs if n not in executor.whole_inputs(local.shape)), None)
        self.remote = [Remote(shape) for shape in executor.whole_outputs(local.shape)]

    def run(self, state: Any, inputs: dict[str, np.ndarray]) -> list[Any]:
        c, inner = self.placed.coordinator, self.placed.inner
        if self.hidden is not None:
            spec = self.local.inputs[self.hidden]
            inputs = {**inputs, self.hidden: c.recv(spec.shape, torch.float32, c.rank - 1).cpu().numpy()}
        outs = self.inner.run(state, inputs)
        if c.last:
            return outs
        c.send(torch.from_numpy(np.ascontiguousarray(inner.to_numpy(outs[0]), dtype=np.float32)), c.rank + 1)
        return self.remote


class PlacedExecutor:
    def __init__(self, inner: Any, handle: Any, coordinator: Coordinator, placement: Placement, plan: Plan) -> None:
        self.inner, self.handle, self.coordinator = inner, handle, coordinator
        self.placement, self.plan = Placement(placement), plan
        self.name = inner.name
        self._local: dict[StepShape, Graph] = {}
        self._whole: dict[StepShape, list[tuple[int, ...]]] = {}  # the whole step's output shapes
        self._whole_inputs: dict[StepShape, set[str]] = {}
        self._inner_greedy = device_greedy(inner)
        self._check: Any = None
        self._text_weights: set[str] | None = None  # every weight a step of the whole model reads (upload's)

    # --- the rank's share of a step ---------------------------------------------------------------------
    def local(self, graph: Graph) -> Graph:
        found = self._local.get(graph.shape)
        if found is None:
            c = self.coordinator
            shapes = {n.output: n.shape for n in graph.nodes}
            self._whole[graph.shape] = [shapes[name] for name in graph.outputs]
            self._whole_inputs[graph.shape] = set(graph.inputs)
            if self.placement is Placement.PIPELINE:
                first, end = self.plan.layers[c.rank]
                found = stages.stage(graph, first, end)
            else:
                found, _ = tp.shard(graph, c.rank, c.world, c.key, self._check)
            self._local[graph.shape] = found
        return found

    def whole_outputs(self, shape: StepShape) -> list[tuple[int, ...]]:
        return self._whole[shape]

    def whole_inputs(self, shape: StepShape) -> set[str]:
        return self._whole_inputs[shape]

    # --- the Executor protocol --------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def upload(self, store: Any) -> Any:
        """Only the weights this rank's share reads (the tensor-parallel ones as slices) reach the device."""
        from poot_core.driver.core import trace_step

        self._check = splittable(store)
        probe = trace_step(self.handle, StepShape(1, 1, self.plan.context))
        self._text_weights = set(probe.weights)
        c = self.coordinator
        if self.placement is Placement.PIPELINE:
            local, shards = stages.stage(probe, *self.plan.layers[c.rank]), {}
        else:
            local, shards = tp.shard(probe, c.rank, c.world, c.key, self._check)
        names = set(local.weights)
        # other steps of this rank (encode, all logits) read a subset of the decode step's weights
        return self.inner.upload(rank_store(store, names, shards))

    def upload_outside_steps(self, store: Any) -> Any:
        """The weights no step of the text model reads (a vision tower's and its projector's), whole, on this
        rank's device: the rank that serves runs the tower for the whole group and hands the features to the
        steps as prompt embeddings. After `upload`, whose probe step named the text model's weights."""
        if self._text_weights is None:
            raise RuntimeError("upload_outside_steps before upload: the text model's weights are not named yet")
        return self.inner.upload(rank_store(store, set(store.shapes()) - self._text_weights, {}))

    def prepare(self, graph: Graph, weights: Any) -> Any:
        local = self.local(graph)
        program = self.inner.prepare(local, weights)
        if self.placement is Placement.PIPELINE and self.coordinator.world > 1:
            return PipelineProgram(program, local, self)
        return program

    def allocate_state(self, graph: Graph) -> Any:
        return self.inner.allocate_state(self.local(graph))

    def copy_state_rows(self, state: Any, src_row: int, dst_row: int, length: int) -> None:
        self.inner.copy_state_rows(state, src_row, dst_row, length)

    def memory(self) -> dict[str, int]:
        """The least free memory of any rank when the plan was made, the same on every rank: what the paged
        engine sizes its pool of KV blocks from, so every rank schedules the same steps."""
        return {"total": int(self.inner.memory()["total"]), "free": min(self.plan.free)}

    @property
    def stages(self) -> int:
        """How many pipeline stages a step passes through (1 under tensor parallel)."""
        return self.coordinator.world if self.placement is Placement.PIPELINE else 1

    def to_numpy(self, value: Any) -> np.ndarray:
        if isinstance(value, Parts):  # each part's rows of the step, joined in order
            return np.concatenate([self.to_numpy(out)[:, :n] for out, n in zip(value.outs, value.rows, strict=True)],
                                  axis=1)
        c = self.coordinator
        if self.placement is not Placement.PIPELINE or c.world == 1:
            return self.inner.to_numpy(value)
        if c.last:
            buf = torch.from_numpy(np.ascontiguousarray(self.inner.to_numpy(value), dtype=np.float32))
        else:
            buf = torch.empty(value.shape, dtype=torch.float32)
        return c.broadcast(buf, c.world - 1).numpy()

    def greedy_token(self, output: Any) -> int:
        """The last position's argmax (lowest id on ties, as the greedy Sampler), picked where the logits are."""
        c = self.coordinator
        pipeline = self.placement is Placement.PIPELINE and c.world > 1
        if pipeline and not c.last:
            return int(c.broadcast(torch.zeros(1, dtype=torch.int64), c.world - 1)[0])
        if self._inner_greedy is not None:
            token = int(self._inner_greedy(output))
        else:
            token = int(np.argmax(self.inner.to_numpy(output)[0, -1]))
        if pipeline:
            c.broadcast(torch.tensor([token], dtype=torch.int64), c.world - 1)
        return token


__all__ = ["Parts", "PipelineProgram", "PlacedExecutor", "Remote"]
