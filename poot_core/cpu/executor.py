"""The embedded default executor: torch on the CPU.

Weights are used where they lie (memory-mapped, dtype as stored). A prepared program is the graph's node
list with each node bound to a small function once, so a step is a plain loop with no lookups by op name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch

from poot_core.checkpoint.layouts import PackedWeight, Weight, weight_kind
from poot_core.cpu import fusion, ops, small_ops
from poot_core.cpu.packed_linear import FUSED_MAX_ROWS as FEW_ROWS
from poot_core.cpu.packed_linear import few_rows_product
from poot_core.errors import Reason, Unsupported
from poot_core.executor import Capabilities, check_positions, require_ops
from poot_core.graph import Graph, Node

CPU_OPS = frozenset({
    "embed", "rms_norm", "layer_norm", "linear", "reshape", "rope", "attention", "encoder_attention",
    "gated", "activation", "add", "mul", "scale", "last_position", "logits", "moe", "mla_attention",
})
DENSE_KINDS = frozenset({"float32", "float16", "bfloat16"})

Env = dict[str, Any]
StepFn = Callable[[Env, dict[str, torch.Tensor]], torch.Tensor]

class CpuProgram:
    def __init__(self, graph: Graph, weights: dict[str, Weight]) -> None:
        self.graph = graph
        bound: dict[int, StepFn] = {}
        for group in fusion.adjacent_groups(graph.nodes, weights):
            runner = graph.nodes[min(group)]
            source = graph.nodes[group[0]].inputs[0]
            bound[min(group)] = fusion.bind_group([graph.nodes[i] for i in group], runner, weights,
                                                  lambda e, s, name=source: e[name])
            for i in group:
                if i != min(group):  # computed by the group's runner already
                    bound[i] = lambda e, s, out=graph.nodes[i].output: e[out]
        for i, node in enumerate(graph.nodes[:-1]):
            after = graph.nodes[i + 1]
            if i not in bound and i + 1 not in bound and _add_then_norm(node, after):
                bound[i] = _bind_add_norm(node, after, weights)
                bound[i + 1] = lambda e, s, out=after.output: e[out]  # computed by the add already
        reads = {i: node.inputs for i, node in enumerate(graph.nodes)}  # what each step reads, after fusions
        for i, q_rope, k_rope in _roped_attention(graph):
            if not {i, q_rope, k_rope} & bound.keys():
                att, qn, kn = graph.nodes[i], graph.nodes[q_rope], graph.nodes[k_rope]
                bound[i] = _bind_rope_attention(att, qn, kn)
                bound[q_rope] = bound[k_rope] = lambda e, s: None  # rotated inside the attention step
                reads[i] = (qn.inputs[0], kn.inputs[0], *att.inputs[2:])
                reads[q_rope] = reads[k_rope] = ()
        self._steps = [(node.output, bound.get(i) or _bind(node, weights)) for i, node in enumerate(graph.nodes)]
        # After each step, the values no later step reads: dropping them lets torch reuse their memory.
        last_read: dict[str, int] = {}
        for i in range(len(graph.nodes)):
            for name in reads[i]:
                last_read[name] = i
        keep = set(graph.outputs)
        self._dead: list[list[str]] = [[] for _ in graph.nodes]
        for name, i in last_read.items():
            if name not in keep and not name.startswith(("w:", "s:")) and name not in graph.inputs:
                self._dead[i].append(name)

    def run(self, state: dict[str, torch.Tensor], inputs: dict[str, np.ndarray]) -> list[torch.Tensor]:
        check_positions(self.graph, inputs)  # the C kernels index the KV cache by position, unchecked
        env: Env = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in inputs.items()}
        with torch.inference_mode():
            for (out, fn), dead in zip(self._steps, self._dead, strict=True):
                env[out] = fn(env, state)
                for name in dead:
                    env.pop(name, None)
        return [env[name] for name in self.graph.outputs]


def _roped_attention(graph: Graph) -> list[tuple[int, int, int]]:
    """(attention, q rope, k rope) node indices where attention reads two ropes of the same step positions that
    nothing else reads: rotating q and k, writing the cache and attending can then be one C call at decode."""
    made = {node.output: i for i, node in enumerate(graph.nodes)}
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers[name] = readers.get(name, 0) + 1
    found = []
    for i, node in enumerate(graph.nodes):
        if node.op != "attention":
            continue
        q_at, k_at = made.get(node.inputs[0]), made.get(node.inputs[1])
        if q_at is None or k_at is None:
            continue
        qn, kn = graph.nodes[q_at], graph.nodes[k_at]
        if (qn.op == kn.op == "rope" and qn.attrs == kn.attrs and qn.inputs[1] == kn.inputs[1] == node.inputs[3]
                and readers[qn.output] == readers[kn.output] == 1):
            found.append((i, q_at, k_at))
    return found


class _Rope:
    """A rope node's rotation. Its angles are computed once per step (kept in the step's environment) and
    shared by every layer with the same rope."""

    def __init__(self, node: Node) -> None:
        a = node.attrs
        self.attrs, self.positions, self.style = a, node.inputs[1], a["style"]
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
    q_name, k_name, (v_name, pos_name, kc_name, vc_name) = q_rope.inputs[0], k_rope.inputs[0], att.inputs[2:]
    a, interleaved = att.attrs, rope.style != "neox"

    def rope_attention(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
        qv, kv, vv, pos = e[q_name], e[k_name], e[v_name], e[pos_name]
        kc, vc = s[kc_name[2:]], s[vc_name[2:]]
        done = attend_few(qv, kv, vv, pos, kc, vc, a["scale"], a["window"], a["softcap"],
                          rope=(*rope.angles(e), interleaved))
        if done is not None:
            return done
        return ops.attention(rope.rotate(e, qv), rope.rotate(e, kv), vv, pos, kc, vc, a["scale"], a["window"],
                             a["softcap"])

    return rope_attention


def _add_then_norm(add: Node, norm: Node) -> bool:
    """A residual add of two computed values whose sum an RMSNorm reads next (each transformer block has two)."""
    return (add.op == "add" and norm.op == "rms_norm" and norm.inputs[0] == add.output
            and not any(name.startswith(("w:", "s:")) for name in add.inputs))


def _bind_add_norm(add: Node, norm: Node, weights: dict[str, Weight]) -> StepFn:
    """The add's step function, which leaves the norm's output in the environment too (one C call for both at
    decode; torch for prefill)."""
    x_name, y_name = add.inputs
    scale = weights[norm.inputs[1][2:]].float() + norm.attrs["offset"]
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


def _bind(node: Node, weights: dict[str, Weight]) -> StepFn:
    """One node -> a function of (env, state). Weights are looked up once, here."""

    def arg(i: int) -> Callable[[Env, dict[str, torch.Tensor]], Any]:
        name = node.inputs[i] if i < len(node.inputs) else ""
        if name == "":
            return lambda env, state: None
        if name.startswith("w:"):
            w = weights[name[2:]]
            return lambda env, state: w
        if name.startswith("s:"):
            key = name[2:]
            return lambda env, state: state[key]
        return lambda env, state: env[name]

    def get(name: str) -> Any:
        if name.startswith("w:"):
            return weights[name[2:]]
        return name

    a = node.attrs
    args = [arg(i) for i in range(len(node.inputs))]
    op = node.op
    if op == "embed":
        table, tokens = args
        scale = a.get("scale")
        if scale is None:
            return lambda e, s: ops.embed(table(e, s), tokens(e, s))
        return lambda e, s: ops.embed(table(e, s), tokens(e, s)) * scale
    if op == "rms_norm":
        x, _ = args
        scale = get(node.inputs[1]).float() + a["offset"]  # a small vector: float32 once, offset applied

        def rms_norm(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
            xv = x(e, s)
            done = small_ops.add_rms_norm(xv, None, scale, a["eps"])  # a few tokens: one C call
            return done[1] if done is not None else ops.rms_norm(xv, scale, a["eps"])

        return rms_norm
    if op == "layer_norm":
        x, w, b = args
        return lambda e, s: ops.layer_norm(x(e, s), w(e, s), b(e, s), a["eps"])
    if op == "linear":
        x, w, b = args
        weight = get(node.inputs[1])
        bias_is_weight = node.inputs[2] == "" or node.inputs[2].startswith("w:")
        if isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16) and bias_is_weight:
            # q, k and v (gate and up) read the same input: convert it to the weight's dtype once per step.
            key = f"{node.inputs[0]}:{weight.dtype}"
            bias = get(node.inputs[2]) if node.inputs[2] else None
            bias = None if bias is None else bias.float()

            def linear16(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                xv = x(e, s)
                if xv.numel() // xv.shape[-1] > FEW_ROWS:
                    xs = e.get(key)
                    if xs is None:
                        xs = e[key] = xv.to(weight.dtype)
                    y = ops.linear16(xv, weight, xs)
                else:
                    y = ops.linear16(xv, weight)
                return y if bias is None else y + bias

            return linear16
        product = few_rows_product(weight) if isinstance(weight, PackedWeight) and node.inputs[2] == "" else None
        if product is not None:  # decode: the C kernel with its plan made once

            def packed(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                xv = x(e, s)
                y = product(xv)
                return y if y is not None else ops.linear(xv, weight)

            return packed
        return lambda e, s: ops.linear(x(e, s), w(e, s), b(e, s))
    if op == "reshape":
        (x,) = args
        return lambda e, s: x(e, s).reshape(node.shape)
    if op == "rope":
        x, _ = args
        rope = _Rope(node)
        return lambda e, s: rope.rotate(e, x(e, s))
    if op == "attention":
        q, k, v, pos, kc, vc = args
        return lambda e, s: ops.attention(q(e, s), k(e, s), v(e, s), pos(e, s), kc(e, s), vc(e, s),
                                          a["scale"], a["window"], a["softcap"])
    if op == "encoder_attention":
        q, k, v, mask = args
        return lambda e, s: ops.encoder_attention(q(e, s), k(e, s), v(e, s), mask(e, s), a["scale"])
    if op == "gated":
        g, u = args
        if a["act"] == "silu":

            def silu_gated(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
                gv, uv = g(e, s), u(e, s)
                # many rows (prefill): one C pass on every core; a few rows: torch's two ops cost less than the
                # C route's checks
                done = small_ops.silu_mul(gv, uv) if gv.numel() > 1 << 14 else None
                return done if done is not None else ops.gated(gv, uv, "silu")

            return silu_gated
        return lambda e, s: ops.gated(g(e, s), u(e, s), a["act"])
    if op == "activation":
        (x,) = args
        return lambda e, s: ops.activation(x(e, s), a["act"])
    if op == "add":
        x, y = args
        return lambda e, s: x(e, s) + _dense(y(e, s))
    if op == "mul":
        x, y = args
        return lambda e, s: x(e, s) * _dense(y(e, s))
    if op == "scale":
        (x,) = args
        return lambda e, s: x(e, s) * a["factor"]
    if op == "last_position":
        (x,) = args
        return lambda e, s: x(e, s)[:, -1:, :]
    if op == "logits":
        x, w = args
        return lambda e, s: ops.logits(x(e, s), w(e, s), a["softcap"])
    if op == "moe":
        from poot_core.cpu import moe

        return moe.bind(node, args, get)
    if op == "mla_attention":
        from poot_core.cpu import mla

        return mla.bind(node, args, get)
    raise Unsupported(Reason.OPERATION, op, "the cpu backend has no implementation for it")


def _dense(x: Any) -> torch.Tensor:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype != torch.float32 else x


class CpuExecutor:
    name = "cpu"

    def capabilities(self) -> Capabilities:
        from poot_core.checkpoint.quant import supported_kinds

        return Capabilities(CPU_OPS, DENSE_KINDS | frozenset(supported_kinds()))

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

    def memory(self) -> dict[str, int]:
        vm = psutil.virtual_memory()
        return {"total": int(vm.total), "free": int(vm.available)}
