"""The traced step: a flat list of nodes over named weights, inputs and KV state.

A family writes its forward once against a `Tracer`; tracing it for one `StepShape` gives a `Graph` that an
executor prepares once and runs many times. Shapes are concrete for the step shape they were traced for.

Op vocabulary (attributes in brackets; every executor implements these or refuses them by name):
  embed(table, tokens)                         -> [R, T, D]        [scale]
  rms_norm(x, w)                               -> same             [eps, offset: (offset + w) * x_hat]
  layer_norm(x, w, b)                          -> same             [eps]
  linear(x, w, b?)                             -> [.., N]          (w dense or packed, any stored layout)
  rope(x, positions)                           -> same             [theta, dim, style, scaling]
  attention(q, k, v, positions)                -> [R, T, Hq, Dh]   [layer, causal, window, softcap, scale]
      (k, v of the new tokens are written into the layer's KV state, then q attends over it)
  encoder_attention(q, k, v, mask)             -> [R, T, Hq, Dh]   bidirectional, no KV state; mask [R, T]
  gated(gate, up)                              -> same             [act: silu | gelu_tanh | gelu]
  activation(x)                                -> same             [act]
  add(a, b), mul(a, b), scale(x)               -> broadcast        [factor]
  reshape(x)                                   -> [shape]
  last_position(x)                             -> [R, 1, D]        (the hidden state logits need)
  logits(x, w)                                 -> [R, T', V] f32   [softcap]
  moe(x, router, experts...)                   see the MoE family's notes in ops.py
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepShape:
    """rows: sequences per step; tokens: new tokens per row; capacity: KV positions per row.
    all_logits: logits for every new token (exactness tests, perplexity) or only the last one.
    hidden: return the final hidden state instead of logits (embeddings)."""

    rows: int
    tokens: int
    capacity: int
    all_logits: bool = False
    hidden: bool = False


@dataclass(frozen=True)
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"  # activation dtype as the graph sees it; executors choose storage


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    output: str
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass
class StateSpec:
    """A per-layer buffer that lives across steps (the KV cache). `shape` is per row set, e.g.
    [rows, kv_heads, capacity, head_dim]; `kind` names the content ("k", "v", "latent", ...)."""

    name: str
    shape: tuple[int, ...]
    kind: str


@dataclass
class Graph:
    shape: StepShape
    nodes: list[Node] = field(default_factory=list)
    inputs: dict[str, Value] = field(default_factory=dict)
    weights: dict[str, tuple[int, ...]] = field(default_factory=dict)
    state: dict[str, StateSpec] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)

    def ops(self) -> set[str]:
        return {n.op for n in self.nodes}


class Tracer:
    """Records ops into a Graph. Families call these methods with Values and get Values back."""

    def __init__(self, shape: StepShape, weight_shapes: dict[str, tuple[int, ...]]) -> None:
        self.graph = Graph(shape)
        self._weight_shapes = weight_shapes
        self._count = 0

    # --- leaves ---------------------------------------------------------------------------------------
    def input(self, name: str, shape: tuple[int, ...], dtype: str = "i64") -> Value:
        value = Value(name, shape, dtype)
        self.graph.inputs[name] = value
        return value

    def weight(self, name: str) -> Value:
        """A stored weight by the name the family reads. Unknown names fail at trace time."""
        shape = self._weight_shapes.get(name)
        if shape is None:
            raise KeyError(name)
        self.graph.weights[name] = shape
        return Value(f"w:{name}", shape, "weight")

    def has_weight(self, name: str) -> bool:
        return name in self._weight_shapes

    def state(self, name: str, shape: tuple[int, ...], kind: str) -> Value:
        self.graph.state[name] = StateSpec(name, shape, kind)
        return Value(f"s:{name}", shape, "state")

    def output(self, value: Value) -> None:
        self.graph.outputs.append(value.name)

    # --- ops ------------------------------------------------------------------------------------------
    def op(self, op: str, inputs: tuple[Value | None, ...], shape: tuple[int, ...], **attrs: Any) -> Value:
        """Record one node. `None` inputs (an absent bias) are kept as empty names."""
        self._count += 1
        out = f"{op}{self._count}"
        names = tuple("" if v is None else v.name for v in inputs)
        self.graph.nodes.append(Node(op, names, out, shape, dict(attrs)))
        return Value(out, shape)

    def embed(self, table: Value, tokens: Value, scale: float | None = None) -> Value:
        return self.op("embed", (table, tokens), (*tokens.shape, table.shape[-1]), scale=scale)

    def rms_norm(self, x: Value, w: Value, eps: float, offset: float = 0.0) -> Value:
        return self.op("rms_norm", (x, w), x.shape, eps=eps, offset=offset)

    def layer_norm(self, x: Value, w: Value, b: Value | None, eps: float) -> Value:
        return self.op("layer_norm", (x, w, b), x.shape, eps=eps)

    def linear(self, x: Value, w: Value, b: Value | None = None) -> Value:
        return self.op("linear", (x, w, b), (*x.shape[:-1], w.shape[0]))

    def reshape(self, x: Value, shape: tuple[int, ...]) -> Value:
        return self.op("reshape", (x,), shape)

    def rope(self, x: Value, positions: Value, *, theta: float, dim: int, style: str = "neox",
             scaling: dict[str, Any] | None = None) -> Value:
        """x [R, T, H, Dh]; rotates the first `dim` features of each head. style: "neox" (rotate half,
        Hugging Face layout) or "interleaved" (pairs (0,1), (2,3): llama.cpp's layout of permuted q/k)."""
        return self.op("rope", (x, positions), x.shape, theta=theta, dim=dim, style=style,
                       scaling=dict(scaling or {}))

    def attention(self, q: Value, k: Value, v: Value, positions: Value, *, layer: int, capacity: int,
                  scale: float, window: int | None = None, softcap: float | None = None) -> Value:
        """Causal attention through the layer's KV state: k, v [R, T, Hkv, Dh] of the new tokens are
        written at `positions`, then every query attends to the positions up to its own
        (and within `window` of it, when set)."""
        rows, _, kv_heads, head_dim = k.shape
        kc = self.state(f"k{layer}", (rows, kv_heads, capacity, head_dim), "k")
        vc = self.state(f"v{layer}", (rows, kv_heads, capacity, v.shape[-1]), "v")
        shape = (*q.shape[:3], v.shape[-1])
        return self.op("attention", (q, k, v, positions, kc, vc), shape, layer=layer, scale=scale,
                       window=window, softcap=softcap)

    def encoder_attention(self, q: Value, k: Value, v: Value, mask: Value, *, scale: float) -> Value:
        return self.op("encoder_attention", (q, k, v, mask), (*q.shape[:3], v.shape[-1]), scale=scale)

    def gated(self, gate: Value, up: Value, act: str = "silu") -> Value:
        return self.op("gated", (gate, up), gate.shape, act=act)

    def activation(self, x: Value, act: str) -> Value:
        return self.op("activation", (x,), x.shape, act=act)

    def add(self, a: Value, b: Value) -> Value:
        return self.op("add", (a, b), a.shape)

    def mul(self, a: Value, b: Value) -> Value:
        return self.op("mul", (a, b), a.shape)

    def scale(self, x: Value, factor: float) -> Value:
        return self.op("scale", (x,), x.shape, factor=factor)

    def last_position(self, x: Value) -> Value:
        return self.op("last_position", (x,), (x.shape[0], 1, x.shape[-1]))

    def logits(self, x: Value, w: Value, softcap: float | None = None) -> Value:
        return self.op("logits", (x, w), (*x.shape[:-1], w.shape[0]), softcap=softcap)

    def finish(self, x: Value, head: Value, softcap: float | None = None) -> None:
        """The common end of a decoder step: the final hidden state itself (embedding steps), or logits
        for the last position of each row (decode, prefill) or for every position (all_logits)."""
        shape = self.graph.shape
        if shape.hidden:
            self.output(x)
            return
        if not shape.all_logits:
            x = self.last_position(x)
        self.output(self.logits(x, head, softcap))
