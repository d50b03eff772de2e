"""The tensor-parallel pass (Megatron split): one traced step rewritten into rank r's share of it.

What it recognizes, from the graph's structure alone (so every family gets it without family code):
- latent attention (`mla_attention`): the query heads and kv_b's rows of them split as above; the latent
  projection and its cache stay whole on every rank.
- mixture of experts (`moe` over listed experts): every expert's intermediate features split, the router and
  the choice alike on every rank, one `all_reduce` after the moe (a shared expert's down is summed by it too).
- attention blocks: q/k/v linears (through per-head reshape, q/k norms, rope) into `attention`, whose output
  goes through a reshape into one linear. q/k/v become column-parallel (rank r's heads' rows), the output linear
  row-parallel (those heads' columns) followed by one `all_reduce`. Query heads must divide over the ranks
  (a typed refusal naming the count); KV heads split when they divide, else each rank keeps the one KV head its
  query heads read (replicated) when the ranks are a multiple of them.
- gated MLPs: gate and up linears into `gated`, then one down linear: gate/up column-parallel, down row-parallel,
  one `all_reduce`.
- the head: `logits` over a vocabulary slice per rank, the slices joined by one `all_gather` before sampling.
Anything else (embeddings, norms, stacked GGUF experts, recurrent layers, a block whose values have other
readers) is left as it is on every rank: replicated, which is exact too. A bias of a row-parallel linear is
added once, after the sum.

Weights are renamed to their shards (`Shard.name`); `can_split` says whether a stored layout splits there (a
packed layout only along its blocks), else that block stays replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from poot_core.errors import Reason, Unsupported
from poot_core.graph.ir import Graph, Node, StateRef, ValueRef, WeightRef


@dataclass(frozen=True)
class Shard:
    """Rows (axis 0: output features) or columns (axis 1: input features) [start, stop) of a stored weight
    (a bias: axis 0 of a vector)."""

    base: str
    axis: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.base}@{self.axis}:{self.start}:{self.stop}"

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.axis] = self.stop - self.start
        return tuple(out)


Splittable = Callable[[Shard], bool]


def even_slices(total: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's part of `total`, as equal as whole numbers allow."""
    bounds = [total * r // world for r in range(world + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _check_heads(heads: int, world: int, node: Node) -> None:
    if heads % world:
        raise Unsupported(Reason.SHAPE, f"{heads} attention heads over {world} ranks (layer {node.attrs.get('layer')})",
                          "tensor parallelism splits whole heads: give a rank count that divides them, or place the "
                          "model as a pipeline")


class _Pass:
    def __init__(self, graph: Graph, rank: int, world: int, group: str, can_split: Splittable) -> None:
        self.graph, self.rank, self.world, self.group, self.can_split = graph, rank, world, group, can_split
        self.nodes: list[Node] = list(graph.nodes)
        self.made = {n.output: i for i, n in enumerate(self.nodes)}
        self.readers: dict[str, int] = {}
        for n in self.nodes:
            for ref in n.inputs:
                if isinstance(ref, ValueRef):
                    self.readers[ref.name] = self.readers.get(ref.name, 0) + 1
        self.state = dict(graph.state)
        self.after: dict[int, list[Node]] = {}  # collective (and bias) nodes inserted after node i
        self.shards: dict[str, Shard] = {}

    # --- matching ------------------------------------------------------------------------------------------
    def only_reader(self, name: str) -> bool:
        return self.readers.get(name, 0) == 1 and name not in self.graph.outputs

    def producer(self, ref: object, op: str | None = None) -> int | None:
        if not isinstance(ref, ValueRef) or ref.name not in self.made or not self.only_reader(ref.name):
            return None
        i = self.made[ref.name]
        return i if op is None or self.nodes[i].op == op else None

    def plain_linear(self, i: int | None) -> bool:
        if i is None:
            return False
        n = self.nodes[i]
        return (n.op == "linear" and isinstance(n.input(1), WeightRef)
                and (n.input(2) is None or isinstance(n.input(2), WeightRef)))

    def heads_chain(self, ref: object) -> tuple[int, list[int]] | None:
        """(linear, the per-head nodes from the attention input back to the reshape of the linear's output into
        heads, the reshape last) for one attention input. The nodes may branch and join (M-RoPE: the sum over
        sections of rope * the section's mask), as long as every branch ends at that one reshape and no node
        between is read from outside."""
        chain: list[int] = []
        reshape, todo = None, [ref]
        while todo:
            r = todo.pop()
            i = self.made.get(r.name) if isinstance(r, ValueRef) else None
            if i is None:
                return None
            if i in chain or i == reshape:
                continue
            n = self.nodes[i]
            if n.op == "reshape" and len(n.shape) == 4:
                if reshape is not None:
                    return None
                reshape = i
                continue
            if not self._per_head(n):
                return None
            chain.append(i)
            todo.extend(n.inputs[:2] if n.op == "add" else n.inputs[:1])
        if reshape is None:
            return None
        # every value inside is read by the nodes inside alone, and the first (the attention's input) by it too
        first = self.nodes[chain[0] if chain else reshape].output
        for name in {self.nodes[i].output for i in (*chain, reshape)}:
            inside = sum(ValueRef(name) in self.nodes[j].inputs for j in chain) + (name == first)
            if name in self.graph.outputs or self.readers.get(name, 0) != inside:
                return None
        j = self.producer(self.nodes[reshape].inputs[0], "linear")
        return (j, [*chain, reshape]) if self.plain_linear(j) else None

    def _per_head(self, n: Node) -> bool:
        """Whether node n works on each head alone: rope, scale, a norm over the head's features, the sum of two
        such values, or a product with one [head_dim] vector (M-RoPE's section masks)."""
        if len(n.shape) != 4:
            return False
        if n.op in ("rope", "scale", "add"):
            return True
        other = n.input(1)
        width = (n.shape[-1],)
        if n.op == "rms_norm":
            return self.graph.weights.get(getattr(other, "name", "")) == width
        if n.op == "mul" and isinstance(other, ValueRef) and other.name not in self.made:
            spec = self.graph.inputs.get(other.name)
            return spec is not None and tuple(spec.shape) == width
        return False

    def output_linear(self, i: int) -> tuple[int, int] | None:
        """(reshape, linear) that read attention node i's output and nothing else."""
        out = self.nodes[i].output
        r = next((j for j in range(i + 1, len(self.nodes)) if ValueRef(out) in self.nodes[j].inputs), None)
        if r is None or not self.only_reader(out) or self.nodes[r].op != "reshape" or len(self.nodes[r].shape) != 3:
            return None
        name = self.nodes[r].output
        lin = next((j for j in range(r + 1, len(self.nodes)) if ValueRef(name) in self.nodes[j].inputs), None)
        if lin is None or not self.only_reader(name) or not self.plain_linear(lin) or \
                self.nodes[lin].inputs[0] != ValueRef(name):
            return None
        return r, lin

    # --- rewriting -----------------------------------------------------------------------------------------
    def shard(self, ref: object, axis: int, start: int, stop: int) -> WeightRef | None:
        if ref is None:
            return None
        s = Shard(ref.name, axis, start, stop)  # type: ignore[attr-defined]
        self.shards[s.name] = s
        return WeightRef(s.name)

    def splits(self, *parts: tuple[object, int, int, int]) -> bool:
        return all(ref is None or self.can_split(Shard(ref.name, axis, a, b))  # type: ignore[attr-defined]
                   for ref, axis, a, b in parts)

    def column(self, i: int, start: int, stop: int) -> None:
        """Linear i computes only its output features [start, stop)."""
        n = self.nodes[i]
        w, b = self.shard(n.inputs[1], 0, start, stop), self.shard(n.input(2), 0, start, stop)
        self.nodes[i] = replace(n, inputs=(n.inputs[0], w, b), shape=(*n.shape[:-1], stop - start))

    def row(self, i: int, start: int, stop: int) -> None:
        """Linear i reads only its input features [start, stop); the partial sums are added over the ranks,
        then its bias once."""
        n = self.nodes[i]
        partial = f"{n.output}.partial"
        self.nodes[i] = replace(n, inputs=(n.inputs[0], self.shard(n.inputs[1], 1, start, stop), None),
                                output=partial)
        bias = n.input(2)
        summed = n.output if bias is None else f"{n.output}.summed"
        tail = [Node("all_reduce", (ValueRef(partial),), summed, n.shape, {"group": self.group})]
        if bias is not None:
            tail.append(Node("add", (ValueRef(summed), bias), n.output, n.shape, {}))
        self.after[i] = tail

    def with_heads(self, i: int, heads: int) -> None:
        n = self.nodes[i]
        self.nodes[i] = replace(n, shape=(*n.shape[:2], heads, *n.shape[3:]))

    def attention(self, i: int) -> None:
        att = self.nodes[i]
        chains = [self.heads_chain(att.inputs[j]) for j in range(3)]
        out = self.output_linear(i)
        if any(c is None for c in chains) or out is None:
            return
        (q_lin, q_chain), (k_lin, k_chain), (v_lin, v_chain) = chains  # type: ignore[misc]
        heads, kv_heads = att.shape[2], self.nodes[k_chain[0]].shape[2]
        n = self.world
        _check_heads(heads, n, att)
        hq = heads // n
        if kv_heads % n == 0:
            hk, k0 = kv_heads // n, self.rank * (kv_heads // n)
        elif n % kv_heads == 0:  # fewer KV heads than ranks: each rank keeps the one its query heads read
            hk, k0 = 1, self.rank // (n // kv_heads)
        else:
            raise Unsupported(Reason.SHAPE, f"{kv_heads} key/value heads over {n} ranks",
                              "they neither divide over the ranks nor the ranks over them")
        q0 = self.rank * hq
        dq, dk = self.nodes[q_chain[0]].shape[3], self.nodes[k_chain[0]].shape[3]
        dv = self.nodes[v_chain[0]].shape[3]
        reshape, o_lin = out
        plan = [(q_lin, q0 * dq, (q0 + hq) * dq), (k_lin, k0 * dk, (k0 + hk) * dk), (v_lin, k0 * dv, (k0 + hk) * dv)]
        parts = [(self.nodes[j].inputs[k], 0, a, b) for j, a, b in plan for k in (1, 2)]
        if not self.splits(*parts, (self.nodes[o_lin].inputs[1], 1, q0 * dv, (q0 + hq) * dv)):
            return
        for j, a, b in plan:
            self.column(j, a, b)
        for j in q_chain:
            self.with_heads(j, hq)
        for j in (*k_chain, *v_chain):
            self.with_heads(j, hk)
        self.with_heads(i, hq)
        for ref in att.inputs[4:6]:
            if isinstance(ref, StateRef):
                spec = self.state[ref.name]
                self.state[ref.name] = replace(spec, shape=(spec.shape[0], hk, *spec.shape[2:]))
        r = self.nodes[reshape]
        self.nodes[reshape] = replace(r, shape=(*r.shape[:2], hq * dv))
        self.row(o_lin, q0 * dv, (q0 + hq) * dv)

    def mlp(self, i: int) -> None:
        g = self.nodes[i]
        gate, up = self.producer(g.inputs[0], "linear"), self.producer(g.inputs[1], "linear")
        down = next((j for j in range(i + 1, len(self.nodes)) if ValueRef(g.output) in self.nodes[j].inputs), None)
        if not (self.plain_linear(gate) and self.plain_linear(up) and self.plain_linear(down)) or \
                not self.only_reader(g.output) or self.nodes[down].inputs[0] != ValueRef(g.output):  # type: ignore[index]
            return
        width = g.shape[-1]
        if width % self.world:
            return
        a, b = self.rank * width // self.world, (self.rank + 1) * width // self.world
        parts = [(self.nodes[j].inputs[k], 0, a, b) for j in (gate, up) for k in (1, 2)]  # type: ignore[index]
        if not self.splits(*parts, (self.nodes[down].inputs[1], 1, a, b)):  # type: ignore[index]
            return
        self.column(gate, a, b)  # type: ignore[arg-type]
        self.column(up, a, b)  # type: ignore[arg-type]
        self.nodes[i] = replace(g, shape=(*g.shape[:-1], b - a))
        self.row(down, a, b)  # type: ignore[arg-type]

    def mla(self, i: int) -> None:
        """Latent attention: the query heads, kv_b's rows of those heads and the output's columns split; the
        latent (kv_a) and its cache stay whole on every rank."""
        att = self.nodes[i]
        chain, out, kv_b = self.heads_chain(att.inputs[0]), self.output_linear(i), att.inputs[4]
        if chain is None or out is None or not isinstance(kv_b, WeightRef):
            return
        q_lin, q_chain = chain
        heads, n = att.shape[2], self.world
        _check_heads(heads, n, att)
        hq, q0 = heads // n, self.rank * (heads // n)
        dq, a = self.nodes[q_chain[0]].shape[3], att.attrs
        kv_width, dv = a["nope_dim"] + a["v_dim"], a["v_dim"]
        reshape, o_lin = out
        q_rows = (q0 * dq, (q0 + hq) * dq)
        kv_rows = (q0 * kv_width, (q0 + hq) * kv_width)
        if not self.splits(*[(self.nodes[q_lin].inputs[k], 0, *q_rows) for k in (1, 2)], (kv_b, 0, *kv_rows),
                           (self.nodes[o_lin].inputs[1], 1, q0 * dv, (q0 + hq) * dv)):
            return
        self.column(q_lin, *q_rows)
        for j in q_chain:
            self.with_heads(j, hq)
        inputs = list(att.inputs)
        inputs[4] = self.shard(kv_b, 0, *kv_rows)
        self.nodes[i] = replace(att, inputs=tuple(inputs), shape=(*att.shape[:2], hq, *att.shape[3:]))
        r = self.nodes[reshape]
        self.nodes[reshape] = replace(r, shape=(*r.shape[:2], hq * dv))
        self.row(o_lin, q0 * dv, (q0 + hq) * dv)

    def moe(self, i: int) -> None:
        """Listed experts: every expert's intermediate features split (gate/up rows, down columns); each rank
        routes alike and sums its part of every chosen expert, plus its part of the shared expert (whose own sum
        over the ranks is left to the one all_reduce after the moe)."""
        node = self.nodes[i]
        if node.attrs["stacked"]:
            return  # stacked [E, F, D] experts (GGUF): replicated for now
        experts = node.inputs[5:]
        if not all(isinstance(w, WeightRef) for w in experts):
            return
        shared = node.input(3)
        partial = None
        if shared is not None:  # must be a row-parallel down of this pass, read by the moe alone
            down = next((j for j, tail in self.after.items() if len(tail) == 1 and tail[0].output == shared.name),
                        None)
            if down is None or not self.only_reader(shared.name):
                return
            partial = ValueRef(self.nodes[down].output)
        parts = []
        for e in range(0, len(experts), 3):
            gate, up, dn = experts[e:e + 3]
            width = self.graph.weights[gate.name][0]  # type: ignore[union-attr]
            if width % self.world:
                return
            a, b = self.rank * width // self.world, (self.rank + 1) * width // self.world
            parts += [(gate, 0, a, b), (up, 0, a, b), (dn, 1, a, b)]
        if not self.splits(*parts):
            return
        if partial is not None:
            del self.after[down]  # type: ignore[arg-type]
        inputs = list(node.inputs[:5])
        inputs[3] = partial if partial is not None else shared
        inputs += [self.shard(ref, axis, a, b) for ref, axis, a, b in parts]
        summed = f"{node.output}.partial"
        self.nodes[i] = replace(node, inputs=tuple(inputs), output=summed)
        self.after[i] = [Node("all_reduce", (ValueRef(summed),), node.output, node.shape, {"group": self.group})]

    def head(self, i: int) -> None:
        n = self.nodes[i]
        w = n.inputs[1]
        if not isinstance(w, WeightRef):
            return
        slices = even_slices(n.shape[-1], self.world)
        a, b = slices[self.rank]
        if not self.splits((w, 0, a, b)):
            return
        part = f"{n.output}.part"
        self.nodes[i] = replace(n, inputs=(n.inputs[0], self.shard(w, 0, a, b)), output=part,
                                shape=(*n.shape[:-1], b - a))
        self.after[i] = [Node("all_gather", (ValueRef(part),), n.output, n.shape,
                              {"group": self.group, "sizes": [y - x for x, y in slices]})]

    def run(self) -> Graph:
        for i, node in enumerate(list(self.nodes)):
            if node.op in ("attention", "group_attention"):  # the same q, k, v and caches
                self.attention(i)
            elif node.op == "gated":
                self.mlp(i)
            elif node.op == "mla_attention":
                self.mla(i)
            elif node.op == "moe":
                self.moe(i)
            elif node.op == "logits":
                self.head(i)
        nodes = []
        for i, node in enumerate(self.nodes):
            nodes.append(node)
            nodes.extend(self.after.get(i, []))
        out = Graph(self.graph.shape, nodes, dict(self.graph.inputs), {}, self.state, list(self.graph.outputs))
        for node in nodes:
            for ref in node.inputs:
                if isinstance(ref, WeightRef):
                    s = self.shards.get(ref.name)
                    out.weights[ref.name] = s.shape(self.graph.weights[s.base]) if s else self.graph.weights[ref.name]
        return out


def shard(graph: Graph, rank: int, world: int, group: str,
          can_split: Splittable | None = None) -> tuple[Graph, dict[str, Shard]]:
    """Rank `rank` of `world`'s step, and the shards of stored weights it reads (by their new names). Its
    collectives run over the Coordinator whose key is `group`."""
    if world == 1:
        return graph, {}
    p = _Pass(graph, rank, world, group, can_split or (lambda s: True))
    out = p.run()
    return out, {name: s for name, s in p.shards.items() if name in out.weights}


__all__ = ["Shard", "even_slices", "shard"]
