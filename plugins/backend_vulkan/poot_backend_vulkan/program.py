"""A traced graph -> a recorded Vulkan step.

`VulkanProgram(...)` checks every node against what the kernels can run (a typed refusal naming the op,
attribute or shape otherwise), gives each value a device buffer (reusing a buffer once its last reader has
run: poot_core.graph.BufferPool), turns each node into an emitter through its op's handler
(`op_<name>`, the dispatch table of the passes), and records the step (replay.py). `run` writes the step's
token ids and positions, replays, and returns the outputs as fresh device buffers (a later step does not
overwrite an output the caller still holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from poot_core import (
    Graph,
    Node,
    Reason,
    RequestError,
    Unsupported,
    WeightRef,
    check_positions,
    rope_attention_factor,
)
from poot_core.graph import BufferPool, NodeArgs, passes

from .kernels import attention as attn
from .kernels import elementwise as ew
from .kernels import linear as lin
from .kernels import moe as moe_kernels
from .kernels import norms, positional
from .kernels.runtime import DeviceArray, Runtime, grid_1d, pack_params, shader_source
from .kernels.weights import DeviceWeight, ExpertStack, row_range
from .replay import Emitter, RecordedStep, Recorder, Slot
from .upload import DeviceWeights

GATED = ("silu", "gelu_tanh")
ACTIVATIONS = ("silu", "gelu_tanh", "relu")
DECODE_SPLIT = 32  # KV positions per workgroup of split-K decode attention (each thread of it takes a key)
MAX_SPLITS = 64  # a long capacity gets longer splits rather than more of them


@dataclass
class Output:
    """One output of a step, in its own device buffer. `ids` (u32, one per position) holds the argmax of
    each logits row when the output is logits, so greedy decoding reads back 4 bytes."""

    runtime: Runtime
    buffer: Any
    shape: tuple[int, ...]
    ids: Any | None = None


def copy_values(batch: Any, src: DeviceArray, dst: DeviceArray, count: int, src_offset: int = 0) -> None:
    """dst[:count] = src[src_offset : src_offset + count] (copy.wgsl)."""
    pipeline = batch.runtime.pipeline("copy", shader_source("copy"))
    batch.dispatch(pipeline, [src.buffer, dst.buffer], pack_params(count, src_offset, 0), grid_1d(-(-count // 64)))


def _view(array: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
    return DeviceArray(array.buffer, tuple(shape), array.dtype)


class VulkanProgram(NodeArgs):
    backend = "vulkan"  # for refusals (NodeArgs)

    def __init__(self, runtime: Runtime, graph: Graph, weights: DeviceWeights) -> None:
        self.runtime = runtime
        self.graph = graph
        self.weights = weights
        shape = graph.shape
        if shape.paging is not None:  # the batched engine checks capabilities().layouts first; a direct prepare too
            raise Unsupported(Reason.SHAPE, "paged KV layout (Layout.PAGED)",
                              "the vulkan backend runs contiguous KV caches only; use Layout.CONTIGUOUS")
        if shape.rows != 1:
            raise Unsupported(Reason.SHAPE, f"rows={shape.rows}", "the vulkan backend runs one sequence per step")
        self.tokens = shape.tokens
        self.capacity = shape.capacity
        for name, value in graph.inputs.items():
            if len(value.shape) != 2 or value.shape[0] != 1:
                raise Unsupported(Reason.SHAPE, f"input {name} {value.shape}", "inputs are [1, tokens] ids")
        self.inputs = {name: runtime.empty(self.tokens, "u32") for name in graph.inputs}
        self._buffers: BufferPool[Any, DeviceArray] = BufferPool(graph, runtime.raw_buffer, DeviceArray,
                                                                 lambda a: a.buffer)
        self._add_norm = set(passes.add_norm_pairs(graph.nodes))
        self._shared_input = {i: group for group in passes.shared_input_linears(graph.nodes) for i in group}
        self._rope_tables: dict[tuple[Any, ...], tuple[DeviceArray, float]] = {}
        # q and k ropes that only their attention reads run inside it (positional.rope_kv): rope index ->
        # attention index, and rope output -> (input, positions, table, factor, style) until the attention
        self._rope_into = {r: i for q, k, i in passes.rope_attention_triples(graph) for r in (q, k)}
        self._ropes: dict[str, tuple[DeviceArray, DeviceArray, DeviceArray, float, str, Any]] = {}
        # an add whose sum feeds the next node's rms_norm runs inside that norm (rms_norm.wgsl FUSED):
        # sum name -> (a, b), with a and b kept alive until the norm has read them
        self._fused_adds: dict[str, tuple[DeviceArray, DeviceArray, int]] = {}
        # a one-token product whose only reader is such an add leaves its split-K partial sums for the norm
        # to add (no combine dispatch): linear output -> splits
        self._partials: dict[str, int] = {}
        self._readers = passes.readers(graph.nodes, graph.outputs)
        # a one-token q/k/v product read only by a fused rope_kv leaves its partial sums for it: q, k and v (and
        # their reshapes) -> (splits, values a split, offset of the part)
        self._parts: dict[str, tuple[int, int, int]] = {}
        self._filled: set[str] = set()  # linear outputs written by an earlier concatenated matmul
        # a one-token gate/up product whose two parts only a gated activation reads writes act(gate) * up
        # itself: gate linear index -> (up linear index, gated index)
        self._gated = {g: (u, i) for g, u, i in passes.gated_linear_pairs(graph)}
        dispatch: passes.Dispatch[Emitter | None] = passes.Dispatch(self, "vulkan")
        emitters: list[Emitter] = []
        for index, node in enumerate(graph.nodes):
            self._at = index
            emitter = dispatch(node)
            if emitter is not None:
                emitters.append(emitter)
            self._buffers.release(index, node)
        self.outputs = [self._buffers.values[name] for name in graph.outputs]
        self.ids: DeviceArray | None = None
        last = graph.nodes[-1] if graph.nodes else None
        if last is not None and last.op == "logits" and graph.outputs == [last.output]:
            logits = self.outputs[0]
            self.ids = runtime.empty(math.prod(logits.shape[:-1]), "u32")
            ids = self.ids
            emitters.append(lambda rec, start: ew.argmax(rec, _view(logits, (ids.size, logits.shape[-1])), ids))
        starts = (0, 1) if self.tokens < self.capacity else (0, 0)
        room = self.capacity - self.tokens
        self.step = RecordedStep(runtime, emitters, starts, room if room >= 2 else None)
        # a one-token step's next command buffer, encoded while the device runs this one (see run)
        self._next: Any | None = None

    # -- planning ------------------------------------------------------------------------------------

    # -- nodes: op X is handled by op_X ------------------------------------------------------------------

    def op_embed(self, node: Node) -> Emitter:
        table, ids = self._matrix(node, 0), self._value(node, 1)
        out = self._new(node)
        scale = node.attrs.get("scale")
        scale = 1.0 if scale is None else float(scale)
        flat = _view(out, (ids.size, table.cols))
        return lambda rec, start: lin.embed(rec, table, ids, flat, scale)

    def op_rms_norm(self, node: Node) -> Emitter:
        x, w = self._value(node, 0), self._value(node, 1)
        out = self._new(node)
        eps, offset = float(node.attrs["eps"]), float(node.attrs.get("offset") or 0.0)
        fused = self._fused_adds.pop(node.inputs[0].name, None)
        if fused is not None:  # x = a + b is computed here and stored to x's buffer for its other readers
            a, b, splits = fused
            return lambda rec, start: norms.rms_norm(
                rec, a, w, out, eps=eps, weight_offset=offset, residual=b, residual_out=x, residual_splits=splits
            )
        return lambda rec, start: norms.rms_norm(rec, x, w, out, eps=eps, weight_offset=offset)

    def op_layer_norm(self, node: Node) -> Emitter:
        x, w, b = self._value(node, 0), self._value(node, 1), self._optional(node, 2)
        out = self._new(node)
        eps = float(node.attrs["eps"])
        return lambda rec, start: norms.layer_norm(rec, x, w, out, eps=eps, bias=b)

    def op_linear(self, node: Node) -> Emitter | None:
        if node.output in self._filled:  # computed by the concatenated matmul of an earlier node
            return None
        x, w, b = self._value(node, 0), self._matrix(node, 1), self._optional(node, 2)
        group = None if b is not None else self._concatenated_partners(node)
        flat_x = _view(x, (x.size // w.cols, w.cols))
        gated = self._gated_by(node, group)
        if group is not None and gated is not None:  # act(gate) * up written by the product; neither is stored
            whole, (up,) = group
            act_node = self.graph.nodes[self._gated[self._at][1]]
            self._filled.update((up.output, act_node.output))
            array = self._buffers.new(act_node.output, tuple(act_node.shape))
            gated_out = _view(array, (1, array.size))
            return lambda rec, start: lin.gemv(rec, flat_x, whole, gated_out, gated=gated)
        splits = self._splits_for_norm(node, w) if group is None and b is None else 1
        if splits > 1:  # [splits, rows] partial sums, added by the norm after the add that reads them
            array = self._buffers.define(node.output, _view(self._buffers.take((splits, w.rows)), tuple(node.shape)))
            self._partials[node.output] = splits
            partial_out = _view(array, (1, w.rows))
            return lambda rec, start: lin.gemv(rec, flat_x, w, partial_out, splits=splits, partials=True)
        if group is not None and (qkv_splits := self._splits_for_rope(node, *group)) > 1:
            whole, partners = group  # q, k and v: views of one buffer of [splits, rows] partial sums
            buffer, offset = self._buffers.take((qkv_splits, whole.rows)), 0
            for part in (node, *partners):
                self._buffers.define(part.output, _view(buffer, tuple(part.shape)))
                self._parts[part.output] = (qkv_splits, whole.rows, offset)
                offset += math.prod(part.shape)
            self._filled.update(p.output for p in partners)
            qkv_out = _view(buffer, (1, whole.rows))
            return lambda rec, start: lin.gemv(rec, flat_x, whole, qkv_out, splits=qkv_splits, partials=True)
        out = self._new(node)
        flat_out = _view(out, (x.size // w.cols, w.rows))
        if group is None:
            return lambda rec, start: lin.linear(rec, flat_x, w, flat_out, bias=b)
        whole, partners = group
        outs = [flat_out]
        for later in partners:  # their outputs exist from here on: this dispatch writes them
            array = self._buffers.new(later.output, tuple(later.shape))
            outs.append(_view(array, (1, array.size)))
            self._filled.add(later.output)
        return lambda rec, start: lin.gemv(rec, flat_x, whole, outs)

    def _splits_for_rope(self, node: Node, whole: DeviceWeight, partners: list[Node]) -> int:
        """The split-K count of a one-token q/k/v product (this node q, partners k and v) whose parts, through
        reshapes, only one fused rope_kv reads: q and k by the ropes of an attention that reads v
        (passes.rope_attention_triples); 1 otherwise (the product then sums its own splits)."""
        if self.tokens != 1 or len(partners) != 2:
            return 1
        ends = []
        for name in (node.output, *(p.output for p in partners)):
            readers = self._readers.get(name, [])
            while len(readers) == 1 and self.graph.nodes[readers[0]].op == "reshape":
                name = self.graph.nodes[readers[0]].output
                readers = self._readers.get(name, [])
            if len(readers) != 1:
                return 1
            ends.append((name, readers[0]))
        (q, q_rope), (k, k_rope), (v, attention) = ends
        nodes = self.graph.nodes
        if (self._rope_into.get(q_rope) != attention or self._rope_into.get(k_rope) != attention
                or [r.name for r in nodes[attention].inputs[:3]] != [nodes[q_rope].output, nodes[k_rope].output, v]
                or nodes[q_rope].inputs[0].name != q or nodes[k_rope].inputs[0].name != k):
            return 1
        return lin.gemv_splits(self.runtime, whole)

    def _splits_for_norm(self, node: Node, w: DeviceWeight) -> int:
        """The split-K count of a one-token product whose only reader is a residual add that the next node's
        rms_norm computes (passes.add_norm_pairs) with 16-byte rows, the add's other input already computed;
        1 otherwise (the product then sums its own splits)."""
        readers = self._readers.get(node.output, [])
        if self.tokens != 1 or len(readers) != 1 or readers[0] not in self._add_norm or not lin.has_gemv(w):
            return 1
        add = self.graph.nodes[readers[0]]
        other = next((r for r in add.inputs[:2] if r.name != node.output), None)
        found = None if other is None else self._buffers.values.get(other.name)
        norm_w = self.graph.nodes[readers[0] + 1].input(1)
        width = self.weights.vectors.get(norm_w.name) if isinstance(norm_w, WeightRef) else None
        if found is None or found.size != math.prod(node.shape) or width is None or width.size % 4:
            return 1
        return lin.gemv_splits(self.runtime, w)

    def _gated_by(self, node: Node, group: tuple[DeviceWeight, list[Node]] | None) -> str | None:
        """The activation when this linear is the gate of a gate/up concatenation whose two products only a
        gated node reads (passes.gated_linear_pairs) and gemv can apply it; else None."""
        pair = self._gated.get(self._at)
        if group is None or pair is None:
            return None
        whole, partners = group
        up, act_node = (self.graph.nodes[i] for i in pair)
        act = act_node.attrs.get("act", "silu")
        if [n.output for n in partners] != [up.output] or act not in lin.GATED_ACTS or len(whole.chunks) > 1:
            return None
        return str(act)

    def _concatenated_partners(self, node: Node) -> tuple[DeviceWeight, list[Node]] | None:
        """For a one-token linear on the first part of an uploaded concatenation (q of q/k/v, gate of
        gate/up): the concatenation and the later linear nodes of its shared-input group
        (passes.shared_input_linears) that read the other parts, when every part is there; else None (each
        part then runs alone, as a row range)."""
        weight = passes.linear_weight(node)
        if self.tokens != 1 or weight is None:
            return None
        found = self.weights.concatenation_of(weight)
        if found is None:
            return None
        names, whole = found
        if weight != names[0] or not lin.has_gemv(whole):
            return None
        partners: dict[str, Node] = {}
        for at in self._shared_input.get(self._at, ()):
            later = self.graph.nodes[at]
            part = passes.linear_weight(later)
            if at > self._at and part in names[1:]:
                partners.setdefault(str(part), later)
        if len(partners) != len(names) - 1:
            return None
        return whole, [partners[name] for name in names[1:]]

    def op_logits(self, node: Node) -> Emitter:
        x, w = self._value(node, 0), self._matrix(node, 1)
        out = self._new(node)
        flat_x, flat_out = _view(x, (x.size // w.cols, w.cols)), _view(out, (x.size // w.cols, w.rows))
        softcap = node.attrs.get("softcap")
        if not softcap:
            return lambda rec, start: lin.linear(rec, flat_x, w, flat_out)
        raw = self._buffers.take(flat_out.shape)  # the uncapped logits, a buffer of their own

        def emit(rec: Recorder, start: int) -> None:
            lin.linear(rec, flat_x, w, raw)
            ew.unary(rec, "softcap", raw, flat_out, float(softcap))

        return emit

    def op_reshape(self, node: Node) -> None:
        x = self._value(node, 0)
        if math.prod(node.shape) != x.size:
            raise Unsupported(Reason.SHAPE, f"reshape {x.shape} -> {node.shape}", "the sizes differ")
        self._buffers.define(node.output, _view(x, tuple(node.shape)))
        if node.inputs[0].name in self._parts:
            self._parts[node.output] = self._parts[node.inputs[0].name]
        return None

    def op_rope(self, node: Node) -> Emitter | None:
        x, positions = self._value(node, 0), self._value(node, 1)
        if len(node.shape) != 4:
            raise Unsupported(Reason.SHAPE, f"rope of {node.shape}", "rope takes [rows, tokens, heads, head_dim]")
        _, tokens, heads, head_dim = node.shape
        a = node.attrs
        style = a.get("style", "neox")
        if style not in ("neox", "interleaved"):
            raise Unsupported(Reason.OPERATION, f"rope style {style}", "the vulkan rope has neox and interleaved")
        scaling = dict(a.get("scaling") or {})
        key = (float(a["theta"]), int(a["dim"]), repr(sorted(scaling.items())))
        found = self._rope_tables.get(key)
        if found is None:  # the reference's frequencies (poot_core.rope), YaRN's attention factor beside them
            inv = positional.rope_inv_freq(int(a["dim"]), float(a["theta"]), scaling)
            found = self._rope_tables[key] = (self.runtime.upload(inv), rope_attention_factor(scaling))
        table, factor = found
        attention = self._rope_into.get(self._at)
        if attention is not None:  # the attention's rope_kv dispatch rotates it (passes.rope_attention_triples)
            self._ropes[node.output] = (_view(x, (tokens, heads, head_dim)), positions, table, factor, style,
                                        self._parts.get(node.inputs[0].name))
            self._buffers.read_later([node.inputs[0].name], self._at, attention)
            return None
        # Rotate in place when this rope is the last reader of the input's buffer; otherwise rotate a copy.
        x_name = node.inputs[0].name
        in_place = self._buffers.last_reader(x_name, self._at)
        if in_place:
            out = self._buffers.define(node.output, _view(x, tuple(node.shape)))
        else:
            out = self._new(node)
        rotated = _view(out, (tokens, heads, head_dim))

        def emit(rec: Recorder, start: int) -> None:
            if not in_place:
                copy_values(rec, x, out, x.size)
            positional.rope(rec, rotated, positions, table, heads=heads, head_dim=head_dim, style=style,
                            factor=factor)

        return emit

    def op_attention(self, node: Node) -> Emitter:
        q_rope, k_rope = (self._ropes.pop(str(r.name), None) for r in node.inputs[:2])
        fused = q_rope is not None and k_rope is not None
        if fused:  # q and k before their ropes; the rotated q goes to a buffer of its own
            q, k = (_view(r[0], (1, *r[0].shape)) for r in (q_rope, k_rope))
        else:
            q, k = self._value(node, 0), self._value(node, 1)
        v = self._value(node, 2)
        k_name, v_name = node.inputs[4].name, node.inputs[5].name
        spec = self.graph.state.get(k_name)
        if spec is None or v_name not in self.graph.state:
            raise Unsupported(Reason.OPERATION, "attention", "its KV state is not declared by the graph")
        _, kv_heads, capacity, head_dim = spec.shape
        _, tokens, heads, q_dim = q.shape
        if self.graph.state[v_name].shape != spec.shape or q_dim != head_dim or v.shape[-1] != head_dim:
            raise Unsupported(
                Reason.SHAPE,
                f"attention q {q.shape}, v {v.shape}",
                "the vulkan attention needs one head size for q, k and v",
            )
        if head_dim > attn.MAX_HEAD_DIM or heads % kv_heads:
            raise Unsupported(
                Reason.SHAPE,
                f"attention {heads} heads over {kv_heads} of size {head_dim}",
                f"the vulkan attention needs head size <= {attn.MAX_HEAD_DIM} and whole groups",
            )
        if capacity != self.capacity:
            raise Unsupported(Reason.SHAPE, f"attention capacity {capacity}", f"the step has {self.capacity}")
        cache_shape = (capacity, kv_heads, head_dim)
        k_cache = DeviceArray(Slot(k_name), cache_shape)
        v_cache = DeviceArray(Slot(v_name), cache_shape)
        k_new, v_new = _view(k, (tokens, kv_heads, head_dim)), _view(v, (tokens, kv_heads, head_dim))
        q_flat = _view(q, (tokens, heads, head_dim))
        out = self._new(node)
        out_flat = _view(out, (tokens, heads, head_dim))
        a = node.attrs
        scale, window, softcap = float(a["scale"]), int(a.get("window") or 0), float(a.get("softcap") or 0.0)
        split_len = max(DECODE_SPLIT, -(-capacity // MAX_SPLITS))
        splits = -(-capacity // split_len)

        parts = None
        if fused:
            q_in, q_flat = q_flat, _view(self._buffers.scratch("rope_q", q_flat.shape), q_flat.shape)
            _, positions, table, factor, style, q_part = q_rope
            found = [q_part, k_rope[5], self._parts.get(node.inputs[2].name)]
            if all(found):  # one buffer of the q/k/v product's partial sums (op_linear checked the readers)
                parts = (found[0][0], found[0][1], tuple(f[2] for f in found))

        def emit(rec: Recorder, start: int) -> None:
            if fused:
                positional.rope_kv(rec, q_in, k_new, v_new, q_flat, k_cache, v_cache, positions, table, start,
                                   style=style, factor=factor, partials=parts)
            else:
                positional.kv_write(rec, k_new, k_cache, start)
                positional.kv_write(rec, v_new, v_cache, start)
            if tokens == 1:
                attn.attention_decode(
                    rec,
                    q_flat,
                    k_cache,
                    v_cache,
                    out_flat,
                    position=start,
                    scale=scale,
                    window=window,
                    softcap=softcap,
                    split_len=split_len,
                    splits=splits,
                )
            else:
                attn.attention_prefill(
                    rec, q_flat, k_cache, v_cache, out_flat, start=start, scale=scale, window=window, softcap=softcap
                )

        return emit

    def op_gated(self, node: Node) -> Emitter | None:
        if node.output in self._filled:  # computed by the gate/up product (op_linear)
            return None
        act = node.attrs.get("act", "silu")
        if act not in GATED:
            raise Unsupported(Reason.OPERATION, f"gated {act}", f"the vulkan kernels have {', '.join(GATED)}")
        gate, up = self._value(node, 0), self._value(node, 1)
        out = self._new(node)
        return lambda rec, start: ew.gated_activation(rec, gate, up, out, act)

    def op_activation(self, node: Node) -> Emitter:
        act = node.attrs.get("act")
        if act not in ACTIVATIONS:
            raise Unsupported(
                Reason.OPERATION, f"activation {act}", f"the vulkan kernels have {', '.join(ACTIVATIONS)}"
            )
        x = self._value(node, 0)
        out = self._new(node)
        return lambda rec, start: ew.unary(rec, act, x, out)

    def _binary(self, node: Node, kernel: Callable[..., None]) -> Emitter:
        a, b = self._value(node, 0), self._value(node, 1)
        if a.size != b.size:
            raise Unsupported(
                Reason.SHAPE,
                f"{node.op} of {a.shape} and {b.shape}",
                "the vulkan backend adds and multiplies equal shapes only",
            )
        out = self._new(node)
        b_view = _view(b, a.shape)
        return lambda rec, start: kernel(rec, a, b_view, out)

    def op_add(self, node: Node) -> Emitter | None:
        a, b = self._value(node, 0), self._value(node, 1)
        if self._at in self._add_norm and a.size == b.size:  # the next node, an rms_norm, computes the sum
            self._new(node)
            names = [r.name for r in node.inputs[:2]]
            if names[0] in self._partials:  # the partial sums are the norm's residual (a + b = b + a exactly)
                a, b, names = b, a, names[::-1]
            self._fused_adds[node.output] = (a, _view(b, a.shape), self._partials.get(names[1], 1))
            self._buffers.read_later((r.name for r in node.inputs[:2]), self._at)  # read by the norm too
            return None
        return self._binary(node, ew.add)

    def op_mul(self, node: Node) -> Emitter:
        return self._binary(node, ew.mul)

    def op_scale(self, node: Node) -> Emitter:
        x = self._value(node, 0)
        out = self._new(node)
        factor = float(node.attrs["factor"])
        return lambda rec, start: ew.unary(rec, "scale", x, out, factor)

    def op_moe(self, node: Node) -> Emitter:
        """Routing on the device (softmax top-k: a dense row of weights per token, and the chosen experts' ids
        and weights), then the experts. When the step has no more (token, chosen expert) slots than experts
        (decode) and the experts lie in stacks (upload.EXPERT_STACKS), two gathered dispatches run only the
        chosen experts' rows: the cost follows the active parameters. Otherwise every expert's gated MLP runs
        over the step's tokens and is added in with its weight (zero where the expert was not chosen)."""
        a = node.attrs
        if a["scoring"] != "softmax" or int(a.get("groups", 1)) > 1 or node.inputs[2]:
            raise Unsupported(Reason.OPERATION, f"moe routing {a['scoring']}, groups {a.get('groups', 1)}",
                              "the vulkan backend routes by softmax top-k, without groups or a correction bias")
        if a["act"] not in GATED:
            raise Unsupported(Reason.OPERATION, f"moe {a['act']}", f"the vulkan kernels have {', '.join(GATED)}")
        count = int(a["experts"])
        if count > moe_kernels.MAX_EXPERTS:
            raise Unsupported(Reason.SHAPE, f"moe with {count} experts",
                              f"the vulkan backend takes up to {moe_kernels.MAX_EXPERTS} experts")
        x, router = self._value(node, 0), self._matrix(node, 1)
        shared = self._optional(node, 3)
        shared_gate = self._matrix(node, 4) if node.inputs[4] else None
        if a["stacked"]:  # GGUF's [E, out, in] tensors, uploaded as stacks; each expert a row range of them
            found = self.weights.expert_tensors.get(str(node.inputs[5].name))
            if found is None:
                self._missing(node, str(node.inputs[5].name), "stacked experts of one kernel format")
            gu, dn = found
            f, d = gu.part_rows[0], dn.per_expert
            experts = [(row_range(gu.weight, 2 * f * e, 2 * f * e + f), row_range(gu.weight, 2 * f * e + f,
                        2 * f * (e + 1)), row_range(dn.weight, d * e, d * (e + 1))) for e in range(count)]
        else:
            experts = [tuple(self._matrix(node, 5 + 3 * e + j) for j in range(3)) for e in range(count)]
        width, inter = router.cols, experts[0][0].rows
        tokens = x.size // width
        top_k, norm, scale = int(a["top_k"]), bool(a["norm_topk"]), float(a["routed_scale"])
        out = self._new(node)
        flat_x, flat_out = _view(x, (tokens, width)), _view(out, (tokens, width))
        scratch = self._buffers.scratch
        logits, weights = scratch("logits", (tokens, count)), scratch("weights", (tokens, count))
        ids = scratch("ids", (tokens, top_k))
        ids = DeviceArray(ids.buffer, ids.shape, "u32")
        chosen = scratch("chosen", (tokens, top_k))
        stacks = None
        if tokens * top_k <= count:
            stacks = found if a["stacked"] else self._expert_stacks(node, count)
        shared_flat = None if shared is None else _view(shared, (tokens, width))
        shared_w = None if shared_gate is None else scratch("shared_gate", (tokens, 1))
        if stacks is not None:
            gate_up, down = stacks
            h = scratch("gathered_h", (tokens * top_k, inter))

            def run_experts(rec: Recorder) -> None:
                moe_kernels.gate_up(rec, flat_x, gate_up, ids, h, a["act"])
                moe_kernels.down(rec, h, down, ids, chosen, flat_out)
        else:
            gate, up = scratch("gate", (tokens, inter)), scratch("up", (tokens, inter))
            h, y = scratch("h", (tokens, inter)), scratch("y", (tokens, width))

            def run_experts(rec: Recorder) -> None:
                for e, (w_gate, w_up, w_down) in enumerate(experts):
                    lin.linear(rec, flat_x, w_gate, gate)
                    lin.linear(rec, flat_x, w_up, up)
                    ew.gated_activation(rec, gate, up, h, a["act"])
                    lin.linear(rec, h, w_down, y)
                    moe_kernels.accumulate(rec, weights, e, y, flat_out, moe_kernels.ASSIGN if e == 0 else 0)

        def emit(rec: Recorder, start: int) -> None:
            lin.linear(rec, flat_x, router, logits)
            moe_kernels.route(rec, logits, weights, top_k, norm, scale, ids, chosen)
            run_experts(rec)
            if shared_flat is not None and shared_w is not None and shared_gate is not None:
                lin.linear(rec, flat_x, shared_gate, shared_w)
                moe_kernels.accumulate(rec, shared_w, 0, shared_flat, flat_out, moe_kernels.SIGMOID)
            elif shared_flat is not None:
                moe_kernels.accumulate(rec, shared_flat, 0, shared_flat, flat_out, moe_kernels.UNIT)

        return emit

    def _expert_stacks(self, node: Node, count: int) -> tuple[ExpertStack, ExpertStack] | None:
        """The (gate/up, down) stacks that hold this moe node's experts in order, or None when the upload kept
        them apart (names outside upload.EXPERT_STACKS, or an expert larger than one binding)."""
        where = [[self.weights.stacked.get(str(node.inputs[5 + 3 * e + j].name)) for j in range(3)]
                 for e in range(count)]
        if any(w is None for row in where for w in row):
            return None
        gate_up, down = where[0][0][0], where[0][2][0]
        for e, (g, u, d) in enumerate(where):
            if g != (gate_up, e, 0) or u != (gate_up, e, 1) or d != (down, e, 0):
                return None
        if gate_up.experts != count or down.experts != count:
            return None
        return gate_up, down

    def op_last_position(self, node: Node) -> Emitter | None:
        x = self._value(node, 0)
        width = x.shape[-1]
        if self.tokens == 1:  # the one position is the whole value: a view, no copy
            self._buffers.define(node.output, _view(x, tuple(node.shape)))
            return None
        out = self._new(node)
        offset = (self.tokens - 1) * width
        return lambda rec, start: copy_values(rec, x, out, width, offset)

    # -- running -------------------------------------------------------------------------------------

    def run(self, state: dict[str, DeviceArray], inputs: dict[str, np.ndarray]) -> list[Output]:
        check_positions(self.graph, inputs)  # a RequestError, as on every backend, before anything is written
        start = self._write_inputs(inputs)
        runtime = self.runtime
        slots = {name: array.buffer for name, array in state.items()}
        self.step.write_uniforms(start)
        step = self._next if self._next is not None and self.step.bound_to(slots) else None
        if step is None:
            step = self.step.command_buffer(slots)
        self._next = None
        encoder = runtime.device.create_command_encoder()
        results = []
        for value in self.outputs:
            nbytes = 4 * value.size
            fresh = runtime.raw_buffer(nbytes)
            encoder.copy_buffer_to_buffer(value.buffer, 0, fresh, 0, nbytes)
            results.append(Output(runtime, fresh, tuple(value.shape)))
        if self.ids is not None:
            ids = runtime.raw_buffer(4 * self.ids.size)
            encoder.copy_buffer_to_buffer(self.ids.buffer, 0, ids, 0, 4 * self.ids.size)
            results[0].ids = ids
        runtime.device.queue.submit([step, encoder.finish()])
        if self.tokens == 1:
            # Decode steps follow one another: encoding the next one now overlaps the host's encoding
            # (about 10 us a dispatch in wgpu-py) with the device running this one. The command buffer
            # holds no position or token, so it is valid for whatever step comes next on these slots.
            self._next = self.step.command_buffer(slots)
        return results

    def _write_inputs(self, inputs: dict[str, np.ndarray]) -> int:
        """Write the step's ids and positions; returns the start position."""
        for name, target in self.inputs.items():
            if name not in inputs:
                raise RequestError(f"the step needs input {name!r}")
            host = np.asarray(inputs[name])
            if host.shape != (1, self.tokens):
                raise RequestError(f"input {name!r} has shape {host.shape}, the step takes (1, {self.tokens})")
            if host.min() < 0 or host.max() > np.iinfo(np.uint32).max:
                raise RequestError(f"input {name!r} holds values outside 0..2^32-1")
            self.runtime.write(target, host.reshape(-1).astype(np.uint32))
        positions = np.asarray(inputs.get("positions", np.zeros((1, self.tokens), dtype=np.int64)))
        start = int(positions[0, 0])
        if np.any(positions[0] != start + np.arange(self.tokens)):
            raise RequestError("positions must be consecutive within a step")
        return start


VULKAN_OPS = passes.handled_ops(VulkanProgram)  # the vocabulary ops it has an op_<name> handler for
