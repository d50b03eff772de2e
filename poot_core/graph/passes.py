"""What every executor needs to know about a graph, computed once here instead of in each backend.

- `OPS`: the op vocabulary, the one list of ops a graph may hold, with their inputs and attributes.
- `handled_ops` / `Dispatch`: a backend writes one `op_<name>` method per op it runs; the table of them is
  built from the vocabulary, so its capabilities are exactly its handlers and a graph op without a handler
  is refused by name (`Unsupported(Operation)`) when the graph is prepared.
- `last_use` / `dead_after`: liveness of the step's values, for freeing or reusing their memory.
- `add_norm_pairs`: a residual add whose sum the next node RMS-normalizes (one kernel can do both).
- `shared_input_linears`: linears that read the same value (q/k/v, gate/up), which one product over their
  joined weights can compute.
- `gated_linear_pairs`: a gated activation of two linears of one input (gate/up): one product kernel can
  apply the activation as it writes, the two products' values never stored.
- `rope_attention_triples`: the q and k ropes an attention alone reads: one kernel can rotate both and write
  the new keys and values into the cache.

A new op is one `OPS` entry plus one `op_<name>` handler per backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar

from poot_core.errors import Reason, Unsupported
from poot_core.graph.ir import Graph, Node, Ref, ValueRef, WeightRef


@dataclass(frozen=True)
class OpSpec:
    """One op of the vocabulary. inputs: their roles in order, "?" marks an optional one (None when absent),
    "*" a run of them to the end; w/table/router/... are stored weights, k_cache/v_cache/cache state."""

    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    result: str


OPS: dict[str, OpSpec] = {
    "embed": OpSpec(("table", "tokens"), ("scale",), "[R, T, D]"),
    "rms_norm": OpSpec(("x", "w"), ("eps", "offset"), "x's shape: (offset + w) * x_hat"),
    "layer_norm": OpSpec(("x", "w", "b?"), ("eps",), "x's shape"),
    "linear": OpSpec(("x", "w", "b?"), (), "[.., N]; w dense or packed, any stored layout"),
    "reshape": OpSpec(("x",), (), "the node's shape"),
    "rope": OpSpec(("x", "positions"), ("theta", "dim", "style", "scaling"), "x's shape"),
    # k, v of the new tokens are written into the layer's KV state, then q attends over it; a paged step
    # (StepShape.paging) also reads seq_index and block_tables, its caches being pools of blocks
    "attention": OpSpec(("q", "k", "v", "positions", "k_cache", "v_cache", "seq_index?", "block_tables?"),
                        ("layer", "scale", "window", "softcap"), "[R, T, Hq, Dh]"),
    "encoder_attention": OpSpec(("q", "k", "v", "mask"), ("scale",), "[R, T, Hq, Dh]; bidirectional, mask [R, T]"),
    "gated": OpSpec(("gate", "up"), ("act",), "gate's shape: act(gate) * up"),
    "activation": OpSpec(("x",), ("act",), "x's shape"),
    "add": OpSpec(("a", "b"), (), "a's shape"),
    "mul": OpSpec(("a", "b"), (), "a's shape"),
    "scale": OpSpec(("x",), ("factor",), "x's shape"),
    "last_position": OpSpec(("x", "logit_index?"), (),
                            "[R, 1, D]: the hidden state logits need; paged: [1, S, D], x[0, logit_index]"),
    "logits": OpSpec(("x", "w"), ("softcap",), "[R, T', V] float32"),
    "moe": OpSpec(("x", "router", "bias?", "shared?", "shared_gate?", "experts*"),
                  ("experts", "stacked", "top_k", "scoring", "norm_topk", "routed_scale", "groups", "topk_groups",
                   "group_score", "act"), "x's shape; see Tracer.moe"),
    "mla_attention": OpSpec(("q", "kv", "positions", "kv_norm", "kv_b", "cache", "seq_index?", "block_tables?"),
                            ("layer", "scale", "nope_dim", "rope_dim", "v_dim", "eps", "theta", "style", "scaling"),
                            "[R, T, H, v_dim]; see Tracer.mla_attention"),
    # recurrent layers (poot-family-hybrid): their state is of a RECURRENT_KINDS kind, fixed size per row; a
    # paged step's state is a pool of slots (Paging.state_slots), read through positions, seq_index, state_slots
    "slice": OpSpec(("x",), ("start", "stop"), "x[..., start:stop]"),
    "short_conv": OpSpec(("x", "w", "b?", "window", "positions?", "seq_index?", "state_slots?"), ("layer", "act"),
                         "x's shape [R, T, C]; causal depthwise convolution, window carried; Tracer.short_conv"),
    "ssm_scan": OpSpec(("x", "dt", "a_log", "b", "c", "d", "dt_bias", "ssm_state", "positions?", "seq_index?",
                        "state_slots?"), ("layer", "chunk", "dt_limit"),
                       "x's shape [R, T, H, P]; Mamba2's selective scan, see Tracer.ssm_scan"),
    "gated_delta": OpSpec(("q", "k", "v", "a", "b", "a_log", "dt_bias", "delta_state", "positions?", "seq_index?",
                           "state_slots?"), ("layer", "chunk", "eps"),
                          "v's shape [R, T, Hv, Dv]; the gated delta rule (Qwen3-Next), see Tracer.gated_delta"),
    # vision-language families: image features [N, D] replace the rows of x [R, T, D] at flat indices index [N]
    "splice": OpSpec(("x", "features", "index"), (), "x's shape; x.reshape(-1, D)[index] = features"),
    # attention's causal mask, where the step's new tokens of one group (groups [R, T], -1: none; an image's
    # tokens in Gemma 3) also see each other both ways (still within the window); contiguous KV only
    "group_attention": OpSpec(("q", "k", "v", "positions", "k_cache", "v_cache", "groups", "seq_index?",
                               "block_tables?"),
                              ("layer", "scale", "window", "softcap"), "[R, T, Hq, Dh]; see Tracer.attention"),
    "gated_rms_norm": OpSpec(("x", "gate", "w"), ("eps", "group", "norm_first"),
                             "x's shape: rms_norm per group of x * silu(gate); norm_first: rms_norm(x) * silu(gate)"),
    # several devices (poot_core.distributed): collectives over the ranks of the Coordinator whose key is `group`
    "all_reduce": OpSpec(("x",), ("group",), "x's shape: the sum of every rank's x (tensor-parallel partial sums)"),
    "all_gather": OpSpec(("x",), ("group", "sizes"),
                         "[.., sum(sizes)]: the ranks' x joined along the last axis, rank r's of width sizes[r]"),
}

# The ops only hybrid families use: the CPU and Triton executors compute them; Vulkan and OpenCL refuse them by name.
HYBRID_OPS = frozenset({"slice", "short_conv", "ssm_scan", "gated_delta", "gated_rms_norm"})
# The ops only vision-language families use, computed so far by the CPU executor alone.
VISION_OPS = frozenset({"splice", "group_attention"})
# The collectives of placed programs (poot_core.distributed), computed so far by the CPU executor alone (gloo).
DISTRIBUTED_OPS = frozenset({"all_reduce", "all_gather"})

HANDLER = "op_"  # a backend's handler of op X is its method op_X

H = TypeVar("H")


@cache
def handled_ops(cls: type) -> frozenset[str]:
    """The ops of the vocabulary `cls` has a handler for. A handler named after an op outside the vocabulary is
    a mistake (a typo, or an op added to one backend only), refused as soon as the class is asked."""
    stray = sorted(n[len(HANDLER):] for n in dir(cls) if n.startswith(HANDLER) and n[len(HANDLER):] not in OPS)
    if stray:
        raise TypeError(f"{cls.__qualname__} has handlers for ops outside the vocabulary: {', '.join(stray)}")
    return frozenset(op for op in OPS if callable(getattr(cls, HANDLER + op, None)))


class Dispatch(Generic[H]):
    """op name -> the owner's handler (`owner.op_<name>(node)`), for the ops of the vocabulary it handles."""

    def __init__(self, owner: Any, backend: str) -> None:
        self.backend = backend
        self.table: dict[str, Callable[[Node], H]] = {op: getattr(owner, HANDLER + op)
                                                      for op in handled_ops(type(owner))}

    def __call__(self, node: Node) -> H:
        handler = self.table.get(node.op)
        if handler is None:
            raise Unsupported(Reason.OPERATION, node.op, f"the {self.backend} backend has no kernel for it")
        return handler(node)


