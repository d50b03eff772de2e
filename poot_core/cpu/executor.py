"""The embedded default executor: torch on the CPU.

Weights are used where they lie (memory-mapped, dtype as stored). A prepared program is the graph's node
list with each node bound once to a small function (by its op's handler, `_Binder.op_<name>`), so a step is a
plain loop with no lookups by op name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch

from poot_core.checkpoint.layouts import PackedWeight, Weight, weight_kind
from poot_core.cpu import fusion, ops, small_ops
from poot_core.cpu.packed_linear import DECODE_ROWS, few_rows_product
from poot_core.cpu.packed_linear import FUSED_MAX_ROWS as FEW_ROWS
from poot_core.errors import Reason, Unsupported
from poot_core.executor import Capabilities, check_positions, require_ops
from poot_core.graph import Graph, Node, Ref, StateRef, ValueRef, WeightRef, passes, sequence_runs

DENSE_KINDS = frozenset({"float32", "float16", "bfloat16"})
LAYOUTS = frozenset({"contiguous", "paged"})  # KV layouts (StepShape.paging: poot_core.cpu.paged)

Env = dict[str, Any]
StepFn = Callable[[Env, dict[str, torch.Tensor]], torch.Tensor]


def _computed_by_another(out: str) -> StepFn:
    """The step of a node whose value an earlier, fused step has left in the environment already."""
    return lambda e, s: e[out]


def _folded(_e: Env, _s: dict[str, torch.Tensor]) -> None:
    """The step of a node whose work a later step does inside its own (a rope inside the attention call)."""
    return None


class CpuProgram:
    def __init__(self, graph: Graph, weights: dict[str, Weight]) -> None:
        self.graph = graph
        bound: dict[int, StepFn] = {}
        paged = graph.shape.paging is not None
        # linears over back-to-back weights that read one input: one product, at the first one's place
        for group in fusion.adjacent_groups(graph.nodes, weights):
            runner = graph.nodes[min(group)]
            source = graph.nodes[group[0]].inputs[0].name
            bound[min(group)] = fusion.bind_group([graph.nodes[i] for i in group], runner, weights,
                                                  lambda e, s, name=source: e[name], rowwise=paged)
            for i in group:
                if i != min(group):
                    bound[i] = _computed_by_another(graph.nodes[i].output)
        for i in passes.add_norm_pairs(graph.nodes):
            bound[i] = _bind_add_norm(graph.nodes[i], graph.nodes[i + 1], weights)
            bound[i + 1] = _computed_by_another(graph.nodes[i + 1].output)
        reads: list[tuple[Ref | None, ...]] = [node.inputs for node in graph.nodes]  # what each step reads
        # paged steps attend through poot_core.cpu.paged, which rotates nothing itself
        for i, q_rope, k_rope in ([] if graph.shape.paging else _roped_attention(graph)):
            if not {i, q_rope, k_rope} & bound.keys():
                att, qn, kn = graph.nodes[i], graph.nodes[q_rope], graph.nodes[k_rope]
                bound[i] = _bind_rope_attention(att, qn, kn)
                bound[q_rope] = bound[k_rope] = _folded  # rotated inside the attention step
                reads[i] = (qn.inputs[0], kn.inputs[0], *att.inputs[2:])
                reads[q_rope] = reads[k_rope] = ()
        binder = _Binder(weights, rowwise=paged)
        self._steps = [(node.output, bound.get(i) or binder.dispatch(node)) for i, node in enumerate(graph.nodes)]
        # After each step, the values no later step reads: dropping them lets torch reuse their memory.
        self._dead = passes.dead_after(graph, reads)

    def run(self, state: dict[str, torch.Tensor], inputs: dict[str, np.ndarray]) -> list[torch.Tensor]:
        check_positions(self.graph, inputs)  # the C kernels index the KV cache by position, unchecked
        env: Env = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in inputs.items()}
        if self.graph.shape.paging is not None:
            env[fusion.LONE_ROWS] = _leading_short_runs(inputs["seq_index"])
        with torch.inference_mode():
            for (out, fn), dead in zip(self._steps, self._dead, strict=True):
                env[out] = fn(env, state)
                for name in dead:
                    env.pop(name, None)
        return [env[name] for name in self.graph.outputs]


def _leading_short_runs(seq_index: np.ndarray) -> int:
    """How many of a paged step's first tokens lie in runs of at most FEW_ROWS tokens of one sequence."""
    count = 0
    for _, t0, t1 in sequence_runs(seq_index):
        if t0 != count or t1 - t0 > FEW_ROWS:
            break
        count = t1
    return count


