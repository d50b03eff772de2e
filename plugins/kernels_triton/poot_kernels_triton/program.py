"""A prepared graph on a GPU: each node bound once to a Triton kernel call, then run as a plain loop.

Device-neutral: the same binding serves NVIDIA (CUDA) and AMD (ROCm, where torch calls the GPU "cuda" and
Triton compiles for HIP). Activations between matmuls are the weights' 16-bit dtype; the residual stream
(embed output and every add feeding it) is float32, as on the CPU executor. An add followed by an rms_norm
of its sum runs as one fused kernel, and linears that read one input through weights the device can join
run as one product (both found by poot_core.graph.passes). Steps of a few tokens per row (decode, speculative
verify) and paged steps of decode tokens only are captured as a CUDA graph (a HIP graph on ROCm, through the
same torch.cuda API) and replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import poot_kernels_triton as ktr
from poot_core import Graph, Node, PackedWeight, Reason, Ref, StepShape, Unsupported, WeightRef, check_positions
from poot_core.graph import passes

from . import collectives, host, images, moe, paged_recurrent, paged_step, recurrent
from .quant import embedding_rows
from .tuning import Tuning, use_tuning
from .weights import DeviceWeights

GATED = frozenset({"silu", "gelu_tanh"})  # the MLP's (and the experts' kernels')
GATE_ACTS = GATED | {"sigmoid"}  # the gated op's: also gated attention's output gate (Qwen3-Next)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}
ROPE_STYLES = frozenset({"neox", "interleaved"})
# contiguous steps of up to this many tokens a row (decode, a speculative verify step, the short tail of a
# prompt) read no input on the host, so they are replayed as CUDA graphs; above it, prefill attention takes
# each row's start position from the host
GRAPH_TOKENS = 16


def reads_host_starts(shape: StepShape) -> bool:
    """Whether a step's prefill attention takes its rows' start positions from the host: a contiguous step longer
    than GRAPH_TOKENS. A paged decode step of any width reads them on the device, through the block tables."""
    return shape.paging is None and shape.tokens > GRAPH_TOKENS


@dataclass
class Step:
    """What one run sees: device inputs, the state buffers and the values computed so far; `host`: every input
    as given (numpy) in eager steps, for the handlers that read them on the host (prefill and latent attention
    their start positions, the paged layout's attention its runs of sequences); empty in captured steps."""

    env: dict[str, Any]
    state: dict[str, torch.Tensor]
    host: dict[str, np.ndarray] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)


