"""How a backend that plans its own buffers (OpenCL, Vulkan) finds a node's arguments: a weight among the
uploaded vectors or stored matrices (a typed refusal naming it, and why it was not uploaded, when it is
missing), a step input, or the buffer of a value an earlier node computed (buffers.BufferPool)."""

from __future__ import annotations

from typing import Any, NoReturn

from poot_core.errors import Reason, Unsupported
from poot_core.graph.buffers import BufferPool
from poot_core.graph.ir import Node, WeightRef


class NodeArgs:
    """A mixin for a backend's step planner, which sets `backend` (its name, for refusals), `weights` (the uploaded
    checkpoint: `vectors` and `matrices` by name, and `skipped`: why a weight was not uploaded), `inputs` (the
    step inputs' device arrays by name) and `_buffers` (its BufferPool)."""

    backend: str
    weights: Any
    inputs: dict[str, Any]
    _buffers: BufferPool

    def _new(self, node: Node) -> Any:
        """The device array of the node's output."""
        return self._buffers.new(node.output, tuple(node.shape))

    def _value(self, node: Node, i: int) -> Any:
        """Input i of the node: a vector weight, a step input or an earlier node's value."""
        ref = node.inputs[i]
        name = "" if ref is None else ref.name
        if isinstance(ref, WeightRef):
            found = self.weights.vectors.get(name)
            if found is None:
                self._missing(node, name, "a vector")
            return found
        if name in self.inputs:
            return self.inputs[name]
        return self._buffers.value(node, name)

    def _optional(self, node: Node, i: int) -> Any | None:
        return self._value(node, i) if node.input(i) is not None else None

    def _matrix(self, node: Node, i: int) -> Any:
        """Input i of the node as a stored matrix."""
        ref = node.inputs[i]
        found = self.weights.matrices.get(ref.name) if isinstance(ref, WeightRef) else None
        if found is None:
            self._missing(node, str(ref), "a stored matrix")
        return found

    def _missing(self, node: Node, weight: str, wanted: str) -> NoReturn:
        why = self.weights.skipped.get(weight, "it is not a weight of the uploaded checkpoint")
        raise Unsupported(Reason.SHAPE, f"{node.op} weight {weight}",
                          f"the {self.backend} backend needs {wanted}: {why}")


__all__ = ["NodeArgs"]