def _roped_attention(graph: Graph) -> list[tuple[int, int, int]]:
    """(attention, q rope, k rope) node indices where attention reads two ropes of the same step positions that
    nothing else reads: rotating q and k, writing the cache and attending can then be one C call at decode."""
    made = {node.output: i for i, node in enumerate(graph.nodes)}
    readers: dict[Ref | None, int] = {}
    for node in graph.nodes:
        for ref in node.inputs:
            readers[ref] = readers.get(ref, 0) + 1
    found = []
    for i, node in enumerate(graph.nodes):
        if node.op != "attention":
            continue
        q_at, k_at = made.get(node.inputs[0].name), made.get(node.inputs[1].name)
        if q_at is None or k_at is None:
            continue
        qn, kn = graph.nodes[q_at], graph.nodes[k_at]
        if (qn.op == kn.op == "rope" and qn.attrs == kn.attrs and qn.inputs[1] == kn.inputs[1] == node.inputs[3]
                and readers[ValueRef(qn.output)] == readers[ValueRef(kn.output)] == 1):
            found.append((i, q_at, k_at))
    return found


class _Rope:
    """A rope node's rotation. Its angles are computed once per step (kept in the step's environment) and
    shared by every layer with the same rope."""

    def __init__(self, node: Node) -> None:
        a = node.attrs
        self.attrs, self.positions, self.style = a, node.inputs[1].name, a["style"]
        self.key = f"rope:{self.positions}:{a['theta']}:{a['dim']}:{sorted(a['scaling'].items())}:{self.style}"

    def angles(self, e: Env) -> tuple[torch.Tensor, torch.Tensor]:
        found = e.get(self.key)
        if found is None:
            a = self.attrs
            found = e[self.key] = ops.rope_tables(e[self.positions], a["theta"], a["dim"], a["scaling"])
        return found

    def rotate(self, e: Env, x: torch.Tensor) -> torch.Tensor:
        cos_sin = self.angles(e)
        done = small_ops.rope(x, *cos_sin, interleaved=self.style != "neox")  # one C call
        if done is not None:
            return done
        table = e.get(self.key + ":table")
        if table is None:
            table = e[self.key + ":table"] = ops.rope_step_table(*cos_sin, self.style)
        return ops.rope_with(x, table, self.style)