Reads = Sequence[Sequence[Ref | None]]


def last_use(graph: Graph, reads: Reads | None = None) -> dict[str, int]:
    """For each value (computed or a step input) the index of the last node that reads it; the graph's outputs
    are read after the last node (index len(nodes)). `reads[i]`: what node i reads where a fusion changed it
    (default: its inputs)."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for ref in node.inputs if reads is None else reads[index]:
            if isinstance(ref, ValueRef):
                last[ref.name] = index
    for name in graph.outputs:
        last[name] = len(graph.nodes)
    return last


def dead_after(graph: Graph, reads: Reads | None = None) -> list[list[str]]:
    """For each node, the computed values that no later node and no output reads: once it has run, their
    memory may be freed. Step inputs are never listed."""
    dead: list[list[str]] = [[] for _ in graph.nodes]
    for name, index in last_use(graph, reads).items():
        if index < len(graph.nodes) and name not in graph.inputs:
            dead[index].append(name)
    return dead


def add_norm_pairs(nodes: Sequence[Node]) -> list[int]:
    """Indices i where node i adds two values of the step and node i + 1 RMS-normalizes that sum (a
    transformer block has two): one kernel can compute both, keeping the sum for its other readers."""
    return [i for i, (add, norm) in enumerate(zip(nodes, nodes[1:], strict=False))
            if add.op == "add" and norm.op == "rms_norm" and norm.input(0) == ValueRef(add.output)
            and all(isinstance(r, ValueRef) for r in add.inputs)]


def linear_weight(node: Node) -> str | None:
    """The stored weight's name of a linear node without a bias; None for any other node."""
    w = node.input(1)
    if node.op != "linear" or not isinstance(w, WeightRef) or node.input(2) is not None:
        return None
    return w.name