StepFn = Callable[[Step], None]
Feed = tuple[torch.Tensor, np.ndarray, np.ndarray]  # ids on the device, token slots, the ids' rows (run_fed)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Binder:
    """Turns graph nodes into step functions over one DeviceWeights: node X through `op_X` (the dispatch table
    of poot_core.graph.passes), with the shared fusions first."""

    def __init__(
        self, graph: Graph, weights: DeviceWeights, rope_tables: Callable[..., Any], backend: str = "cuda"
    ) -> None:
        self.backend = backend
        self.graph = graph
        self.w = weights
        self.act = weights.act_dtype
        self.rope_tables = rope_tables
        # set by a binding that reads device values on the host: such a step cannot be a CUDA graph
        self.host_syncs = False
        # checks of the step's host inputs that must hold before every run, captured or not (a captured replay
        # runs none of the bound steps)
        self.host_checks: list[Callable[[dict[str, np.ndarray]], None]] = []
        # values computed from stored weights alone, once at binding (a convolution's kernel seen as a matrix)
        self.constants: dict[str, torch.Tensor] = {}
        self.dispatch: passes.Dispatch[StepFn] = passes.Dispatch(self, backend)

    def weight(self, ref: Ref | None) -> Any:
        if ref is None:
            return None
        if ref.name in self.constants and not isinstance(ref, WeightRef):
            return self.constants[ref.name]
        if not isinstance(ref, WeightRef):
            raise Unsupported(Reason.OPERATION, ref.name, f"the {self.backend} backend expects a stored weight here")
        return self.w.tensors[ref.name]

    def bind_all(self) -> list[StepFn]:
        nodes = self.graph.nodes
        fused: dict[int, StepFn | None] = {}  # node index -> its fused step; None: computed by another one
        for i in passes.add_norm_pairs(nodes):
            fused[i], fused[i + 1] = self.add_rms_norm(nodes[i], nodes[i + 1]), None
        for group in passes.shared_input_linears(nodes):
            step = self.fused_linear([nodes[i] for i in group])
            if step is not None:  # one product where the first linear stands
                fused.update(dict.fromkeys(group[1:]))
                fused[group[0]] = step
        steps: list[StepFn] = []
        for i, node in enumerate(nodes):
            if i not in fused:
                steps.append(self.bind(node))
            elif (step := fused[i]) is not None:
                steps.append(step)
        return steps

    # --- fusions ---------------------------------------------------------------------------------------
    def fused_linear(self, group: list[Node]) -> StepFn | None:
        """One product over the joined weights of linears that read one input (q/k/v, gate/up); None when the
        device cannot join them (mixed layouts, GPTQ, different widths)."""
        names = tuple(str(passes.linear_weight(n)) for n in group)
        joined = self.w.concatenated(names)
        if joined is None:
            return None
        widths = [self.w.tensors[name].shape[0] for name in names]
        x_name = group[0].inputs[0].name
        outs = [(n.output, n.shape) for n in group]
        act = self.act

        def run(s: Step) -> None:
            x = _rows(s.env[x_name])
            if x.dtype != act:
                x = x.to(act)
            y = ktr.linear(x, joined)
            start = 0
            for (out, shape), width in zip(outs, widths, strict=True):
                s.env[out] = y[:, start : start + width].reshape(shape)
                start += width

        return run

    def add_rms_norm(self, add: Node, norm: Node) -> StepFn:
        a_name, b_name = (r.name for r in add.inputs)
        w = self.weight(norm.inputs[1])
        eps, offset = float(norm.attrs["eps"]), float(norm.attrs.get("offset", 0.0))
        act = self.act

        def run(s: Step) -> None:
            a, b = s.env[a_name], s.env[b_name]
            # the float32 operand is the residual stream; the sum keeps its dtype
            residual, x = (a, b) if a.dtype == torch.float32 or b.dtype != torch.float32 else (b, a)
            total, normed = ktr.add_rms_norm(_rows(x), _rows(residual), w, eps, weight_offset=offset, out_dtype=act)
            s.env[add.output] = total.reshape(add.shape)
            s.env[norm.output] = normed.reshape(norm.shape)

        return run

    # --- single nodes ----------------------------------------------------------------------------------
    def bind(self, node: Node) -> StepFn:
        return self.dispatch(node)

    def op_embed(self, node: Node) -> StepFn:
        tok_name, out, shape = node.inputs[1].name, node.output, node.shape
        if not isinstance(node.inputs[0], WeightRef) and node.inputs[0].name not in self.constants:
            return self._gather_rows(node)
        table = self.weight(node.inputs[0])
        scale = node.attrs.get("scale")
        if isinstance(table, PackedWeight):

            def rows(tokens: torch.Tensor) -> torch.Tensor:
                return embedding_rows(table, tokens)  # only the chosen rows, dequantized on the device
        else:

            def rows(tokens: torch.Tensor) -> torch.Tensor:
                return F.embedding(tokens, table).float()

        def run(s: Step) -> None:
            y = rows(s.env[tok_name].reshape(-1))
            if scale is not None:
                y = y * scale
            s.env[out] = y.reshape(shape)

        return run

    def _gather_rows(self, node: Node) -> StepFn:
        """embed over a value of the step (rows of a tower's output in another order: a pixel shuffle, windows
        of patches): the value's rows at the indices, in the value's dtype."""
        x_name, idx_name, out, shape = node.inputs[0].name, node.inputs[1].name, node.output, node.shape
        if node.attrs.get("scale") is not None:
            raise Unsupported(Reason.OPERATION, "scaled embed of a value", f"the {self.backend} backend")

        def run(s: Step) -> None:
            s.env[out] = _rows(s.env[x_name]).index_select(0, s.env[idx_name].reshape(-1)).reshape(shape)

        return run

    def op_rms_norm(self, node: Node) -> StepFn:
        x_name, out, shape = node.inputs[0].name, node.output, node.shape
        w = self.weight(node.inputs[1])
        eps, offset, act = float(node.attrs["eps"]), float(node.attrs.get("offset", 0.0)), self.act

        def run(s: Step) -> None:
            _, normed = ktr.add_rms_norm(_rows(s.env[x_name]), None, w, eps, weight_offset=offset, out_dtype=act)
            s.env[out] = normed.reshape(shape)

        return run

    def op_linear(self, node: Node) -> StepFn:
        x_name, out, shape = node.inputs[0].name, node.output, node.shape
        w, b = self.weight(node.inputs[1]), self.weight(node.inputs[2])
        act = self.act

        def run(s: Step) -> None:
            x = _rows(s.env[x_name])
            if x.dtype != act:
                x = x.to(act)
            s.env[out] = ktr.linear(x, w, b).reshape(shape)

        return run

    def op_logits(self, node: Node) -> StepFn:
        x_name, out, shape = node.inputs[0].name, node.output, node.shape
        w = self.weight(node.inputs[1])
        softcap, act = node.attrs.get("softcap"), self.act

        def run(s: Step) -> None:
            x = _rows(s.env[x_name])
            if x.dtype != act:
                x = x.to(act)
            y = ktr.linear(x, w, out_dtype=torch.float32)
            if softcap is not None:
                y = torch.tanh(y / softcap) * softcap
            s.env[out] = y.reshape(shape)

        return run

    def op_reshape(self, node: Node) -> StepFn:
        x_name, out, shape = node.inputs[0].name, node.output, node.shape
        if isinstance(node.inputs[0], WeightRef):  # a stored weight seen in another shape: done once, here
            w = self.weight(node.inputs[0])
            if isinstance(w, PackedWeight):
                raise Unsupported(Reason.QUANTIZATION, f"{w.kind} {x_name} reshaped", "dense only")
            constant = self.constants[out] = w.reshape(shape)

            def run_constant(s: Step) -> None:
                s.env[out] = constant

            return run_constant

        def run(s: Step) -> None:
            s.env[out] = s.env[x_name].reshape(shape)

        return run

    def op_rope(self, node: Node) -> StepFn:
        a = node.attrs
        if a["style"] not in ROPE_STYLES:
            raise Unsupported(Reason.OPERATION, f"rope:{a['style']}", f"rope styles {sorted(ROPE_STYLES)}")
        cos, sin = self.rope_tables(a["theta"], a["dim"], a.get("scaling") or {}, self.graph.shape.capacity)
        x_name, pos_name, out, shape = node.inputs[0].name, node.inputs[1].name, node.output, node.shape
        interleaved = a["style"] == "interleaved"

        def run(s: Step) -> None:
            x = s.env[x_name]
            flat = x.reshape(-1, x.shape[-2], x.shape[-1])
            y = ktr.rotate(flat, s.env[pos_name].reshape(-1), cos, sin, interleaved=interleaved, inplace=False)
            s.env[out] = y.reshape(shape)

        return run

    def op_attention(self, node: Node) -> StepFn:
        if node.input(6) is not None:  # a paged step: the caches are pools of blocks
            decode_only = self.graph.shape.paging is not None and self.graph.shape.paging.decode
            return paged_step.bind_attention(node, decode_only)  # nothing read on the host
        q_name, k_name, v_name, pos_name, kc_key, vc_key = (r.name for r in node.inputs)
        a = node.attrs
        scale, window, softcap = float(a["scale"]), a.get("window"), a.get("softcap")
        rows, tokens = self.graph.shape.rows, self.graph.shape.tokens
        out, shape = node.output, node.shape

        def run(s: Step) -> None:
            q, k, v, pos = s.env[q_name], s.env[k_name], s.env[v_name], s.env[pos_name]
            kc, vc = s.state[kc_key], s.state[vc_key]
            if q.dtype != kc.dtype:  # float32 queries of a rope by sections (M-RoPE) meet the cache's dtype
                q = q.to(kc.dtype)
            for r in range(rows):
                ktr.write_kv(k[r], v[r], kc[r], vc[r], pos[r])
            if tokens == 1:
                lens = s.cache.get("kv_lens")
                if lens is None:
                    lens = s.cache["kv_lens"] = pos[:, 0] + 1
                o = ktr.decode_attention(q[:, 0], kc, vc, lens, scale=scale, window=window, softcap=softcap)
                s.env[out] = o.reshape(shape)
                return
            if tokens <= GRAPH_TOKENS:
                s.env[out] = paged_step.few_tokens_attention(q, kc, vc, pos, s.cache, scale=scale, window=window,
                                                             softcap=softcap).reshape(shape)
                return
            outs = []
            for r in range(rows):
                start = int(s.host["positions"][r, 0])
                outs.append(
                    ktr.prefill_attention(q[r], kc[r], vc[r], start, scale=scale, window=window, softcap=softcap)
                )
            s.env[out] = torch.stack(outs).reshape(shape)

        return run

    def op_gated(self, node: Node) -> StepFn:
        act = node.attrs["act"]
        if act not in GATE_ACTS:
            raise Unsupported(
                Reason.OPERATION, f"gated:{act}", f"the {self.backend} backend's gated kernel does {sorted(GATE_ACTS)}"
            )
        g_name, u_name, out, shape = node.inputs[0].name, node.inputs[1].name, node.output, node.shape

        def run(s: Step) -> None:
            s.env[out] = ktr.gated_activation(_rows(s.env[g_name]), _rows(s.env[u_name]), kind=act).reshape(shape)

        return run

    def op_activation(self, node: Node) -> StepFn:
        act = node.attrs["act"]
        fn = ACTIVATIONS.get(act)
        if fn is None:
            raise Unsupported(Reason.OPERATION, f"activation:{act}", f"known: {sorted(ACTIVATIONS)}")
        x_name, out = node.inputs[0].name, node.output

        def run(s: Step) -> None:
            s.env[out] = fn(s.env[x_name])

        return run

    def _binary(self, node: Node, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> StepFn:
        a_name, b_ref, out = node.inputs[0].name, node.inputs[1], node.output
        b_name, b_weight = b_ref.name, self.weight(b_ref) if isinstance(b_ref, WeightRef) else None
        if isinstance(b_weight, PackedWeight):
            raise Unsupported(Reason.QUANTIZATION, f"{b_weight.kind} operand of {node.op}", "dense only")

        def run(s: Step) -> None:
            b = b_weight if b_weight is not None else s.env[b_name]
            s.env[out] = fn(s.env[a_name].float(), b.float())

        return run

    def op_add(self, node: Node) -> StepFn:
        return self._binary(node, torch.add)

    def op_mul(self, node: Node) -> StepFn:
        return self._binary(node, torch.mul)

    def op_scale(self, node: Node) -> StepFn:
        x_name, out, factor = node.inputs[0].name, node.output, float(node.attrs["factor"])

        def run(s: Step) -> None:
            s.env[out] = s.env[x_name] * factor

        return run

    def op_last_position(self, node: Node) -> StepFn:
        x_name, out = node.inputs[0].name, node.output
        if node.input(1) is not None:  # a paged step: the token whose logits each sequence slot reads
            index_name = node.inputs[1].name

            def run_paged(s: Step) -> None:
                s.env[out] = s.env[x_name][:, s.env[index_name]]

            return run_paged

        def run(s: Step) -> None:
            s.env[out] = s.env[x_name][:, -1:, :]

        return run

    # --- recurrent layers (poot-family-hybrid): kernels in recurrent.py, state float32 on the device -------
    def _small(self, node: Node, index: int) -> torch.Tensor | None:
        """A small stored weight of `node` (a conv kernel, a per-head vector) in float32, widened once here."""
        w = self.weight(node.inputs[index])
        if isinstance(w, PackedWeight):
            raise Unsupported(Reason.QUANTIZATION, f"{w.kind} {node.inputs[index].name} of {node.op}",
                              f"the {self.backend} backend reads it dense")
        return None if w is None else w.float().contiguous()

    def op_slice(self, node: Node) -> StepFn:
        x_name, out = node.inputs[0].name, node.output
        start, stop = int(node.attrs["start"]), int(node.attrs["stop"])

        def run(s: Step) -> None:
            s.env[out] = s.env[x_name][..., start:stop]  # a view: the kernels read strided rows

        return run

    def _paged(self, node: Node, state_index: int, values: list[str], compute: paged_recurrent.Compute) -> StepFn:
        """A paged step's recurrent op over the state slots (paged_recurrent.py): decode tokens in one launch."""
        decode_only = self.graph.shape.paging is not None and self.graph.shape.paging.decode
        self.host_syncs = self.host_syncs or not decode_only  # a mixed step's runs are found on the host
        return paged_recurrent.bind(node, state_index, values, compute, decode_only)

    def op_short_conv(self, node: Node) -> StepFn:
        act = node.attrs.get("act")
        if act not in (None, "silu"):
            raise Unsupported(Reason.OPERATION, f"short_conv:{act}", "activations: none or silu")
        x_name, window, out = node.inputs[0].name, node.inputs[3].name, node.output
        w, b = self._small(node, 1), self._small(node, 2)
        w = w.reshape(w.shape[0], w.shape[-1])  # Hugging Face's Conv1d stores [C, 1, K]
        if paged_recurrent.is_paged(node, 3):
            silu = act == "silu"
            return self._paged(node, 3, [x_name], lambda v, st, rows: recurrent.short_conv(v[0], w, b, st, silu=silu,
                                                                                           paged=rows))

        def run(s: Step) -> None:
            s.env[out] = recurrent.short_conv(s.env[x_name], w, b, s.state[window], silu=act == "silu")

        return run

    def op_ssm_scan(self, node: Node) -> StepFn:
        x_name, dt_name, b_name, c_name = (node.inputs[i].name for i in (0, 1, 3, 4))
        a_log, d, dt_bias = (self._small(node, i).reshape(-1) for i in (2, 5, 6))  # GGUF: A and D are [H, 1]
        state, out, limit = node.inputs[7].name, node.output, tuple(node.attrs["dt_limit"])
        if paged_recurrent.is_paged(node, 7):
            return self._paged(node, 7, [x_name, dt_name, b_name, c_name], lambda v, st, rows: recurrent.ssm_scan(
                v[0], v[1], a_log, v[2], v[3], d, dt_bias, st, limit, paged=rows))

        def run(s: Step) -> None:
            e = s.env
            s.env[out] = recurrent.ssm_scan(e[x_name], e[dt_name], a_log, e[b_name], e[c_name], d, dt_bias,
                                            s.state[state], limit)

        return run

    def op_gated_delta(self, node: Node) -> StepFn:
        names = [r.name for r in node.inputs[:5]]  # q, k, v, a, b
        a_log, dt_bias = (self._small(node, i).reshape(-1) for i in (5, 6))
        state, out, eps = node.inputs[7].name, node.output, float(node.attrs["eps"])
        if paged_recurrent.is_paged(node, 7):
            return self._paged(node, 7, names, lambda t, st, rows: recurrent.gated_delta(*t, a_log, dt_bias, st, eps,
                                                                                         paged=rows))

        def run(s: Step) -> None:
            q, k, v, a, b = (s.env[n] for n in names)
            s.env[out] = recurrent.gated_delta(q, k, v, a, b, a_log, dt_bias, s.state[state], eps)

        return run

    def op_gated_rms_norm(self, node: Node) -> StepFn:
        x_name, gate_name, out, shape = node.inputs[0].name, node.inputs[1].name, node.output, node.shape
        w = self._small(node, 2).reshape(-1)  # GGUF stores it [groups, group]
        eps, group, first = float(node.attrs["eps"]), int(node.attrs["group"]), bool(node.attrs.get("norm_first"))
        act = self.act

        def run(s: Step) -> None:
            y = recurrent.gated_rms_norm(_rows(s.env[x_name]), _rows(s.env[gate_name]), w, eps, group, first, act)
            s.env[out] = y.reshape(shape)

        return run

    # --- mixture of experts, latent attention, encoders -------------------------------------------------
    def _value_or_weight(self, ref: Ref | None) -> Callable[[Step], Any]:
        """An optional input that is either a stored weight or a value computed earlier in the step."""
        if ref is None:
            return lambda s: None
        if isinstance(ref, WeightRef):
            w = self.weight(ref)
            return lambda s: w
        name = ref.name
        return lambda s: s.env[name]

    def op_moe(self, node: Node) -> StepFn:
        a = node.attrs
        needed = ("experts", "stacked", "top_k", "scoring", "norm_topk", "routed_scale", "groups", "act")
        if len(node.inputs) < 6 or any(k not in a for k in needed):
            raise Unsupported(Reason.OPERATION, "moe", "malformed moe node: inputs or attributes are missing")
        if a["scoring"] not in ("softmax", "sigmoid") or a.get("group_score", "max") not in ("max", "top2"):
            raise Unsupported(Reason.OPERATION, f"moe scoring {a['scoring']}/{a.get('group_score')}", self.backend)
        if a["act"] not in GATED:
            raise Unsupported(Reason.OPERATION, f"moe:{a['act']}", f"the gated kernel does {sorted(GATED)}")
        attrs = {"group_score": "max", "topk_groups": 1, **a}
        x_name, out, shape, act = node.inputs[0].name, node.output, node.shape, self.act
        router = self.weight(node.inputs[1])
        bias = self.weight(node.inputs[2]) if node.inputs[2] else None
        shared = self._value_or_weight(node.inputs[3])
        gate = self.weight(node.inputs[4]) if node.inputs[4] else None
        if isinstance(gate, torch.Tensor) and gate.dim() == 1:  # some files store the shared gate as [D]
            gate = gate.view(1, -1)
        experts = moe.experts_of([self.weight(n) for n in node.inputs[5:]], int(a["experts"]), bool(a["stacked"]))
        tokens = self.graph.shape.rows * self.graph.shape.tokens
        fused = None
        if tokens <= moe.FUSED_MAX_TOKENS and moe.FusedExperts.suits(experts):
            fused = moe.FusedExperts(experts)  # decode: every chosen expert at once, nothing read on the host
        else:
            self.host_syncs = True  # grouped by expert: the counts per expert cross to the host

        def run(s: Step) -> None:
            x = _rows(s.env[x_name])
            if x.dtype != act:
                x = x.to(act)
            logits = moe.router_logits(x, router)
            # with a correction bias the torch ops choose; else one kernel where the routing is plain top-k
            ids, weights = moe.choose_experts(logits, bias, attrs) if bias is not None else moe.route(logits, attrs)
            if fused is not None:
                y = fused.run(x, ids, weights, attrs["act"])
            else:
                y = moe.run_experts(x, ids, weights, experts, attrs["act"])
            extra = shared(s)
            if extra is not None:
                extra = _rows(extra).float()
                if gate is not None:
                    extra = extra * torch.sigmoid(ktr.linear(x, gate, out_dtype=torch.float32))
                y = y + extra
            s.env[out] = y.reshape(shape)

        return run

    def op_mla_attention(self, node: Node) -> StepFn:
        """The expanded form: the cache holds the normed latent and the rotated rope key per token; each
        step expands the cached latent with kv_b through `linear` into per-head keys and values, then runs
        the flash-attention kernel per row. Reads the rows' start positions on the host (no CUDA graph)."""
        if node.input(6) is not None:
            raise Unsupported(Reason.SHAPE, "mla_attention in a paged step",
                              f"the {self.backend} backend has no paged latent attention; serve with "
                              "Layout.CONTIGUOUS or on the CPU backend")
        self.host_syncs = True  # reads each row's start or length on the host
        a = node.attrs
        if a["style"] not in ROPE_STYLES:
            raise Unsupported(Reason.OPERATION, f"rope:{a['style']}", f"rope styles {sorted(ROPE_STYLES)}")
        q_name, kv_name, pos_name = (r.name for r in node.inputs[:3])
        norm_w, kv_b, cache_key = self.weight(node.inputs[3]), self.weight(node.inputs[4]), node.inputs[5].name
        dn, dr, dv, eps, scale = int(a["nope_dim"]), int(a["rope_dim"]), int(a["v_dim"]), float(a["eps"]), a["scale"]
        scaling = a.get("scaling") or {}
        cos, sin = self.rope_tables(a["theta"], dr, scaling, self.graph.shape.capacity)  # YaRN factor applied
        interleaved = a["style"] == "interleaved"
        rows, tokens, heads = node.shape[0], node.shape[1], node.shape[2]
        width = max(dn + dr, dv)  # keys and values padded with zeros to one head size for the kernel
        out, shape, act = node.output, node.shape, self.act

        def run(s: Step) -> None:
            q, kv, pos = s.env[q_name], s.env[kv_name], s.env[pos_name].reshape(-1)
            cache = s.state[cache_key]
            latent_dim = kv.shape[-1] - dr
            q = q.reshape(-1, heads, dn + dr).to(act)
            q_rot = ktr.rotate(q[..., dn:].contiguous(), pos, cos, sin, interleaved=interleaved, inplace=False)
            kv_rows = _rows(kv)
            _, latent = ktr.add_rms_norm(kv_rows[:, :latent_dim].contiguous(), None, norm_w, eps, out_dtype=cache.dtype)
            k_rot = ktr.rotate(
                kv_rows[:, None, latent_dim:].to(act).contiguous(), pos, cos, sin, interleaved=interleaved,
                inplace=False,
            )[:, 0]  # fmt: skip
            query = F.pad(torch.cat((q[..., :dn], q_rot), dim=-1), (0, width - dn - dr))
            query = query.view(rows, tokens, heads, width)
            latent, k_rot = latent.view(rows, tokens, latent_dim), k_rot.view(rows, tokens, dr)
            outs = []
            for r in range(rows):
                start = int(s.host["positions"][r, 0])
                end = start + tokens
                cache[r, 0, start:end, :latent_dim] = latent[r]
                cache[r, 0, start:end, latent_dim:] = k_rot[r].to(cache.dtype)
                kept = cache[r, 0, :end]
                expanded = ktr.linear(kept[:, :latent_dim].to(act), kv_b).view(end, heads, dn + dv)
                rot = kept[:, None, latent_dim:].to(expanded.dtype).expand(end, heads, dr)
                keys = F.pad(torch.cat((expanded[..., :dn], rot), dim=-1), (0, width - dn - dr))
                values = F.pad(expanded[..., dn:], (0, width - dv))
                o = ktr.prefill_attention(
                    query[r].to(keys.dtype).contiguous(), keys.transpose(0, 1).contiguous(),
                    values.transpose(0, 1).contiguous(), start, scale=float(scale),
                )  # fmt: skip
                outs.append(o[..., :dv])
            s.env[out] = torch.stack(outs).reshape(shape)

        return run

    def op_encoder_attention(self, node: Node) -> StepFn:
        """Bidirectional attention over each row's real tokens (the mask's ones), every row in one call of
        torch's attention with the mask. Nothing is read on the host, so a step of it (a vision tower, an
        encoder) can be captured as a CUDA graph: one launch a layer instead of one a row and a host read of
        the rows' lengths. A row of padding only attends to its first key (its output is unused; a row with no
        key would be NaN)."""
        q_name, k_name, v_name, mask_name = (r.name for r in node.inputs)
        scale, out, shape, act = float(node.attrs["scale"]), node.output, node.shape, self.act

        def run(s: Step) -> None:
            # in one dtype for the kernel (the float32 queries and keys of a rope by sections meet 16-bit values)
            q, k, v = (s.env[n].to(act) for n in (q_name, k_name, v_name))
            allowed = s.env[mask_name].reshape(q.shape[0], -1) != 0  # a new tensor: written below
            allowed[:, 0] |= ~allowed.any(dim=1)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None, None, :],
                scale=scale, enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)  # fmt: skip
            s.env[out] = o.reshape(shape)

        return run

    # --- steps with images (poot-family-vision): images.py ---------------------------------------------
    def op_splice(self, node: Node) -> StepFn:
        self.host_checks.append(images.splice_check(node))
        return images.bind_splice(node)

    def op_group_attention(self, node: Node) -> StepFn:
        if node.input(7) is not None:  # a paged step: a run of a sequence holding a group sees it both ways
            decode_only = self.graph.shape.paging is not None and self.graph.shape.paging.decode
            return paged_step.bind_attention(node, decode_only, grouped=True)
        # contiguous: the key limits are made on the device and the groups checked on the host before each run;
        # the rows' starts are read on the host, which only a longer step fixes at its capture
        self.host_checks.append(images.group_check(node))
        self.host_syncs = self.host_syncs or not reads_host_starts(self.graph.shape)
        return images.bind_group_attention(node)

    def op_layer_norm(self, node: Node) -> StepFn:
        """Plain torch layer norm in float32, output float32 as on the CPU executor: in post-norm encoders
        its output is the residual stream."""
        x_name, out, shape = node.inputs[0].name, node.output, node.shape
        w = self.weight(node.inputs[1])
        b = self.weight(node.inputs[2]) if node.inputs[2] else None
        eps = float(node.attrs["eps"])
        w32, b32 = w.float(), None if b is None else b.float()

        def run(s: Step) -> None:
            x = s.env[x_name].float()
            s.env[out] = F.layer_norm(x, (x.shape[-1],), w32, b32, eps).reshape(shape)

        return run

    # --- placed steps (poot_core.distributed): collectives.py ------------------------------------------
    def op_all_reduce(self, node: Node) -> StepFn:
        run, reads_host = collectives.bind_all_reduce(node)
        self.host_syncs |= reads_host
        return run

    def op_all_gather(self, node: Node) -> StepFn:
        run, reads_host = collectives.bind_all_gather(node)
        self.host_syncs |= reads_host
        return run


