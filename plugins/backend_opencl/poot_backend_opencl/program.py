"""A traced graph -> a prepared OpenCL step: a list of kernels with their arguments bound once.

`OpenCLProgram(...)` checks every node against what the kernels can run (a typed refusal naming the op,
attribute, shape or device limit otherwise), gives each value a device buffer (reusing a buffer once its last
reader has run: poot_core.graph.BufferPool) and turns each node into launches through its op's handler
(`op_<name>`, the dispatch table of the passes). `run` writes the step's ids and positions, enqueues the
launches (replay.py) and returns the outputs as fresh buffers (a later step does not overwrite an output the
caller still holds). The start position is read by the kernels from the positions buffer, so nothing is
rebound between steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from poot_core import (
    Graph,
    Node,
    Reason,
    RequestError,
    Unsupported,
    check_positions,
    inverse_frequencies,
    rope_attention_factor,
)
from poot_core.graph import BufferPool, NodeArgs, passes

from .kernels import ops
from .kernels.launch import Arr, DeviceWeight, Launch, Slot
from .kernels.runtime import Runtime
from .replay import Output, Step
from .upload import DeviceWeights

GATED = ("silu", "gelu_tanh", "gelu", "relu")
ACTIVATIONS = tuple(ops.ACTIVATIONS)
DECODE_SPLIT = 64  # KV positions per work-group of one-token attention
MAX_SPLITS = 64  # a long capacity gets longer splits rather than more of them
PREFILL_SPLITS = 4  # several tokens a step: fewer, longer splits keep the partial results small
MAX_EXPERTS = 256


class OpenCLProgram(NodeArgs):
    backend = "opencl"  # for refusals (NodeArgs)

    def __init__(self, runtime: Runtime, graph: Graph, weights: DeviceWeights) -> None:
        self.rt, self.graph, self.weights = runtime, graph, weights
        shape = graph.shape
        if shape.paging is not None:
            raise Unsupported(Reason.SHAPE, "paged KV", "the opencl backend keeps one contiguous KV buffer a row")
        if shape.rows != 1:
            raise Unsupported(Reason.SHAPE, f"rows={shape.rows}", "the opencl backend runs one sequence per step")
        self.tokens, self.capacity = shape.tokens, shape.capacity
        for name, value in graph.inputs.items():
            if len(value.shape) != 2 or value.shape[0] != 1:
                raise Unsupported(Reason.SHAPE, f"input {name} {value.shape}", "inputs are [1, tokens] ids")
        self.inputs = {name: Arr(runtime.buffer(4 * self.tokens), (self.tokens,), "u32") for name in graph.inputs}
        if "positions" not in self.inputs:
            self.inputs["positions"] = Arr(runtime.buffer(4 * self.tokens), (self.tokens,), "u32")
        self._buffers: BufferPool[Any, Arr] = BufferPool(graph, runtime.buffer, Arr, lambda a: a.buf)
        self._add_norm = set(passes.add_norm_pairs(graph.nodes))
        # fusions of one-token neighbours (poot_core.graph.passes): gate/up + gated, q/k ropes + attention
        self._gated = {g: (gate, up) for gate, up, g in passes.gated_linear_pairs(graph)}
        self._gated_ups = {up for up, _ in self._gated.values()}
        self._rope_triples = {a: (q, k) for q, k, a in passes.rope_attention_triples(graph)}
        self._rope_readers = {r: a for a, qk in self._rope_triples.items() for r in qk}
        self._deferred_ropes: set[str] = set()  # outputs of ropes computed by their attention's rope_qkv
        self._fused_adds: dict[str, tuple[Arr, Arr]] = {}
        self._rope_tables: dict[str, tuple[Arr, float]] = {}
        self._ropes: dict[str, tuple[Node, int]] = {}  # rope output -> (node, index of its launch)
        # the one-token products joined so far: (x's name, node index, [(w, out, bias)], index of their launch)
        self._linear_run: tuple[str, int, list[tuple[DeviceWeight, Arr, Arr | None]], int] | None = None
        launches: list[Launch] = []
        self._launches = launches
        dispatch: passes.Dispatch[list[Launch]] = passes.Dispatch(self, "opencl")
        for index, node in enumerate(graph.nodes):
            self._at = index
            launches.extend(dispatch(node))
            self._buffers.release(index, node)
        self.outputs = [self._buffers.values[name] for name in graph.outputs]
        self.ids: Arr | None = None
        last = graph.nodes[-1] if graph.nodes else None
        if last is not None and last.op == "logits" and graph.outputs == [last.output]:
            logits = self.outputs[0]
            rows = math.prod(logits.shape[:-1])
            self.ids = Arr(runtime.buffer(4 * rows), (rows,), "u32")
            launches.append(ops.argmax(runtime, logits, self.ids, rows, logits.shape[-1]))
        self.step = Step(runtime, launches)

    # -- planning ------------------------------------------------------------------------------------

    def _rows(self, x: Arr, cols: int, node: Node) -> int:
        if x.size % cols:
            raise Unsupported(Reason.SHAPE, f"{node.op} of {x.shape} by {cols} columns", "the sizes do not divide")
        return x.size // cols

    # -- nodes: op X is handled by op_X ---------------------------------------------------------------

    def op_embed(self, node: Node) -> list[Launch]:
        table, ids = self._matrix(node, 0), self._value(node, 1)
        out = self._new(node)
        scale = node.attrs.get("scale")
        return [ops.embed(self.rt, table, ids, out, ids.size, 1.0 if scale is None else float(scale))]

    def op_rms_norm(self, node: Node) -> list[Launch]:
        x, w = self._value(node, 0), self._value(node, 1)
        out = self._new(node)
        width = int(node.shape[-1])
        eps, offset = float(node.attrs["eps"]), float(node.attrs.get("offset") or 0.0)
        tokens = self._rows(x, width, node)
        fused = self._fused_adds.pop(node.inputs[0].name, None)
        if fused is not None:  # x = a + b is computed here and stored to x's buffer for its other readers
            a, b = fused
            return [ops.rms_norm(self.rt, a, w, out, tokens, width, eps, offset, residual=b, sum_out=x)]
        return [ops.rms_norm(self.rt, x, w, out, tokens, width, eps, offset)]

    def op_linear(self, node: Node) -> list[Launch]:
        """A one-token product right after another of the same x (q, k, v; gate, up) joins its launch
        (ops.linear_many, up to three) when only reshapes lie between them. Safe for the buffer pool: a reshape
        keeps its input's buffer alive (an alias), so no buffer is released between the products and the later
        output's buffer is free where the joint launch runs."""
        x, w, b = self._value(node, 0), self._matrix(node, 1), self._optional(node, 2)
        out = self._new(node)
        tokens = self._rows(x, w.cols, node)
        self._keep_gated_input(node)
        run = self._linear_run
        between = self.graph.nodes[run[1] + 1 : self._at] if run is not None else []
        if (tokens == 1 and run is not None and run[0] == node.inputs[0].name
                and all(n.op == "reshape" for n in between)):
            members = [*run[2], (w, out, b)]
            ws = [m[0] for m in members]
            if ops.fusable(self.rt, ws):
                self._launches[run[3]] = ops.linear_many(self.rt, ws, x, [m[1] for m in members],
                                                         [m[2] for m in members])
                self._linear_run = (run[0], self._at, members, run[3]) if len(members) < 3 else None
                return []
        self._linear_run = (node.inputs[0].name, self._at, [(w, out, b)], len(self._launches)) if tokens == 1 else None
        return [ops.linear(self.rt, w, x, out, tokens, bias=b)]

    def _keep_gated_input(self, node: Node) -> None:
        """An up product whose gated node may write act(gate) * up in the gate/up launch: x is read there, so it
        must outlive this node (the gated output may not take its buffer)."""
        if self._at in self._gated_ups:
            self._buffers.read_later([node.inputs[0].name], self._at)

    def op_logits(self, node: Node) -> list[Launch]:
        x, w = self._value(node, 0), self._matrix(node, 1)
        out = self._new(node)
        tokens = self._rows(x, w.cols, node)
        softcap = node.attrs.get("softcap")
        if not softcap:
            return [ops.linear(self.rt, w, x, out, tokens)]
        raw = self._buffers.scratch("raw_logits", tuple(out.shape))
        return [ops.linear(self.rt, w, x, raw, tokens), ops.softcap(self.rt, raw, out, float(softcap))]

    def op_reshape(self, node: Node) -> list[Launch]:
        x = self._value(node, 0)
        if math.prod(node.shape) != x.size:
            raise Unsupported(Reason.SHAPE, f"reshape {x.shape} -> {node.shape}", "the sizes differ")
        self._buffers.define(node.output, x.view(tuple(node.shape)))
        return []

    def _rope_table(self, a: dict[str, Any]) -> tuple[Arr, float]:
        scaling = dict(a.get("scaling") or {})
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
        key = repr((float(a["theta"]), int(a["dim"]), items))
        found = self._rope_tables.get(key)
        if found is None:  # the reference's frequencies (poot_core.rope), YaRN's attention factor beside them
            inv = inverse_frequencies(float(a["theta"]), int(a["dim"]), items)
            table = Arr(self.rt.upload(np.asarray(inv, dtype=np.float32).reshape(-1)), (int(a["dim"]) // 2,))
            found = self._rope_tables[key] = (table, rope_attention_factor(scaling))
        return found

    def op_rope(self, node: Node) -> list[Launch]:
        x, positions = self._value(node, 0), self._value(node, 1)
        if len(node.shape) != 4:
            raise Unsupported(Reason.SHAPE, f"rope of {node.shape}", "rope takes [rows, tokens, heads, head_dim]")
        _, tokens, heads, head_dim = node.shape
        a = node.attrs
        style = a.get("style", "neox")
        if style not in ("neox", "interleaved"):
            raise Unsupported(Reason.OPERATION, f"rope style {style}", "the opencl rope has neox and interleaved")
        if int(a["dim"]) > head_dim or int(a["dim"]) % 2:
            raise Unsupported(Reason.SHAPE, f"rope of {a['dim']} features", f"heads have {head_dim}")
        table, factor = self._rope_table(a)
        out = self._new(node)
        attention = self._rope_readers.get(self._at)
        if attention is not None and head_dim % 2 == 0:  # its attention's rope_qkv computes it
            self._deferred_ropes.add(node.output)
            self._buffers.read_later([node.inputs[0].name], self._at, attention)
            return []
        self._ropes[node.output] = (node, len(self._launches))
        return [ops.rope(self.rt, x, out, positions, table, tokens, heads, head_dim, int(a["dim"]), style == "neox",
                         factor)]

    def op_attention(self, node: Node) -> list[Launch]:
        if node.input(6) is not None:
            raise Unsupported(Reason.SHAPE, "paged attention", "the opencl backend keeps contiguous KV buffers")
        q, k, v, positions = (self._value(node, i) for i in range(4))
        k_name, v_name = node.inputs[4].name, node.inputs[5].name
        spec = self.graph.state.get(k_name)
        if spec is None or v_name not in self.graph.state:
            raise Unsupported(Reason.OPERATION, "attention", "its KV state is not declared by the graph")
        _, kv_heads, capacity, head_dim = spec.shape
        _, tokens, heads, q_dim = q.shape
        if self.graph.state[v_name].shape != spec.shape or q_dim != head_dim or v.shape[-1] != head_dim:
            raise Unsupported(Reason.SHAPE, f"attention q {q.shape}, v {v.shape}",
                              "the opencl attention needs one head size for q, k and v")
        if heads % kv_heads:
            raise Unsupported(Reason.SHAPE, f"attention {heads} heads over {kv_heads}", "it needs whole groups")
        split_len, splits = self._attention_splits(node, head_dim, capacity, tokens)
        a = node.attrs
        scale, window, softcap = float(a["scale"]), int(a.get("window") or 0), float(a.get("softcap") or 0.0)
        width = kv_heads * head_dim
        k_slot, v_slot = Slot(k_name), Slot(v_name)
        fused = self._rope_triples.get(self._at)
        deferred = [self.graph.nodes[i].output in self._deferred_ropes for i in fused or ()]
        if any(deferred) and not all(deferred):
            raise Unsupported(Reason.SHAPE, f"attention q {q.shape}, k {k.shape}", "q and k heads differ in size")
        if fused is not None and all(deferred):
            rq, rk = (self.graph.nodes[i] for i in fused)
            table, factor = self._rope_table(rq.attrs)
            launches = [ops.rope_qkv(self.rt, self._value(rq, 0), q, self._value(rk, 0), k, v, k_slot, v_slot,
                                     positions, table, tokens, heads, kv_heads, head_dim, int(rq.attrs["dim"]),
                                     rq.attrs.get("style", "neox") == "neox", factor)]
            return launches + self._attend(node, q, k_slot, v_slot, positions, tokens, heads, kv_heads, head_dim,
                                           split_len, splits, scale, window, softcap)
        launches = [ops.kv_write(self.rt, v, v_slot, positions, tokens, width)]
        rope = self._ropes.get(node.inputs[1].name)
        if rope is not None and rope[0].inputs[1] == node.inputs[3]:
            # the key's rope writes the rotated keys into the cache itself (rope.cl has_cache)
            rope_node, at = rope
            rx, rpos = self._value(rope_node, 0), self._value(rope_node, 1)
            table, factor = self._rope_table(rope_node.attrs)
            ra = rope_node.attrs
            self._launches[at] = ops.rope(self.rt, rx, k, rpos, table, tokens, kv_heads, head_dim, int(ra["dim"]),
                                          ra.get("style", "neox") == "neox", factor, cache=k_slot)
        else:
            launches.append(ops.kv_write(self.rt, k, k_slot, positions, tokens, width))
        return launches + self._attend(node, q, k_slot, v_slot, positions, tokens, heads, kv_heads, head_dim,
                                       split_len, splits, scale, window, softcap)

    def _attention_splits(self, node: Node, head_dim: int, capacity: int, tokens: int) -> tuple[int, int]:
        """(keys a split, splits) of the attention kernels over `capacity` keys; a head the device's local
        memory cannot hold, or a cache of another capacity than the step's, is refused."""
        group, local_bytes = self.rt.limits.group, self.rt.limits.local_bytes
        dims = ops.attention_dims(self.rt, head_dim)  # the query and two rows of GROUP floats in local memory
        if dims > 8 or 4 * (dims + 2) * group > local_bytes:
            largest = min(8, local_bytes // (4 * group) - 2) * group
            raise Unsupported(Reason.SHAPE, f"{node.op} head size {head_dim}",
                              f"the device's work-groups of {group} and {local_bytes} bytes of local memory "
                              f"hold heads of at most {largest}")
        if capacity != self.capacity:
            raise Unsupported(Reason.SHAPE, f"{node.op} capacity {capacity}", f"the step has {self.capacity}")
        if tokens == 1:
            split_len = max(DECODE_SPLIT, -(-capacity // MAX_SPLITS))
        else:
            split_len = max(DECODE_SPLIT, -(-capacity // PREFILL_SPLITS))
        return split_len, -(-capacity // split_len)

    def _attend(self, node: Node, q: Arr, k_slot: Slot, v_slot: Slot, positions: Arr, tokens: int, heads: int,
                kv_heads: int, head_dim: int, split_len: int, splits: int, scale: float, window: int,
                softcap: float) -> list[Launch]:
        out = self._new(node)
        part = self._buffers.scratch("attention", (tokens, heads, splits, head_dim + 2))
        return ops.attention(self.rt, q, k_slot, v_slot, positions, out, part, tokens, heads, kv_heads, head_dim,
                             split_len, splits, scale, window, softcap)

    def op_mla_attention(self, node: Node) -> list[Launch]:
        """Latent attention with kv_b absorbed (cl/mla.cl): the step's normed latent rows and rotated rope keys
        into the latent cache; each head's query into the cache's space; the attention kernels with one KV head
        whose keys and values are the cache rows; the weighted latent through kv_b's value rows. The arithmetic
        of the CPU executor's dense kv_b (poot_core.cpu.mla), a 16-bit kv_b's products rounded as there. A
        packed kv_b takes the CPU's expanded form (ops.mla_expanded)."""
        if node.input(6) is not None:
            raise Unsupported(Reason.SHAPE, "paged mla_attention", "the opencl backend keeps contiguous caches")
        a = node.attrs
        style = a["style"]
        if style not in ("neox", "interleaved"):
            raise Unsupported(Reason.OPERATION, f"rope style {style}", "the opencl rope has neox and interleaved")
        q, kv, positions, norm_w = (self._value(node, i) for i in range(4))
        kv_b = self._matrix(node, 4)
        cache_name = node.inputs[5].name
        spec = self.graph.state.get(cache_name)
        if spec is None:
            raise Unsupported(Reason.OPERATION, "mla_attention", "its latent state is not declared by the graph")
        _, _, capacity, width = spec.shape
        _, tokens, heads, _ = q.shape
        nope, rope_dim, v_dim = int(a["nope_dim"]), int(a["rope_dim"]), int(a["v_dim"])
        latent = width - rope_dim
        if (kv.shape[-1] != width or q.shape[-1] != nope + rope_dim or kv_b.cols != latent
                or kv_b.rows != heads * (nope + v_dim) or rope_dim % 2):
            raise Unsupported(Reason.SHAPE, f"mla_attention q {q.shape}, kv {kv.shape}, kv_b {kv_b.rows}x"
                              f"{kv_b.cols}", f"the latent cache rows are {width} wide")
        table, factor = self._rope_table({"theta": a["theta"], "dim": rope_dim, "scaling": a.get("scaling")})
        neox, slot, rt = style == "neox", Slot(cache_name), self.rt
        if kv_b.fmt not in ops.DENSE_FORMATS:  # packed blocks: the cached latent expanded each step
            hd = max(nope + rope_dim, v_dim)
            split_len, splits = self._attention_splits(node, hd, capacity, tokens)
            shapes = {"rows": (capacity, latent), "expanded": (capacity, kv_b.rows),
                      "keys": (capacity, heads, hd), "values": (capacity, heads, hd), "query": (tokens, heads, hd),
                      "o": (tokens, heads, hd), "part": (tokens, heads, splits, hd + 2)}
            scratch = {k: self._buffers.scratch(f"mla_{k}", shape) for k, shape in shapes.items()}
            return [ops.mla_cache(rt, kv, norm_w, slot, positions, table, tokens, latent, rope_dim, float(a["eps"]),
                                  neox, factor),
                    *ops.mla_expanded(rt, q, kv_b, slot, positions, table, scratch, self._new(node), tokens, capacity,
                                      heads, nope, rope_dim, v_dim, latent, hd, neox, factor, split_len, splits,
                                      float(a["scale"]))]
        split_len, splits = self._attention_splits(node, width, capacity, tokens)
        query = self._buffers.scratch("mla_query", (tokens, heads, width))
        weighted = self._buffers.scratch("mla_weighted", (tokens, heads, width))
        part = self._buffers.scratch("attention", (tokens, heads, splits, width + 2))
        out = self._new(node)
        return [
            ops.mla_cache(rt, kv, norm_w, slot, positions, table, tokens, latent, rope_dim, float(a["eps"]), neox,
                          factor),
            ops.mla_query(rt, q, kv_b, query, positions, table, tokens, heads, nope, rope_dim, v_dim, latent, neox,
                          factor),
            *ops.attention(rt, query, slot, slot, positions, weighted, part, tokens, heads, 1, width, split_len,
                           splits, float(a["scale"]), 0, 0.0),
            ops.mla_out(rt, weighted, kv_b, out, tokens, heads, nope, v_dim, latent, width),
        ]

    def op_gated(self, node: Node) -> list[Launch]:
        act = node.attrs.get("act", "silu")
        if act not in GATED:
            raise Unsupported(Reason.OPERATION, f"gated {act}", f"the opencl kernels have {', '.join(GATED)}")
        gate, up = self._value(node, 0), self._value(node, 1)
        out = self._new(node)
        pair, run = self._gated.get(self._at), self._linear_run
        if pair is not None and run is not None and run[1] == pair[1] and len(run[2]) == 2:
            (w_gate, gate_out, gate_bias), (w_up, up_out, up_bias) = run[2]
            if (gate_out is gate and up_out is up and gate_bias is None and up_bias is None
                    and ops.gated_fusable(self.rt, w_gate, w_up)):
                # the gate/up launch writes act(gate) * up itself (passes.gated_linear_pairs)
                self._launches[run[3]] = ops.linear_gated(self.rt, w_gate, w_up, self._value(self.graph.nodes[
                    pair[1]], 0), out, act)
                self._linear_run = None
                return []
        return [ops.gated(self.rt, gate, up, out, act)]

    def op_activation(self, node: Node) -> list[Launch]:
        act = node.attrs.get("act")
        if act not in ACTIVATIONS:
            raise Unsupported(Reason.OPERATION, f"activation {act}",
                              f"the opencl kernels have {', '.join(ACTIVATIONS)}")
        return [ops.activation(self.rt, self._value(node, 0), self._new(node), act)]

    def _binary(self, node: Node) -> list[Launch]:
        a, b = self._value(node, 0), self._value(node, 1)
        if a.size != b.size:
            raise Unsupported(Reason.SHAPE, f"{node.op} of {a.shape} and {b.shape}",
                              "the opencl backend adds and multiplies equal shapes only")
        return [ops.binary(self.rt, node.op, a, b, self._new(node))]

    def op_add(self, node: Node) -> list[Launch]:
        a, b = self._value(node, 0), self._value(node, 1)
        if self._at in self._add_norm and a.size == b.size:  # the next node, an rms_norm, computes the sum
            self._new(node)
            self._fused_adds[node.output] = (a, b)
            self._buffers.read_later((r.name for r in node.inputs[:2]), self._at)  # read by the norm too
            return []
        return self._binary(node)

    def op_mul(self, node: Node) -> list[Launch]:
        return self._binary(node)

    def op_scale(self, node: Node) -> list[Launch]:
        return [ops.scale(self.rt, self._value(node, 0), self._new(node), float(node.attrs["factor"]))]

    def op_last_position(self, node: Node) -> list[Launch]:
        if node.input(1) is not None:
            raise Unsupported(Reason.SHAPE, "last_position by slot", "paged steps are not run by opencl")
        x = self._value(node, 0)
        width = x.shape[-1]
        if self.tokens == 1 and x.size == width:  # the only position: the same values
            self._buffers.define(node.output, x.view(tuple(node.shape)))
            return []
        return [ops.copy(self.rt, x, self._new(node), width, (self.tokens - 1) * width)]

    def _expert_matrices(self, node: Node, count: int) -> list[tuple[DeviceWeight, ...]]:
        if not node.attrs["stacked"]:
            return [tuple(self._matrix(node, 5 + 3 * e + j) for j in range(3)) for e in range(count)]
        stacks = []
        for j in range(3):
            ref = node.inputs[5 + j]
            found = self.weights.stacks.get(ref.name) if ref is not None else None
            if found is None or found[0] != count:
                self._missing(node, str(ref), f"a stack of {count} experts")
            stacks.append(found[1])
        per = [s.rows // count for s in stacks]
        return [tuple(s.rows_of(e * p, p) for s, p in zip(stacks, per, strict=True)) for e in range(count)]

    def op_moe(self, node: Node) -> list[Launch]:
        """Routing on the device (poot_core.moe.choose_experts' rule into a dense row of weights per token), then
        each expert's gated MLP over the step's tokens, added in with its weight. A tile of tokens none of which
        chose an expert skips that expert's products (cl/linear.cl gate), so a decode step reads only the
        chosen experts' weights."""
        a = node.attrs
        if a["scoring"] not in ("softmax", "sigmoid") or a.get("group_score", "max") not in ("max", "top2"):
            raise Unsupported(Reason.OPERATION, f"moe routing {a['scoring']}/{a.get('group_score')}",
                              "the opencl backend routes by softmax or sigmoid scores, groups by max or top2")
        if a["act"] not in GATED:
            raise Unsupported(Reason.OPERATION, f"moe {a['act']}", f"the opencl kernels have {', '.join(GATED)}")
        count = int(a["experts"])
        groups = int(a.get("groups") or 1)
        if count > MAX_EXPERTS or count % groups:
            raise Unsupported(Reason.SHAPE, f"moe with {count} experts in {groups} groups",
                              f"the opencl router takes up to {MAX_EXPERTS} experts in equal groups")
        x, router = self._value(node, 0), self._matrix(node, 1)
        bias = self._optional(node, 2)
        shared = self._optional(node, 3)
        shared_gate = self._matrix(node, 4) if node.inputs[4] else None
        experts = self._expert_matrices(node, count)
        width, inter = router.cols, experts[0][0].rows
        tokens = self._rows(x, width, node)
        out = self._new(node)
        scratch = self._buffers.scratch
        logits, weights = scratch("logits", (tokens, count)), scratch("weights", (tokens, count))
        gate, up = scratch("gate", (tokens, inter)), scratch("up", (tokens, inter))
        h, y = scratch("h", (tokens, inter)), scratch("y", (tokens, width))
        rt = self.rt
        launches = [ops.linear(rt, router, x, logits, tokens),
                    ops.moe_route(rt, logits, bias, weights, tokens, count, a)]
        for e, (w_gate, w_up, w_down) in enumerate(experts):
            chosen = (weights, count, e)
            if tokens == 1 and ops.gated_fusable(rt, w_gate, w_up):  # one launch for gate, up and the activation
                launches.append(ops.linear_gated(rt, w_gate, w_up, x, h, a["act"], chosen=(weights, e)))
            else:
                launches += [ops.linear(rt, w_gate, x, gate, tokens, gate=chosen),
                             ops.linear(rt, w_up, x, up, tokens, gate=chosen),
                             ops.gated(rt, gate, up, h, a["act"])]
            launches += [
                ops.linear(rt, w_down, h, y, tokens, gate=chosen),
                ops.moe_accumulate(rt, weights, count, e, y, out, width, tokens, ops.ASSIGN if e == 0 else ops.ADD),
            ]
        if shared is not None and shared_gate is not None:
            sw = scratch("shared_gate", (tokens, 1))
            launches += [ops.linear(rt, shared_gate, x, sw, tokens),
                         ops.moe_accumulate(rt, sw, 1, 0, shared, out, width, tokens, ops.SIGMOID)]
        elif shared is not None:
            launches.append(ops.moe_accumulate(rt, shared, 0, 0, shared, out, width, tokens, ops.UNIT))
        return launches

    # -- running -------------------------------------------------------------------------------------

    def run(self, state: dict[str, Any], inputs: dict[str, np.ndarray]) -> list[Output]:
        check_positions(self.graph, inputs)  # a RequestError, as on every backend, before anything is written
        self._write_inputs(inputs)
        return self.step.run(state, self.outputs, self.ids)

    def _write_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        positions = np.asarray(inputs.get("positions", np.zeros((1, self.tokens), dtype=np.int64)))
        if positions.shape != (1, self.tokens):
            raise RequestError(f"positions have shape {positions.shape}, the step takes (1, {self.tokens})")
        start = int(positions[0, 0])
        if np.any(positions[0] != start + np.arange(self.tokens)):
            raise RequestError("positions must be consecutive within a step")
        for name, target in self.inputs.items():
            if name not in inputs and name != "positions":
                raise RequestError(f"the step needs input {name!r}")
            host = np.asarray(inputs[name]) if name in inputs else positions
            if host.shape != (1, self.tokens):
                raise RequestError(f"input {name!r} has shape {host.shape}, the step takes (1, {self.tokens})")
            if host.min() < 0 or host.max() > np.iinfo(np.uint32).max:
                raise RequestError(f"input {name!r} holds values outside 0..2^32-1")
            self.rt.write(target.buf, host.reshape(-1).astype(np.uint32))


OPENCL_OPS = passes.handled_ops(OpenCLProgram)  # the vocabulary ops it has an op_<name> handler for