def shared_input_linears(nodes: Sequence[Node]) -> list[list[int]]:
    """Groups (two or more, in program order) of bias-free linears with stored weights that read the same
    value: q/k/v, gate/up. One product over their joined weights, run where the first one stands, computes
    them all; a backend keeps the groups (or runs within them) whose weights it can join."""
    by_input: dict[Ref | None, list[int]] = {}
    for i, node in enumerate(nodes):
        if linear_weight(node) is not None:
            by_input.setdefault(node.inputs[0], []).append(i)
    return [group for group in by_input.values() if len(group) > 1]


def readers(nodes: Sequence[Node], outputs: Sequence[str] = ()) -> dict[str, list[int]]:
    """Each value's reading nodes, in program order; a graph output also gets the index len(nodes)."""
    found: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for ref in dict.fromkeys(node.inputs):
            if isinstance(ref, ValueRef):
                found.setdefault(ref.name, []).append(i)
    for name in outputs:
        found.setdefault(name, []).append(len(nodes))
    return found


def _producers(nodes: Sequence[Node]) -> dict[str, int]:
    return {node.output: i for i, node in enumerate(nodes)}


def gated_linear_pairs(graph: Graph) -> list[tuple[int, int, int]]:
    """(gate, up, gated) node indices where a gated node reads two bias-free linears of stored weights over the
    same input (gate first), which nothing else reads, and the up linear stands right before the gated node:
    one product kernel can write act(gate) * up directly (the gate/up rows side by side)."""
    nodes = graph.nodes
    made, read = _producers(nodes), readers(nodes, graph.outputs)
    found = []
    for i, node in enumerate(nodes):
        if node.op != "gated" or not all(isinstance(r, ValueRef) for r in node.inputs[:2]):
            continue
        g, u = (made.get(r.name, -1) for r in node.inputs[:2])
        if (g < 0 or u != i - 1 or g == u or linear_weight(nodes[g]) is None or linear_weight(nodes[u]) is None
                or nodes[g].inputs[0] != nodes[u].inputs[0]):
            continue
        if read[nodes[g].output] == [i] and read[nodes[u].output] == [i]:
            found.append((g, u, i))
    return found


def rope_attention_triples(graph: Graph) -> list[tuple[int, int, int]]:
    """(q rope, k rope, attention) node indices where attention's q and k are ropes of its own positions with
    the same attributes, read by nothing else: one kernel can rotate both and write the new keys (and the
    values) into the cache where the attention stands."""
    nodes = graph.nodes
    made, read = _producers(nodes), readers(nodes, graph.outputs)
    found = []
    for i, node in enumerate(nodes):
        if node.op != "attention" or not all(isinstance(r, ValueRef) for r in node.inputs[:2]):
            continue
        q, k = (made.get(r.name, -1) for r in node.inputs[:2])
        if q < 0 or k < 0 or q == k or nodes[q].op != "rope" or nodes[k].op != "rope":
            continue
        if (nodes[q].attrs != nodes[k].attrs or nodes[q].input(1) != node.input(3)
                or nodes[k].input(1) != node.input(3)):
            continue
        if read[nodes[q].output] == [i] and read[nodes[k].output] == [i]:
            found.append((q, k, i))
    return found


__all__ = ["DISTRIBUTED_OPS", "HANDLER", "HYBRID_OPS", "OPS", "VISION_OPS", "Dispatch", "OpSpec", "add_norm_pairs",
           "dead_after", "gated_linear_pairs", "handled_ops", "last_use", "linear_weight", "readers",
           "rope_attention_triples", "shared_input_linears"]
