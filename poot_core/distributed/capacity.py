"""The capacity planner: which layers (pipeline) or which shares (tensor parallel) each device holds, from its
free memory, the weights each layer reads, the KV state per position and the requested context.

Everything is read from the traced decode step at the requested context and the stored tensors' sizes (no
weight data is read), so a plan that cannot fit is refused before any weight moves: a typed
`Unsupported(Capacity)` naming the device, the bytes it needs and the bytes it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from poot_core.distributed.placement import Placement
from poot_core.distributed.shards import shard_nbytes, splittable
from poot_core.errors import Reason, Unsupported
from poot_core.graph import Graph, StateRef, StepShape, WeightRef
from poot_core.graph import pipeline as stages
from poot_core.graph import tensor_parallel as tp

STATE_BYTES = 4  # per state value: the CPU keeps K/V in float32; devices that keep less have room to spare


@dataclass(frozen=True)
class Target:
    """A device a rank runs on: a name for messages ("rank 1 (cpu)") and its free bytes."""

    name: str
    free: int


@dataclass(frozen=True)
class Plan:
    placement: Placement
    layers: list[tuple[int, int]]  # per rank: [first, end) of the layers it holds (every layer under TENSOR)
    need: list[int]  # per rank: bytes of weights and state
    context: int
    free: list[int]  # per rank: the free bytes the plan was made for


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


class Planner:
    def __init__(self, handle: Any, targets: list[Target], placement: Placement, *, context: int,
                 split: list[float] | None = None, state_bytes: int = STATE_BYTES) -> None:
        from poot_core.driver.core import trace_step

        if not targets:
            raise Unsupported(Reason.CAPACITY, "no devices", "a placement needs at least one target")
        if split is not None and (len(split) != len(targets) or any(s < 0 for s in split) or sum(split) <= 0):
            raise Unsupported(Reason.SHAPE, f"tensor split {','.join(f'{s:g}' for s in split)}",
                              f"give {len(targets)} non-negative shares, one per device")
        self.handle, self.targets, self.placement = handle, targets, Placement(placement)
        self.context, self.split, self.state_bytes = context, split, state_bytes
        self.store = handle.store()
        self.graph: Graph = trace_step(handle, StepShape(1, 1, context))

    # --- what one part of the step needs -----------------------------------------------------------------
    def _bytes(self, graph: Graph, nodes: range, shards: dict[str, tp.Shard] | None = None) -> tuple[int, int]:
        """(weight bytes, state bytes) that nodes[i] for i in `nodes` read, each weight counted once."""
        weights, state = set(), set()
        for i in nodes:
            for ref in graph.nodes[i].inputs:
                if isinstance(ref, WeightRef):
                    weights.add(ref.name)
                elif isinstance(ref, StateRef):
                    state.add(ref.name)
        w = sum(shard_nbytes(self.store, n, shards or {}) for n in weights)
        s = sum(math.prod(graph.state[n].shape) for n in state) * self.state_bytes
        return w, s

    def _refuse(self, rank: int, need: int, weights: int, state: int, what: str) -> Unsupported:
        t = self.targets[rank]
        return Unsupported(Reason.CAPACITY, t.name,
                           f"{what} needs {_gib(need)}: weights {_gib(weights)} and KV/state {_gib(state)} for "
                           f"{self.context} positions; it has {_gib(t.free)} free. Give a smaller context (-c), "
                           "more devices, or another split")

    # --- plans ------------------------------------------------------------------------------------------
    def plan(self) -> Plan:
        return self._tensor() if self.placement is Placement.TENSOR else self._pipeline()

    def _pipeline(self) -> Plan:
        g, n = self.graph, len(self.targets)
        layers = stages.layer_count(g)
        if n > layers:
            raise Unsupported(Reason.SHAPE, f"a pipeline of {n} stages", f"the model has {layers} layers")
        starts = [0] + [stages.boundary(g, layer).index for layer in range(1, layers)] + [len(g.nodes)]
        parts = [self._bytes(g, range(starts[i], starts[i + 1])) for i in range(layers)]
        cost = [w + s for w, s in parts]

        def need(a: int, b: int) -> tuple[int, int]:
            w, s = self._bytes(g, range(starts[a], starts[b]))
            return w, s

        if self.split is not None:
            total, cum, bounds = sum(self.split), 0.0, [0]
            for share in self.split[:-1]:
                cum += share
                bounds.append(round(layers * cum / total))
            bounds.append(layers)
            if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
                raise Unsupported(Reason.SHAPE, f"tensor split {','.join(f'{s:g}' for s in self.split)}",
                                  f"some device gets none of the {layers} layers")
        else:
            bounds = self._balanced(cost, layers, n)
        ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        needs = []
        for r, (a, b) in enumerate(ranges):
            w, s = need(a, b)
            if w + s > self.targets[r].free:
                raise self._refuse(r, w + s, w, s, f"layers {a}..{b - 1}")
            needs.append(w + s)
        return Plan(Placement.PIPELINE, ranges, needs, self.context, [t.free for t in self.targets])

    def _balanced(self, cost: list[int], layers: int, n: int) -> list[int]:
        """Contiguous ranges of layers, each rank at least one, minimizing the largest share of a device's free
        memory used (the embedding and head go with the first and last ranges' costs through `need`)."""
        free = [max(t.free, 1) for t in self.targets]
        prefix = [0]
        for c in cost:
            prefix.append(prefix[-1] + c)
        inf = float("inf")
        best = [[inf] * (layers + 1) for _ in range(n + 1)]
        cut = [[0] * (layers + 1) for _ in range(n + 1)]
        best[0][0] = 0.0
        for r in range(1, n + 1):
            for b in range(r, layers - (n - r) + 1):
                for a in range(r - 1, b):
                    load = max(best[r - 1][a], (prefix[b] - prefix[a]) / free[r - 1])
                    if load < best[r][b]:
                        best[r][b], cut[r][b] = load, a
        bounds, b = [layers], layers
        for r in range(n, 0, -1):
            b = cut[r][b]
            bounds.append(b)
        return bounds[::-1]

    def _tensor(self) -> Plan:
        n = len(self.targets)
        if self.split is not None and len(set(self.split)) > 1:
            raise Unsupported(Reason.SHAPE, f"tensor split {','.join(f'{s:g}' for s in self.split)} under tensor "
                              "parallelism", "the ranks hold equal shares of every layer; an uneven split is a "
                              "pipeline's (--pp)")
        layers = stages.layer_count(self.graph)
        needs = []
        check = splittable(self.store)
        for r in range(n):
            local, shards = tp.shard(self.graph, r, n, "plan", check)
            w, s = self._bytes(local, range(len(local.nodes)), shards)
            if w + s > self.targets[r].free:
                raise self._refuse(r, w + s, w, s, f"a 1/{n} tensor-parallel share")
            needs.append(w + s)
        return Plan(Placement.TENSOR, [(0, layers)] * n, needs, self.context, [t.free for t in self.targets])


__all__ = ["STATE_BYTES", "Plan", "Planner", "Target"]
