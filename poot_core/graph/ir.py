"""The traced step's data: typed references, values, nodes and the graph that holds them.

A node reads references: a stored weight (`WeightRef`), a buffer that lives across steps such as a layer's KV
cache (`StateRef`), or a value of the step, computed by an earlier node or given as a step input
(`ValueRef`). An absent optional input (a bias a checkpoint does not have) is None. Executors dispatch on the
reference's type instead of parsing its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Ref:
    """What a node reads, by name. Two references are equal only when their kinds and names are."""

    name: str

    def __str__(self) -> str:
        return self.name


class WeightRef(Ref):
    """A stored weight, by the name the checkpoint's store gives it (graph.weights[name] is its shape)."""

    __slots__ = ()


class StateRef(Ref):
    """A buffer that lives across steps, a layer's KV cache (graph.state[name] is its spec)."""

    __slots__ = ()


class ValueRef(Ref):
    """A value of the step: a node's output, or a step input (graph.inputs[name])."""

    __slots__ = ()


@dataclass(frozen=True)
class Paging:
    """The paged KV layout of a serving step. The step is one row of `tokens` tokens from up to `seqs`
    sequences; each layer's KV state is a pool of `blocks` blocks of `block_size` positions, and a sequence's
    position p lives in block `block_tables[s, p // block_size]` at offset p % block_size. The step's extra
    inputs: seq_index [tokens] (the sequence slot of each token; -1 for padding), block_tables
    [seqs, max_blocks], logit_index [seqs] (the token whose logits each slot reads).

    decode: every token of the step is its sequence's only one, token i in slot i (padding after the last):
    a backend then needs no look at the inputs to split the step into runs, so it may replay the step as a
    captured graph. The arithmetic of each token is the same either way.

    state_slots: recurrent state (RECURRENT_KINDS) is a pool of that many fixed-size slots per layer, one per
    running sequence; the step's extra input state_slots [seqs] gives each sequence slot's pool slot, and a
    sequence whose run in the step starts at position 0 starts its slot from zeros (0: the model has none)."""

    blocks: int
    block_size: int
    seqs: int
    max_blocks: int
    decode: bool = False
    state_slots: int = 0


def sequence_runs(seq_index: Any) -> Iterator[tuple[int, int, int]]:
    """(sequence slot, first token, end token) of each run of consecutive tokens of one slot in a paged step's
    seq_index (a tensor, array or list); padding (slot -1) is skipped."""
    slots = seq_index.tolist() if hasattr(seq_index, "tolist") else list(seq_index)
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                yield slots[start], start, i
            start = i


@dataclass(frozen=True)
class StepShape:
    """rows: sequences per step; tokens: new tokens per row; capacity: KV positions per row.
    all_logits: logits for every new token (exactness tests, perplexity) or only the last one.
    hidden: return the final hidden state instead of logits (embeddings).
    paging: the paged layout (serving), else None (each row owns a contiguous KV buffer of `capacity`).
    carry_hidden: besides the logits, output the final hidden state of every new token [R, T, D] (what a
    multi-token-prediction draft reads).
    mtp: the family's multi-token-prediction step instead of the model: inputs tokens, positions and hidden
    [R, T, D] (the target's final hidden state at the position before each token); outputs logits and the
    draft layer's own hidden state [R, T, D] (the next draft step's input).
    replayed: the caller keeps this step's program and runs it again and again over one state, always from the
    same start positions (a vision runtime's prompt at one image size), so an executor may capture even a
    prefill-sized step the way it captures decode steps.
    embedded: rows of the step whose input embeddings are given instead of their tokens' (prompt embeddings: a
    vision model's image features), as the step inputs EMBED_VALUES [embedded, D] and EMBED_ROWS [embedded]
    (flat row numbers; a row may be listed more than once with the same values, to fill a bucket). Only a
    family whose `prompt_embeddings(config)` is true traces such a step.
    sections: the rope turns each token by one position per section of its features (Qwen2.5-VL's M-RoPE): the
    positions are the step inputs SECTION_POSITIONS[:sections], each [rows, tokens] (attention still places a
    token's keys by `positions`); 0: by `positions` alone.
    grouped: the step input GROUPS [rows, tokens] names a group per token (-1 for none) whose tokens, all in
    this step, attend to each other both ways (an image's tokens in Gemma 3): attention is group_attention."""

    rows: int
    tokens: int
    capacity: int
    all_logits: bool = False
    hidden: bool = False
    paging: Paging | None = None
    carry_hidden: bool = False
    mtp: bool = False
    replayed: bool = False
    embedded: int = 0
    sections: int = 0
    grouped: bool = False


# the step inputs of StepShape.embedded and StepShape.sections
EMBED_VALUES = "embed_values"
EMBED_ROWS = "embed_rows"
SECTION_POSITIONS = ("rope_t", "rope_h", "rope_w")
GROUPS = "groups"


@dataclass(frozen=True)
class Value:
    """What the tracer hands a family: a reference with its shape."""

    ref: Ref
    shape: tuple[int, ...]
    dtype: str = "f32"  # activation dtype as the graph sees it; executors choose storage

    @property
    def name(self) -> str:
        return self.ref.name


@dataclass(frozen=True)
class Node:
    """One op: its inputs (None where an optional one is absent), the name of the value it computes and that
    value's shape. A plain string among the inputs names a value (hand-built nodes in tests)."""

    op: str
    inputs: tuple[Ref | None, ...]
    output: str
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if any(isinstance(r, str) for r in self.inputs):
            refs = tuple((ValueRef(r) if r else None) if isinstance(r, str) else r for r in self.inputs)
            object.__setattr__(self, "inputs", refs)

    def input(self, i: int) -> Ref | None:
        """Input i, or None when it is absent or the node has fewer inputs."""
        return self.inputs[i] if i < len(self.inputs) else None


# State kinds that summarize a sequence's whole past in a fixed size (a convolution's last inputs, an SSM's
# state, a delta rule's state), unlike KV, which holds one entry per position: such state cannot be cut back to
# a shorter prefix.
RECURRENT_KINDS = frozenset({"conv", "ssm", "delta"})


@dataclass
class StateSpec:
    """A per-layer buffer that lives across steps (the KV cache). `shape` is per row set, e.g.
    [rows, kv_heads, capacity, head_dim]; `kind` names the content ("k", "v", "latent", ...; the
    RECURRENT_KINDS "conv" [rows, channels, kernel - 1], "ssm" [rows, heads, head_dim, state] and "delta"
    [rows, v_heads, k_head_dim, v_head_dim])."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def recurrent(self) -> bool:
        return self.kind in RECURRENT_KINDS


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

    def recurrent(self) -> bool:
        """Whether the step carries fixed-size recurrent state (see RECURRENT_KINDS) beside or instead of KV."""
        return any(spec.recurrent for spec in self.state.values())
