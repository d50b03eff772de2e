"""The tracer: a family writes its forward once against these methods; each call records one node.

The ops and their inputs are listed once, in `passes.OPS`; a method here is the family-facing spelling of one.
"""

from __future__ import annotations

from typing import Any

from poot_core.errors import Reason, Unsupported
from poot_core.graph.ir import RECURRENT_KINDS, Graph, Node, StateRef, StateSpec, StepShape, Value, ValueRef, WeightRef


class Tracer:
    """Records ops into a Graph. Families call these methods with Values and get Values back."""

    def __init__(self, shape: StepShape, weight_shapes: dict[str, tuple[int, ...]]) -> None:
        self.graph = Graph(shape)
        self._weight_shapes = weight_shapes
        self._count = 0

    # --- leaves ---------------------------------------------------------------------------------------
    def input(self, name: str, shape: tuple[int, ...], dtype: str = "i64") -> Value:
        value = Value(ValueRef(name), shape, dtype)
        self.graph.inputs[name] = value
        return value

    def weight(self, name: str) -> Value:
        """A stored weight by the name the family reads. Unknown names fail at trace time."""
        shape = self._weight_shapes.get(name)
        if shape is None:
            raise KeyError(name)
        self.graph.weights[name] = shape
        return Value(WeightRef(name), shape, "weight")

    def has_weight(self, name: str) -> bool:
        return name in self._weight_shapes

    def optional_weight(self, name: str) -> Value | None:
        """The weight when the checkpoint has it (a bias, an optional norm), else None."""
        return self.weight(name) if self.has_weight(name) else None

    def state(self, name: str, shape: tuple[int, ...], kind: str) -> Value:
        paging = self.graph.shape.paging
        if kind in RECURRENT_KINDS and paging is not None:  # a pool of slots, one per running sequence
            if paging.state_slots < 1:
                raise Unsupported(Reason.SHAPE, f"{kind} state {name} in a paged step",
                                  "the step has no recurrent state slots (Paging.state_slots)")
            shape = (paging.state_slots, *shape[1:])
        self.graph.state[name] = StateSpec(name, shape, kind)
        return Value(StateRef(name), shape, "state")

    def output(self, value: Value) -> None:
        self.graph.outputs.append(value.name)

    # --- ops ------------------------------------------------------------------------------------------
    def op(self, op: str, inputs: tuple[Value | None, ...], shape: tuple[int, ...], **attrs: Any) -> Value:
        """Record one node. `None` inputs (an absent bias) stay None."""
        self._count += 1
        out = f"{op}{self._count}"
        refs = tuple(None if v is None else v.ref for v in inputs)
        self.graph.nodes.append(Node(op, refs, out, shape, dict(attrs)))
        return Value(ValueRef(out), shape)

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

    def attention(self, q: Value, k: Value, v: Value, positions: Value, *, layer: int, scale: float,
                  window: int | None = None, softcap: float | None = None, capacity: int | None = None,
                  groups: Value | None = None) -> Value:
        """Causal attention through the layer's KV state: k, v [R, T, Hkv, Dh] of the new tokens are
        written at `positions`, then every query attends to the positions up to its own
        (and within `window` of it, when set). The state holds `capacity` positions, the step's by default.
        With `groups` [R, T] (a group id per new token, -1 for none) a query also sees the step's later tokens
        of its own group (an image's tokens attend to each other both ways): the `group_attention` op, a group
        lying whole in one step (in a paged step, in one sequence's run of tokens)."""
        capacity = self.graph.shape.capacity if capacity is None else capacity
        rows, _, kv_heads, head_dim = k.shape
        # paged: the state is the layer's pool of blocks, one row per block
        slots, positions_kept = self._kv_rows(rows, capacity)
        kc = self.state(f"k{layer}", (slots, kv_heads, positions_kept, head_dim), "k")
        vc = self.state(f"v{layer}", (slots, kv_heads, positions_kept, v.shape[-1]), "v")
        shape = (*q.shape[:3], v.shape[-1])
        if groups is not None:
            return self.op("group_attention", (q, k, v, positions, kc, vc, groups, *self._paged_inputs()), shape,
                           layer=layer, scale=scale, window=window, softcap=softcap)
        return self.op("attention", (q, k, v, positions, kc, vc, *self._paged_inputs()), shape, layer=layer,
                       scale=scale, window=window, softcap=softcap)

    def _kv_rows(self, rows: int, capacity: int) -> tuple[int, int]:
        """(leading size, positions) of a KV state buffer: rows x capacity, or blocks x block_size when paged."""
        paging = self.graph.shape.paging
        return (rows, capacity) if paging is None else (paging.blocks, paging.block_size)

    def _paged_inputs(self) -> tuple[Value, ...]:
        """The inputs a paged step's attention reads besides the contiguous ones (none when not paged)."""
        paging = self.graph.shape.paging
        if paging is None:
            return ()
        return (self.input("seq_index", (self.graph.shape.tokens,)),
                self.input("block_tables", (paging.seqs, paging.max_blocks)))

    def _slot_inputs(self) -> tuple[Value, ...]:
        """The inputs a paged step's recurrent op reads besides its state (none when not paged): each token's
        position (a run from position 0 starts its slot from zeros), sequence slot, and each sequence's state
        slot (Paging.state_slots)."""
        paging = self.graph.shape.paging
        if paging is None:
            return ()
        tokens = self.graph.shape.tokens
        return (self.input("positions", (1, tokens)), self.input("seq_index", (tokens,)),
                self.input("state_slots", (paging.seqs,)))

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
        paging = self.graph.shape.paging
        if paging is not None:  # one token per sequence slot of the flat step
            index = self.input("logit_index", (paging.seqs,))
            return self.op("last_position", (x, index), (1, paging.seqs, x.shape[-1]))
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
        hidden = x
        if not shape.all_logits:
            x = self.last_position(x)
        self.output(self.logits(x, head, softcap))
        if shape.carry_hidden:
            self.output(hidden)

    def splice(self, x: Value, features: Value, index: Value) -> Value:
        """x [R, T, D] with its flattened rows index [N] replaced by features [N, D] (image tokens)."""
        return self.op("splice", (x, features, index), x.shape)

    # --- mixture of experts and latent attention (poot-family-moe) ----------------------------------------
    def moe(self, x: Value, router: Value, experts: tuple[Value, Value, Value] | list[tuple[Value, Value, Value]],
            *, top_k: int, scoring: str = "softmax", norm_topk: bool = True, routed_scale: float = 1.0,
            groups: int = 1, topk_groups: int = 1, group_score: str = "max", bias: Value | None = None,
            shared: Value | None = None, shared_gate: Value | None = None, act: str = "silu") -> Value:
        """Route each token of x [R, T, D] to `top_k` experts and sum their gated MLPs, weighted.

        router [E, D]: scores = softmax or sigmoid of x @ router^T (float32). `bias` [E] is added for the
        choice only (DeepSeek V3's correction bias); with groups > 1 the experts are split into `groups`
        groups, each scored by its best expert ("max") or the sum of its two best ("top2"), and only the
        `topk_groups` best groups are eligible. Chosen weights are renormalized when `norm_topk`, then
        multiplied by `routed_scale`.
        experts: stacked (gate [E, F, D], up [E, F, D], down [E, D, F]) as GGUF stores them, or a list of
        (gate [F, D], up [F, D], down [D, F]) per expert as Hugging Face stores them; either may be packed.
        shared: an already computed shared-expert output [R, T, D] added to the result, scaled by
        sigmoid(x @ shared_gate^T) when shared_gate [1, D] is given (Qwen2-MoE)."""
        stacked = isinstance(experts, tuple)
        weights = list(experts) if stacked else [w for triple in experts for w in triple]
        count = experts[0].shape[0] if stacked else len(experts)
        return self.op("moe", (x, router, bias, shared, shared_gate, *weights), x.shape, experts=count,
                       stacked=stacked, top_k=top_k, scoring=scoring, norm_topk=norm_topk,
                       routed_scale=routed_scale, groups=groups, topk_groups=topk_groups,
                       group_score=group_score, act=act)

    def mla_attention(self, q: Value, kv: Value, positions: Value, kv_norm: Value, kv_b: Value, *, layer: int,
                      scale: float, nope_dim: int, rope_dim: int, v_dim: int, eps: float, theta: float,
                      style: str = "interleaved", scaling: dict[str, Any] | None = None,
                      capacity: int | None = None) -> Value:
        """Multi-head latent attention (DeepSeek V2/V3), causal, through the layer's compressed KV state.

        q [R, T, H, nope_dim + rope_dim] (before rope); kv [R, T, L + rope_dim]: the kv_a projection, whose
        first L features are the latent (RMS-normed here with kv_norm [L]) and the rest the rope key shared by
        all heads (rotated here). The state keeps latent and rotated key, [R, 1, C, L + rope_dim]: that is
        all the cache holds per token. kv_b [H * (nope_dim + v_dim), L] expands the latent to each head's
        key (no rope part) and value. Output [R, T, H, v_dim]."""
        capacity = self.graph.shape.capacity if capacity is None else capacity
        rows, tokens, heads, _ = q.shape
        width = kv.shape[-1]
        slots, positions_kept = self._kv_rows(rows, capacity)
        cache = self.state(f"latent{layer}", (slots, 1, positions_kept, width), "latent")
        return self.op("mla_attention", (q, kv, positions, kv_norm, kv_b, cache, *self._paged_inputs()),
                       (rows, tokens, heads, v_dim),
                       layer=layer, scale=scale, nope_dim=nope_dim, rope_dim=rope_dim, v_dim=v_dim, eps=eps,
                       theta=theta, style=style, scaling=dict(scaling or {}))

    # --- recurrent layers (poot-family-hybrid) ------------------------------------------------------------
    def slice(self, x: Value, start: int, stop: int) -> Value:
        """x[..., start:stop]: one part of a joined projection."""
        return self.op("slice", (x,), (*x.shape[:-1], stop - start), start=start, stop=stop)

    def short_conv(self, x: Value, w: Value, b: Value | None, *, layer: int, act: str | None = None) -> Value:
        """Causal depthwise convolution over time: out[t, c] = act(b[c] + sum_j w[c, j] * x[t - K + 1 + j, c]),
        x [R, T, C], w [C, K] or [C, 1, K] (Hugging Face's Conv1d). The last K - 1 inputs of the sequence are
        the layer's state ("conv" [R, C, K - 1], zeros at a sequence's start), read before and written after
        the step, so prefill chunks and decode steps continue one sequence."""
        rows, _, channels = x.shape
        window = self.state(f"conv{layer}", (rows, channels, w.shape[-1] - 1), "conv")
        return self.op("short_conv", (x, w, b, window, *self._slot_inputs()), x.shape, layer=layer, act=act)

    def ssm_scan(self, x: Value, dt: Value, a_log: Value, b: Value, c: Value, d: Value, dt_bias: Value, *,
                 layer: int, chunk: int, dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Value:
        """Mamba2's selective scan, per head h of H (group g = h // (H / G)) over the new tokens t:
            dt' = clamp(softplus(dt[t, h] + dt_bias[h]), dt_limit),  a = -exp(a_log[h])
            S = exp(dt' * a) * S + dt' * x[t, h, :, None] * b[t, g, None, :]      S [P, N]
            y[t, h] = S @ c[t, g] + d[h] * x[t, h]
        x [R, T, H, P], dt [R, T, H], b and c [R, T, G, N]; S is the layer's state ("ssm" [R, H, P, N], zeros
        at a sequence's start). Prefill computes it in chunks of `chunk` tokens (Mamba2's SSD form), decode
        one step at a time; the two differ in summation order only."""
        rows, _, heads, head_dim = x.shape
        state = self.state(f"ssm{layer}", (rows, heads, head_dim, b.shape[-1]), "ssm")
        return self.op("ssm_scan", (x, dt, a_log, b, c, d, dt_bias, state, *self._slot_inputs()), x.shape,
                       layer=layer, chunk=chunk,
                       dt_limit=(float(dt_limit[0]), float(dt_limit[1])))

    def gated_delta(self, q: Value, k: Value, v: Value, a: Value, b: Value, a_log: Value, dt_bias: Value, *,
                    layer: int, chunk: int, eps: float = 1e-6) -> Value:
        """The gated delta rule (Qwen3-Next's Gated DeltaNet), per value head h of Hv (key head h // (Hv / Hk))
        over the new tokens t, with q and k L2-normalized (q also scaled by Dk^-1/2):
            g = -exp(a_log[h]) * softplus(a[t, h] + dt_bias[h]),  beta = sigmoid(b[t, h])
            S = exp(g) * S;  S = S + k[t] (beta * (v[t, h] - S^T k[t]))^T      S [Dk, Dv]
            y[t, h] = S^T q[t]
        q, k [R, T, Hk, Dk], v [R, T, Hv, Dv], a and b [R, T, Hv]; S is the layer's state ("delta"
        [R, Hv, Dk, Dv], zeros at a sequence's start). Prefill computes it in chunks of `chunk` tokens (the WY
        form), decode one step at a time; the two differ in summation order only."""
        rows, _, v_heads, v_dim = v.shape
        state = self.state(f"delta{layer}", (rows, v_heads, k.shape[-1], v_dim), "delta")
        return self.op("gated_delta", (q, k, v, a, b, a_log, dt_bias, state, *self._slot_inputs()), v.shape,
                       layer=layer, chunk=chunk, eps=eps)

    def gated_rms_norm(self, x: Value, gate: Value, w: Value, *, eps: float, group: int,
                       norm_first: bool = False) -> Value:
        """w * rms_norm(x * silu(gate)), normalized over groups of `group` features of the last axis; with
        `norm_first`, w * rms_norm(x) * silu(gate) (Qwen3-Next's gated norm)."""
        return self.op("gated_rms_norm", (x, gate, w), x.shape, eps=eps, group=group, norm_first=norm_first)
