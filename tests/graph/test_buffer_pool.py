"""poot_core.graph.BufferPool: the device buffers of a step planned node by node (the OpenCL and Vulkan
programs), over stand-in buffers that count their allocations."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from poot_core import Node, Reason, StepShape, Unsupported, Value, ValueRef
from poot_core.graph import BufferPool, Graph


@dataclass(eq=False)
class Buffer:
    nbytes: int


@dataclass
class Array:
    buffer: Buffer
    shape: tuple[int, ...]
    dtype: str = "f32"


class Planner:
    """Plans a graph the way the device backends do: each node reads its inputs, gets its output, and the
    pool releases after it."""

    def __init__(self, graph: Graph) -> None:
        self.allocated: list[Buffer] = []
        self.pool: BufferPool[Buffer, Array] = BufferPool(graph, self.allocate, Array, lambda a: a.buffer)
        self.graph = graph
        self.inputs = {name: Array(Buffer(4 * 4), (4,), "u32") for name in graph.inputs}

    def allocate(self, nbytes: int) -> Buffer:
        self.allocated.append(Buffer(nbytes))
        return self.allocated[-1]

    def read(self, node: Node) -> list[Array]:
        names = [r.name for r in node.inputs if r is not None]
        return [self.inputs[n] if n in self.inputs else self.pool.value(node, n) for n in names]

    def plan(self, at: int) -> Array:
        node = self.graph.nodes[at]
        read = self.read(node)
        if node.op == "reshape":
            out = self.pool.define(node.output, Array(read[0].buffer, node.shape))
        else:
            out = self.pool.new(node.output, node.shape)
        self.pool.release(at, node)
        return out


def graph_of(*nodes: Node, outputs: tuple[str, ...]) -> Graph:
    inputs = {"ids": Value(ValueRef("ids"), (1, 4))}
    return Graph(StepShape(1, 4, 16), list(nodes), inputs=inputs, outputs=list(outputs))


def test_a_buffer_is_reused_only_after_the_last_reader_of_its_value():
    graph = graph_of(
        Node("f", ("ids",), "a", (4, 8)),
        Node("f", ("a",), "b", (4, 8)),
        Node("f", ("a", "b"), "c", (4, 8)),  # the last reader of a and b
        Node("f", ("c",), "d", (4, 8)),
        Node("f", ("d",), "e", (2, 16)),  # the same bytes, another shape
        outputs=("e",),
    )
    planner = Planner(graph)
    a, b, c = planner.plan(0), planner.plan(1), planner.plan(2)
    assert len({id(a.buffer), id(b.buffer), id(c.buffer)}) == 3  # a is still read by c when b is planned
    d = planner.plan(3)
    assert d.buffer in (a.buffer, b.buffer) and len(planner.allocated) == 3
    e = planner.plan(4)
    assert e.buffer in (a.buffer, b.buffer, c.buffer) and e.buffer is not d.buffer and e.shape == (2, 16)
    assert len(planner.allocated) == 3
    assert all(buffer.nbytes == 4 * 32 for buffer in planner.allocated)


def test_a_buffer_of_another_size_is_not_reused():
    graph = graph_of(
        Node("f", ("ids",), "a", (4, 8)),
        Node("f", ("a",), "b", (4, 9)),
        outputs=("b",),
    )
    planner = Planner(graph)
    a, b = planner.plan(0), planner.plan(1)
    assert b.buffer is not a.buffer and [x.nbytes for x in planner.allocated] == [4 * 32, 4 * 36]


def test_a_view_keeps_its_buffer_alive_until_the_view_is_dead():
    graph = graph_of(
        Node("f", ("ids",), "a", (4, 8)),
        Node("reshape", ("a",), "r", (32,)),  # a's last reader; r aliases a's buffer
        Node("f", ("r",), "b", (32,)),  # r's last reader
        Node("f", ("b",), "c", (32,)),
        outputs=("c",),
    )
    planner = Planner(graph)
    a, r, b = planner.plan(0), planner.plan(1), planner.plan(2)
    assert r.buffer is a.buffer and b.buffer is not a.buffer  # r still lived when b was planned
    c = planner.plan(3)
    assert c.buffer is a.buffer and len(planner.allocated) == 2


def test_a_view_of_a_step_input_is_never_handed_out():
    graph = graph_of(
        Node("reshape", ("ids",), "flat", (4,)),
        Node("f", ("flat",), "a", (4,)),
        Node("f", ("a",), "b", (4,)),
        outputs=("b",),
    )
    planner = Planner(graph)
    flat, a, b = planner.plan(0), planner.plan(1), planner.plan(2)
    ids = planner.inputs["ids"].buffer
    assert flat.buffer is ids and ids not in (a.buffer, b.buffer) and ids not in planner.allocated


def test_an_output_lives_past_the_last_node():
    graph = graph_of(
        Node("f", ("ids",), "a", (4,)),
        Node("f", ("a",), "b", (4,)),
        Node("f", ("a",), "c", (4,)),
        outputs=("b", "c"),
    )
    planner = Planner(graph)
    a, b, c = planner.plan(0), planner.plan(1), planner.plan(2)
    assert c.buffer is not b.buffer  # b is an output: its buffer is never freed
    assert c.buffer is not a.buffer  # a is still read by node 2 when c is planned


def test_read_later_keeps_a_value_for_the_next_node():
    graph = graph_of(
        Node("f", ("ids",), "a", (4,)),
        Node("add", ("a", "a"), "s", (4,)),  # a fused add: the next node reads a in its place
        Node("f", ("s",), "n", (4,)),
        Node("f", ("n",), "m", (4,)),
        outputs=("m",),
    )
    planner = Planner(graph)
    a = planner.plan(0)
    planner.pool.read_later(["a"], 1)
    s, n = planner.plan(1), planner.plan(2)
    assert n.buffer not in (a.buffer, s.buffer)  # without read_later, n would take a's buffer
    m = planner.plan(3)
    assert m.buffer in (a.buffer, s.buffer)


def test_read_later_by_a_later_reader_keeps_a_value_until_it():
    graph = graph_of(
        Node("f", ("ids",), "a", (4,)),
        Node("f", ("a",), "r", (4,)),  # a deferred rope: node 3 computes it from a
        Node("f", ("ids",), "b", (4,)),
        Node("f", ("r", "b"), "c", (4,)),
        Node("f", ("c",), "d", (4,)),
        outputs=("d",),
    )
    planner = Planner(graph)
    a = planner.plan(0)
    planner.pool.read_later(["a"], 1, 3)
    r, b, c = planner.plan(1), planner.plan(2), planner.plan(3)
    assert a.buffer not in (r.buffer, b.buffer, c.buffer)  # without it, b would take a's buffer
    d = planner.plan(4)
    assert d.buffer in (a.buffer, r.buffer, b.buffer)


def test_last_reader_is_true_only_for_a_sole_value_at_its_last_reader():
    graph = graph_of(
        Node("f", ("ids",), "a", (4,)),
        Node("reshape", ("a",), "r", (4,)),
        Node("f", ("a", "r"), "b", (4,)),
        Node("f", ("b",), "c", (4,)),
        outputs=("c",),
    )
    planner = Planner(graph)
    planner.plan(0)
    assert not planner.pool.last_reader("a", 1)  # a is read again by node 2
    planner.plan(1)
    assert not planner.pool.last_reader("a", 2)  # r shares a's buffer
    planner.plan(2)
    assert planner.pool.last_reader("b", 3)
    assert not planner.pool.last_reader("ids", 0)  # a step input is not the pool's to overwrite


def test_scratch_is_shared_by_key_and_shape_and_never_freed():
    graph = graph_of(Node("f", ("ids",), "a", (4,)), Node("f", ("a",), "b", (4,)), outputs=("b",))
    planner = Planner(graph)
    first = planner.pool.scratch("logits", (4,))
    assert planner.pool.scratch("logits", (4,)) is first
    assert planner.pool.scratch("logits", (8,)) is not first and planner.pool.scratch("up", (4,)) is not first
    a, b = planner.plan(0), planner.plan(1)
    assert first.buffer not in (a.buffer, b.buffer)


def test_an_unknown_value_is_refused_by_name():
    graph = graph_of(Node("f", ("ids",), "a", (4,)), Node("gated", ("a", "nowhere"), "b", (4,)), outputs=("b",))
    planner = Planner(graph)
    planner.plan(0)
    with pytest.raises(Unsupported) as refused:
        planner.plan(1)
    assert refused.value.reason is Reason.OPERATION
    assert refused.value.name == "gated input nowhere"
    assert refused.value.detail == "the value is not computed by the step"