def _bind_rope_attention(att: Node, q_rope: Node, k_rope: Node) -> StepFn:
    """The attention step, rotating q and k itself: at decode one C call rotates both, writes the cache and
    attends; otherwise the two ropes and the attention run as they would unfused."""
    from poot_core.cpu.c_attention import attend_few

    rope = _Rope(q_rope)
    q_name, k_name = q_rope.inputs[0].name, k_rope.inputs[0].name
    v_name, pos_name, kc_name, vc_name = (r.name for r in att.inputs[2:])
    a, interleaved = att.attrs, rope.style != "neox"

    def rope_attention(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
        qv, kv, vv, pos = e[q_name], e[k_name], e[v_name], e[pos_name]
        kc, vc = s[kc_name], s[vc_name]
        done = attend_few(qv, kv, vv, pos, kc, vc, a["scale"], a["window"], a["softcap"],
                          rope=(*rope.angles(e), interleaved))
        if done is not None:
            return done
        return ops.attention(rope.rotate(e, qv), rope.rotate(e, kv), vv, pos, kc, vc, a["scale"], a["window"],
                             a["softcap"])

    return rope_attention


def _bind_add_norm(add: Node, norm: Node, weights: dict[str, Weight]) -> StepFn:
    """The add's step function, which leaves the norm's output in the environment too (one C call for both at
    decode; torch for prefill)."""
    x_name, y_name = (r.name for r in add.inputs)
    scale = weights[norm.inputs[1].name].float() + norm.attrs["offset"]
    eps, out = norm.attrs["eps"], norm.output

    def add_norm(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
        xv, yv = e[x_name], _dense(e[y_name])
        done = small_ops.add_rms_norm(xv, yv, scale, eps)
        if done is None:
            total = xv + yv
            done = total, ops.rms_norm(total, scale, eps)
        e[out] = done[1]
        return done[0]

    return add_norm


Arg = Callable[[Env, dict[str, torch.Tensor]], Any]


class _Binder:
    """One node -> a function of (env, state), through its op's handler. Weights are looked up once, here."""

    def __init__(self, weights: dict[str, Weight], rowwise: bool = False) -> None:
        self.weights = weights
        self.rowwise = rowwise  # serving steps: decode products up to fusion.ROWWISE_MAX rows
        self.dispatch: passes.Dispatch[StepFn] = passes.Dispatch(self, "cpu")

    def get(self, ref: Ref | None) -> Any:
        """A stored weight itself; a value's or state's name; None for an absent input."""
        if isinstance(ref, WeightRef):
            return self.weights[ref.name]
        return None if ref is None else ref.name

    def args(self, node: Node) -> list[Arg]:
        return [self.arg(ref) for ref in node.inputs]

    def arg(self, ref: Ref | None) -> Arg:
        if ref is None:
            return lambda env, state: None
        name = ref.name
        if isinstance(ref, WeightRef):
            w = self.weights[name]
            return lambda env, state: w
        if isinstance(ref, StateRef):
            return lambda env, state: state[name]
        return lambda env, state: env[name]

    def op_embed(self, node: Node) -> StepFn:
        table, tokens = self.args(node)
        scale = node.attrs.get("scale")
        if scale is None:
            return lambda e, s: ops.embed(table(e, s), tokens(e, s))
        return lambda e, s: ops.embed(table(e, s), tokens(e, s)) * scale

    def op_rms_norm(self, node: Node) -> StepFn:
        a = node.attrs
        x = self.arg(node.inputs[0])
        scale = self.get(node.inputs[1]).float() + a["offset"]  # a small vector: float32 once, offset applied

        def rms_norm(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
            xv = x(e, s)
            done = small_ops.add_rms_norm(xv, None, scale, a["eps"])  # a few tokens: one C call
            return done[1] if done is not None else ops.rms_norm(xv, scale, a["eps"])

        return rms_norm

    def op_layer_norm(self, node: Node) -> StepFn:
        x, w, b = self.args(node)
        eps = node.attrs["eps"]
        return lambda e, s: ops.layer_norm(x(e, s), w(e, s), b(e, s), eps)

    def op_linear(self, node: Node) -> StepFn:
        x, w, b = self.args(node)
        weight, bias_ref = self.get(node.inputs[1]), node.inputs[2]
        bias_is_weight = bias_ref is None or isinstance(bias_ref, WeightRef)
        if isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16) and bias_is_weight:
            # q, k and v (gate and up) read the same input: convert it to the weight's dtype once per step.
            key = f"{node.inputs[0]}:{weight.dtype}"
            bias = self.get(bias_ref)
            bias = None if bias is None else bias.float()

            def linear16(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                xv = x(e, s)
                if xv.numel() // xv.shape[-1] > DECODE_ROWS:
                    xs = e.get(key)
                    if xs is None:
                        xs = e[key] = xv.to(weight.dtype)
                    y = ops.linear16(xv, weight, xs)
                else:
                    y = ops.linear16(xv, weight)
                return y if bias is None else y + bias

            return linear16
        rows = fusion.ROWWISE_MAX if self.rowwise else DECODE_ROWS
        product = few_rows_product(weight, rows) if isinstance(weight, PackedWeight) and bias_ref is None else None
        if product is not None:  # decode: the C kernel with its plan made once

            def packed(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                xv = x(e, s)
                y = product(xv, e.get(fusion.LONE_ROWS, 0))
                return y if y is not None else ops.linear(xv, weight)

            return packed
        return lambda e, s: ops.linear(x(e, s), w(e, s), b(e, s))

    def op_reshape(self, node: Node) -> StepFn:
        x, shape = self.arg(node.inputs[0]), node.shape
        return lambda e, s: x(e, s).reshape(shape)

    def op_rope(self, node: Node) -> StepFn:
        x, rope = self.arg(node.inputs[0]), _Rope(node)
        return lambda e, s: rope.rotate(e, x(e, s))

    def op_attention(self, node: Node) -> StepFn:
        q, k, v, pos, kc, vc, *paged_inputs = self.args(node)
        a = node.attrs
        if node.input(6) is not None:  # a paged step: the caches are pools of blocks
            from poot_core.cpu import paged

            seqs, tables = paged_inputs

            def paged_attention(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                positions = pos(e, s)
                k_pool = kc(e, s)
                step = paged.plan(e, positions, seqs(e, s), tables(e, s), k_pool.shape[2])
                return paged.attention(q(e, s), k(e, s), v(e, s), positions, step, k_pool, vc(e, s), a["scale"],
                                       a["window"], a["softcap"])

            return paged_attention
        return lambda e, s: ops.attention(q(e, s), k(e, s), v(e, s), pos(e, s), kc(e, s), vc(e, s),
                                          a["scale"], a["window"], a["softcap"])

    def op_encoder_attention(self, node: Node) -> StepFn:
        q, k, v, mask = self.args(node)
        scale = node.attrs["scale"]
        return lambda e, s: ops.encoder_attention(q(e, s), k(e, s), v(e, s), mask(e, s), scale)

    def op_gated(self, node: Node) -> StepFn:
        g, u = self.args(node)
        act = node.attrs["act"]
        if act == "silu":

            def silu_gated(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                gv, uv = g(e, s), u(e, s)
                # one C pass, whatever the row count: each row's arithmetic is then the same at decode, at prefill
                # and in a serving step of many rows (torch's vector and scalar loops differ in the last bits)
                done = small_ops.silu_mul(gv, uv)
                return done if done is not None else ops.gated(gv, uv, "silu")

            return silu_gated
        return lambda e, s: ops.gated(g(e, s), u(e, s), act)

    def op_activation(self, node: Node) -> StepFn:
        x, act = self.arg(node.inputs[0]), node.attrs["act"]
        return lambda e, s: ops.activation(x(e, s), act)

    def op_add(self, node: Node) -> StepFn:
        x, y = self.args(node)
        return lambda e, s: x(e, s) + _dense(y(e, s))

    def op_mul(self, node: Node) -> StepFn:
        x, y = self.args(node)
        return lambda e, s: x(e, s) * _dense(y(e, s))

    def op_scale(self, node: Node) -> StepFn:
        x, factor = self.arg(node.inputs[0]), node.attrs["factor"]
        return lambda e, s: x(e, s) * factor

    def op_last_position(self, node: Node) -> StepFn:
        x = self.arg(node.inputs[0])
        if node.input(1) is not None:  # a paged step: the token of each sequence slot
            index = self.arg(node.inputs[1])
            return lambda e, s: x(e, s)[:, index(e, s)]
        return lambda e, s: x(e, s)[:, -1:, :]

    def op_logits(self, node: Node) -> StepFn:
        x, w = self.args(node)
        softcap, weight = node.attrs["softcap"], self.get(node.inputs[1])
        # a packed head's rows are decode rows up to DECODE_ROWS (a verify step) and in serving steps (the logits of
        # a row do not depend on the batch)
        rows = fusion.ROWWISE_MAX if self.rowwise else DECODE_ROWS
        product = few_rows_product(weight, rows) if isinstance(weight, PackedWeight) else None
        return lambda e, s: ops.logits(x(e, s), w(e, s), softcap, product)

    def op_moe(self, node: Node) -> StepFn:
        from poot_core.cpu import moe

        return moe.bind(node, self.args(node), self.get)

    def op_mla_attention(self, node: Node) -> StepFn:
        from poot_core.cpu import mla

        return mla.bind(node, self.args(node), self.get)

    def op_slice(self, node: Node) -> StepFn:
        x, start, stop = self.arg(node.inputs[0]), node.attrs["start"], node.attrs["stop"]
        return lambda e, s: x(e, s)[..., start:stop]

    def op_short_conv(self, node: Node) -> StepFn:
        from poot_core.cpu import recurrent

        return recurrent.bind_short_conv(node, self.args(node), self.get)

    def op_ssm_scan(self, node: Node) -> StepFn:
        from poot_core.cpu import recurrent

        return recurrent.bind_ssm_scan(node, self.args(node), self.get)

    def op_gated_delta(self, node: Node) -> StepFn:
        from poot_core.cpu import recurrent

        return recurrent.bind_gated_delta(node, self.args(node), self.get)

    def op_gated_rms_norm(self, node: Node) -> StepFn:
        from poot_core.cpu import recurrent

        return recurrent.bind_gated_rms_norm(node, self.args(node), self.get)

    def op_group_attention(self, node: Node) -> StepFn:
        from poot_core.cpu import group_attention

        return group_attention.bind_group_attention(node, self.args(node))

    def op_splice(self, node: Node) -> StepFn:
        from poot_core.cpu import splice

        return splice.bind_splice(node, self.args(node))

    def op_all_reduce(self, node: Node) -> StepFn:
        from poot_core.cpu import collectives

        return collectives.bind_all_reduce(node, self.arg(node.inputs[0]))

    def op_all_gather(self, node: Node) -> StepFn:
        from poot_core.cpu import collectives

        return collectives.bind_all_gather(node, self.arg(node.inputs[0]))


CPU_OPS = passes.handled_ops(_Binder)


def _dense(x: Any) -> torch.Tensor:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype != torch.float32 else x


class CpuExecutor:
    name = "cpu"

    def capabilities(self) -> Capabilities:
        from poot_core.checkpoint.quant import supported_kinds

        return Capabilities(CPU_OPS, DENSE_KINDS | frozenset(supported_kinds()), layouts=LAYOUTS)

    def upload(self, store: Any) -> dict[str, Weight]:
        """Nothing moves: the CPU computes from the memory-mapped weights as stored."""
        caps = self.capabilities()
        weights = {}
        for name in store.names():
            w = store.get(name)
            kind = weight_kind(w)
            if isinstance(w, PackedWeight) and kind not in caps.weight_kinds:
                raise Unsupported(Reason.QUANTIZATION, f"{kind} (tensor {name})",
                                  "the cpu backend cannot compute from this layout")
            weights[name] = w
        if any(isinstance(w, PackedWeight) for w in weights.values()):
            from poot_core.cpu.packed_linear import kernels

            kernels()  # build (first time on this machine) or load the C kernels now, not inside the first step
        return weights

    def prepare(self, graph: Graph, weights: dict[str, Weight]) -> CpuProgram:
        require_ops(graph, self.capabilities(), self.name)
        return CpuProgram(graph, weights)

    def allocate_state(self, graph: Graph) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(spec.shape) for name, spec in graph.state.items()}

    def copy_state_rows(self, state: dict[str, torch.Tensor], src_row: int, dst_row: int, length: int) -> None:
        for buf in state.values():
            buf[dst_row, :, :length] = buf[src_row, :, :length]

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().float().numpy()

    def mask_logits(self, output: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Constraint masks (packed int32 words) applied to rows of a logits output, in place
        (executor.MaskOnDevice)."""
        from poot_core.cpu.token_mask import mask_logits

        return mask_logits(output, bitmask, rows)

    def memory(self) -> dict[str, int]:
        vm = psutil.virtual_memory()
        return {"total": int(vm.total), "free": int(vm.available)}