class TritonProgram:
    """Runs the bound steps. A step of up to GRAPH_TOKENS tokens a row (or a paged step of decode tokens only)
    is captured at its second run (per state object) as a CUDA graph whose inputs are copied into one fixed
    device buffer before each replay; so is a longer step its shape marks `replayed`, whose prefill attention
    reads the rows' start positions on the host: those are fixed at the capture, and a run from other starts
    runs eagerly. `checks` run on the host inputs before every run. With a `tuning`, every launch (eager or
    captured) uses that target's tiles instead of the ones the device would pick."""

    def __init__(
        self, graph: Graph, steps: list[StepFn], device: torch.device, use_graph: bool, tuning: Tuning | None = None,
        checks: Sequence[Callable[[dict[str, np.ndarray]], None]] = (),
    ) -> None:
        self.tuning = tuning
        self.checks = tuple(checks)
        self._starts: np.ndarray | None = None  # the rows' start positions a captured longer step was made for
        self.graph = graph
        self.steps = steps
        self.device = device
        self.use_graph = use_graph
        self.input_names = sorted(graph.inputs)
        # float32 inputs (pixels, image features, rope masks); the others are int64
        self._floats = frozenset(n for n in self.input_names if graph.inputs[n].dtype == "f32")
        # (input, start, end) of each input in the one flat int64 buffer a captured step's inputs are copied
        # through; a float32 input lies there as its bits, two values a word
        self._spans: list[tuple[str, int, int]] = []
        for name in self.input_names:
            start = self._spans[-1][2] if self._spans else 0
            size = int(np.prod(graph.inputs[name].shape))
            self._spans.append((name, start, start + (-(-size // 2) if name in self._floats else size)))
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._ran_once = False
        self._graph_state: Any = None
        self._static_in: torch.Tensor | None = None
        self._host_in: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._outputs: list[torch.Tensor] = []

    def _eager(
        self, state: dict[str, torch.Tensor], env: dict[str, Any], host: dict[str, np.ndarray] | None = None
    ) -> list[Any]:
        step = Step(env, state, host or {})
        for fn in self.steps:
            fn(step)
        return [step.env[name] for name in self.graph.outputs]

    def _device_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise Unsupported(Reason.SHAPE, f"inputs {missing}", "the step needs them")
        # through pinned memory, not waiting for the device (host.py): the step before may still run
        return {n: self._float_input(inputs[n]) if n in self._floats else host.to_device(inputs[n], self.device)
                for n in self.input_names}

    def _float_input(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(self.device)

    def _span(self, buffer: torch.Tensor, name: str, start: int, end: int) -> torch.Tensor:
        """Input `name` as it lies in a flat int64 buffer of the spans, flat in its own dtype."""
        if name not in self._floats:
            return buffer[start:end]
        return buffer[start:end].view(torch.float32)[: int(np.prod(self.graph.inputs[name].shape))]

    def _feed(self, tokens: torch.Tensor, feed: Feed) -> None:
        """tokens (flat, on the device)[at[i]] = ids[rows[i]]: ids a step before computed on the device."""
        ids, at, rows = feed
        tokens[host.to_device(at, self.device)] = ids[host.to_device(rows, self.device)].to(tokens.dtype)

    def _fed_inputs(self, inputs: dict[str, np.ndarray], feed: Feed | None) -> dict[str, Any]:
        env: dict[str, Any] = dict(self._device_inputs(inputs))
        if feed is not None:
            env["tokens"] = env["tokens"].clone()  # on the CPU a view of the caller's array
            self._feed(env["tokens"].view(-1), feed)
        return env

    def run(self, state: dict[str, torch.Tensor], inputs: dict[str, np.ndarray], feed: Feed | None = None) -> list[Any]:
        """feed (ids, at, rows): tokens[0, at[i]] = ids[rows[i]] on the device before the step runs (the
        executor's run_fed)."""
        check_positions(self.graph, inputs)  # the KV write kernels index the cache by position, unchecked
        for check in self.checks:
            check(inputs)
        tuned = use_tuning(self.tuning) if self.tuning is not None else contextlib.nullcontext()
        with torch.inference_mode(), tuned:
            if not self.use_graph or not self._same_starts(inputs):
                return self._eager(state, self._fed_inputs(inputs, feed), inputs)
            if self._cuda_graph is None or self._graph_state is not state:
                if not self._ran_once:  # a shape run once (a short prompt's prefill) is not worth a capture
                    self._ran_once = True
                    return self._eager(state, self._fed_inputs(inputs, feed), inputs)
                self._capture(state, inputs, feed)
            self._load_inputs(inputs, feed)
            self._cuda_graph.replay()
            # a copy, so an output survives the next replay (a few microseconds for one row of logits)
            return [o.clone() for o in self._outputs]

    def _same_starts(self, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a captured longer step (if any) was made for these rows' start positions."""
        return self._starts is None or np.array_equal(np.asarray(inputs["positions"])[:, 0], self._starts)

    def _load_inputs(self, inputs: dict[str, np.ndarray], feed: Feed | None = None) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer may still be in flight from the last step
        for name, start, end in self._spans:
            dtype = np.float32 if name in self._floats else np.int64
            self._span(self._host_in, name, start, end).copy_(
                torch.from_numpy(np.asarray(inputs[name], dtype=dtype).reshape(-1)))
        self._static_in.copy_(self._host_in, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        if feed is not None:  # after the copy, in stream order
            start, end = next((a, b) for name, a, b in self._spans if name == "tokens")
            self._feed(self._static_in[start:end], feed)

    def _capture(self, state: dict[str, torch.Tensor], inputs: dict[str, np.ndarray], feed: Feed | None) -> None:
        spans = self._spans
        total = spans[-1][2]
        self._static_in = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._host_in = torch.zeros(total, dtype=torch.int64).pin_memory()
        self._load_inputs(inputs, feed)
        env = {n: self._span(self._static_in, n, a, b).reshape(self.graph.inputs[n].shape) for n, a, b in spans}
        # the first runs compile the kernels and settle the allocator, outside the capture; they write
        # the same K/V the replay will write again, so running them is harmless; recurrent state (which they
        # would advance) is put back as it was
        kept = {name: state[name].clone() for name, spec in self.graph.state.items() if spec.recurrent}
        # a longer step's prefill attention reads the rows' start positions on the host, so they are fixed
        # at the capture (run() replays only for the same starts)
        host_in = inputs if reads_host_starts(self.graph.shape) else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager(state, dict(env), host_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for name, saved in kept.items():
            state[name].copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._outputs = self._eager(state, dict(env), host_in)
        self._cuda_graph = graph
        self._graph_state = state
        if host_in is not None and "positions" in inputs:
            self._starts = np.asarray(inputs["positions"])[:, 0].copy()
