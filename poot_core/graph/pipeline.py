"""The layer pipeline's pass: one traced step cut into contiguous stages of layers, one stage per rank.

A cut is a place in the node list where one computed value alone (the residual stream, [R, T, D]) is read on
both sides; step inputs (positions, block tables) every rank has. A node's layer is its `layer` attribute
(attention, KV and recurrent-state ops carry one); a stage of layers [a, b) runs from the last cut before layer
a's first node to the last cut before layer b's. Stage 0 also holds the embedding, the last stage the final norm
and the head. Nothing here knows a family: every traced decoder cuts the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from poot_core.errors import Reason, Unsupported
from poot_core.graph.ir import Graph, StateRef, Value, ValueRef, WeightRef
from poot_core.graph.passes import last_use


@dataclass(frozen=True)
class Cut:
    index: int  # the stage after the cut starts at nodes[index]
    value: str  # the one computed value read on both sides
    shape: tuple[int, ...]


def layer_labels(graph: Graph) -> list[int | None]:
    return [node.attrs.get("layer") for node in graph.nodes]


def layer_count(graph: Graph) -> int:
    labels = [x for x in layer_labels(graph) if x is not None]
    return max(labels) + 1 if labels else 0


def cuts(graph: Graph) -> list[Cut]:
    """Every place where exactly one computed value crosses."""
    last = last_use(graph)
    made = {node.output: i for i, node in enumerate(graph.nodes)}
    found = []
    live: set[str] = set()
    for i, node in enumerate(graph.nodes):
        live = {v for v in live if last.get(v, -1) >= i}
        if len(live) == 1 and i > 0:
            (value,) = live
            found.append(Cut(i, value, graph.nodes[made[value]].shape))
        if last.get(node.output, -1) > i:
            live.add(node.output)
    return found


def boundary(graph: Graph, layer: int) -> Cut:
    """The cut before layer `layer`: the last one with no node of that layer or a later one before it."""
    labels = layer_labels(graph)
    first = next((i for i, x in enumerate(labels) if x is not None and x >= layer), None)
    before = [c for c in cuts(graph) if first is not None and c.index <= first]
    if not before or any(x is not None and x >= layer for x in labels[:before[-1].index]):
        raise Unsupported(Reason.SHAPE, f"a pipeline cut before layer {layer}",
                          "no single hidden state crosses there; this step cannot be split into layer stages")
    return before[-1]


def stage(graph: Graph, first: int, end: int) -> Graph:
    """The step of layers [first, end): its inputs are the step's inputs it reads (and, after stage 0, the
    hidden state of the cut before it, by that value's name), its output the hidden state of the cut after it
    (or the step's outputs, for the last stage)."""
    layers = layer_count(graph)
    if not 0 <= first < end <= layers:
        raise Unsupported(Reason.SHAPE, f"pipeline stage of layers {first}..{end}", f"the step has {layers} layers")
    if graph.shape.carry_hidden or graph.shape.mtp:
        raise Unsupported(Reason.SHAPE, "a pipeline stage of a multi-token-prediction step",
                          "MTP drafts are not placed over several devices yet")
    start = boundary(graph, first) if first > 0 else None
    stop = boundary(graph, end) if end < layers else None
    nodes = graph.nodes[start.index if start else 0: stop.index if stop else len(graph.nodes)]
    out = Graph(graph.shape, list(nodes))
    read = {ref for node in nodes for ref in node.inputs if ref is not None}
    if start is not None:
        out.inputs[start.value] = Value(ValueRef(start.value), start.shape, "f32")
    out.inputs.update({name: v for name, v in graph.inputs.items() if ValueRef(name) in read})
    out.weights = {name: s for name, s in graph.weights.items() if WeightRef(name) in read}
    out.state = {name: s for name, s in graph.state.items() if StateRef(name) in read}
    made = {node.output for node in nodes}
    out.outputs = [stop.value] if stop is not None else list(graph.outputs)
    missing = [name for name in out.outputs if name not in made]
    if missing:
        raise Unsupported(Reason.SHAPE, f"pipeline stage output {missing[0]}", "it is computed in an earlier stage")
    return out


__all__ = ["Cut", "boundary", "cuts", "layer_count", "stage"]
