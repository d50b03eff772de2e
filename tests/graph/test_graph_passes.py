"""The shared graph passes (poot_core.graph.passes) on a traced tiny llama: what each executor builds on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from poot_core import (
    Driver,
    DriverOptions,
    ModelHandle,
    Node,
    StepShape,
    Unsupported,
    ValueRef,
    WeightRef,
    open_executor,
)
from poot_core.graph import OPS, Dispatch, handled_ops, passes

LAYERS = 3  # tests/helpers/tiny.py's llama


@pytest.fixture(scope="module")
def graph(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    return Driver(handle, open_executor("cpu"), DriverOptions(capacity=64)).program(StepShape(1, 4, 64)).graph


def test_references_are_typed(graph):
    linear = next(n for n in graph.nodes if n.op == "linear")
    assert isinstance(linear.inputs[0], ValueRef) and isinstance(linear.inputs[1], WeightRef)
    assert linear.inputs[1].name in graph.weights and linear.inputs[2] is None  # llama has no biases
    attention = next(n for n in graph.nodes if n.op == "attention")
    caches = attention.inputs[4:]
    assert [r.name for r in caches] == ["k0", "v0"] and all(r.name in graph.state for r in caches)
    assert ValueRef("k0") != attention.inputs[4]  # same name, other kind


def test_shared_input_linears_are_qkv_and_gate_up(graph):
    groups = passes.shared_input_linears(graph.nodes)
    names = [tuple(str(passes.linear_weight(graph.nodes[i])).split(".")[-2] for i in g) for g in groups]
    assert names == [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")] * LAYERS


def test_add_norm_pairs_are_the_two_residual_adds_of_each_block(graph):
    pairs = passes.add_norm_pairs(graph.nodes)
    assert len(pairs) == 2 * LAYERS
    for i in pairs:
        assert graph.nodes[i].op == "add" and graph.nodes[i + 1].op == "rms_norm"


def test_gated_linear_pairs_are_gate_up_of_each_block(graph):
    pairs = passes.gated_linear_pairs(graph)
    assert len(pairs) == LAYERS
    for gate, up, gated in pairs:
        names = [str(passes.linear_weight(graph.nodes[i])).split(".")[-2] for i in (gate, up)]
        assert names == ["gate_proj", "up_proj"] and up == gated - 1 and graph.nodes[gated].op == "gated"


def test_rope_attention_triples_are_q_and_k_of_each_attention(graph):
    triples = passes.rope_attention_triples(graph)
    assert len(triples) == LAYERS
    for q, k, at in triples:
        attention = graph.nodes[at]
        assert attention.op == "attention" and q < k < at
        assert [ValueRef(graph.nodes[i].output) for i in (q, k)] == list(attention.inputs[:2])


def test_fusion_passes_skip_values_read_elsewhere(graph):
    """A gate or a rope read by a second node is not fused away."""
    nodes = list(graph.nodes)
    gate, _, gated = passes.gated_linear_pairs(graph)[0]
    q, _, _ = passes.rope_attention_triples(graph)[0]
    extra = [Node("scale", (ValueRef(nodes[i].output),), f"extra{i}", nodes[i].shape, {"factor": 2.0})
             for i in (gate, q)]
    changed = dataclasses.replace(graph, nodes=nodes + extra)
    assert len(passes.gated_linear_pairs(changed)) == LAYERS - 1
    assert len(passes.rope_attention_triples(changed)) == LAYERS - 1
    assert gated not in [g for _, _, g in passes.gated_linear_pairs(changed)]


def test_each_value_dies_once_after_its_last_reader(graph):
    dead = passes.dead_after(graph)
    seen = [name for names in dead for name in names]
    assert len(seen) == len(set(seen))
    assert not set(seen) & set(graph.outputs) and not set(seen) & set(graph.inputs)
    for at, names in enumerate(dead):
        for name in names:
            readers = [i for i, n in enumerate(graph.nodes) if ValueRef(name) in n.inputs]
            assert readers and max(readers) == at
    made = {n.output for n in graph.nodes}
    read = {r.name for n in graph.nodes for r in n.inputs if isinstance(r, ValueRef)}
    assert set(seen) == (made & read) - set(graph.outputs)


def test_every_backend_handles_only_vocabulary_ops():
    from poot_core.cpu.executor import CpuExecutor

    assert CpuExecutor().capabilities().ops == frozenset(OPS)
    from poot_kernels_triton.executor import TRITON_OPS  # make test installs it: missing, this must fail

    assert TRITON_OPS == frozenset(OPS)  # the vision and collective ops included


def test_dispatch_refuses_an_op_without_a_handler_by_name():
    class Backend:
        def op_add(self, node: Node) -> str:
            return "added"

    dispatch = Dispatch(Backend(), "toy")
    assert handled_ops(Backend) == {"add"} and dispatch(Node("add", ("a", "b"), "c", (1,))) == "added"
    with pytest.raises(Unsupported) as err:
        dispatch(Node("mul", ("a", "b"), "c", (1,)))
    assert err.value.name == "mul" and "toy" in str(err.value)

    class Typo:
        def op_rmsnorm(self, node: Node) -> None: ...

    with pytest.raises(TypeError, match="rmsnorm"):
        handled_ops(Typo)
