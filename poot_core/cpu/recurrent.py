"""The recurrent ops on the CPU: the short causal convolution, Mamba2's selective scan and its gated group norm,
the gated delta rule (Qwen3-Next).

Each keeps its layer's fixed-size state (graph kinds "conv", "ssm" and "delta", float32) in the step's state dict: read
before the step, written after it, so prefill chunks and decode steps continue one sequence. Arithmetic is
float32 whatever the weights' dtype (their small vectors are widened once, at bind time).

In a paged step (the serving engine) the state is a pool of slots and the step a flat batch of many sequences'
tokens (`per_run`): the decode tokens (runs of one token) are computed together, one row each over the state
gathered from its slot and scattered back, and each longer run (a prefill chunk) alone, as one row over its own
slot. A row's arithmetic is the same in both (the ops work row by row), so a sequence's is the one it gets
alone in the contiguous layout whatever shares its step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.graph import Node, sequence_runs

Env = dict[str, Any]
StepFn = Callable[[Env, dict[str, torch.Tensor]], torch.Tensor]
Arg = Callable[[Env, dict[str, torch.Tensor]], Any]


def _small(w: Any) -> torch.Tensor | None:
    """A small weight (a conv kernel, a per-head vector) in float32, dequantized when packed."""
    if w is None:
        return None
    if isinstance(w, PackedWeight):
        from poot_core.checkpoint.quant import dequantize

        w = dequantize(w)
    return w.float()


RUNS = "recurrent_runs:"  # the step environment's key of a paged step's split into runs, worked out once per step


def _split(positions: torch.Tensor, seq_index: torch.Tensor, slots: torch.Tensor
           ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, list[tuple[int, int, int, bool]]]:
    """A paged step's decode tokens (their token indices or None, their slots, whether each starts its sequence)
    and its longer runs (slot, first token, end token, whether it starts its sequence)."""
    singles: list[int] = []
    runs = []
    for seq, t0, t1 in sequence_runs(seq_index):
        if t1 - t0 == 1:
            singles.append(t0)
        else:
            runs.append((int(slots[seq]), t0, t1, int(positions[0, t0]) == 0))
    if not singles:
        return None, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), runs
    index = torch.tensor(singles, dtype=torch.long)
    return index, slots[seq_index[index]].long(), positions[0, index] == 0, runs


def per_run(node: Node, values: list[Arg], state: Arg, paged: list[Arg],
            compute: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]) -> StepFn:
    """A recurrent op of a paged step: `compute(values [R, t, ...], state [R, ...])` once over the step's decode
    tokens (R rows of t = 1, each over a copy of its slot's state, written back after) and once for each longer
    run (R = 1, over its slot, a view updated in place). A slot whose run starts at position 0 (a new or
    recomputed sequence) starts from zeros. Padding tokens (sequence -1) give zeros and write nothing."""
    positions, seq_index, slots = paged

    def run(e: Env, s: dict[str, torch.Tensor]) -> torch.Tensor:
        split = e.get(RUNS)
        if split is None:
            split = e[RUNS] = _split(positions(e, s), seq_index(e, s), slots(e, s))
        decode, decode_slots, fresh, runs = split
        pool = state(e, s)
        vals = [v(e, s) for v in values]
        out = torch.zeros(node.shape)
        if decode is not None:
            rows = pool[decode_slots]  # a copy: the rows' states, side by side
            rows[fresh] = 0
            out[0, decode] = compute([v[0, decode].unsqueeze(1) for v in vals], rows)[:, 0]
            pool[decode_slots] = rows
        for slot, t0, t1, starts in runs:
            row = pool[slot].unsqueeze(0)  # a view: the op updates the slot in place
            if starts:
                row.zero_()
            out[:, t0:t1] = compute([v[:, t0:t1] for v in vals], row)
        return out

    return run


def short_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, window: torch.Tensor,
               act: str | None) -> torch.Tensor:
    """x [R, T, C], w [C, K] float32, window [R, C, K - 1] (updated in place) -> [R, T, C]."""
    tokens, kernel = x.shape[1], w.shape[-1]
    full = torch.cat([window, x.float().transpose(1, 2)], dim=-1)  # [R, C, K - 1 + T]
    if kernel > 1:
        window.copy_(full[:, :, -(kernel - 1):])
    out = F.conv1d(full, w.unsqueeze(1), b, groups=w.shape[0])[:, :, -tokens:]  # [R, C, T]
    if act == "silu":
        out = F.silu(out)
    elif act is not None:
        raise ValueError(f"short_conv activation {act}")
    return out.transpose(1, 2)


def bind_short_conv(node: Node, args: list[Arg], get: Callable[[Any], Any]) -> StepFn:
    x, _, _, window, *paged = args
    w = _small(get(node.inputs[1]))
    w = w.reshape(w.shape[0], w.shape[-1])  # Hugging Face's Conv1d stores [C, 1, K]
    b = _small(get(node.inputs[2]))
    act = node.attrs["act"]
    if paged:
        return per_run(node, [x], window, paged, lambda v, st: short_conv(v[0], w, b, st, act))
    return lambda e, s: short_conv(x(e, s), w, b, window(e, s), act)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: entry (i, j) = a[j + 1] + ... + a[i] for j <= i, -inf above the diagonal."""
    length = a.shape[-1]
    x = a[..., None].expand(*a.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool)), -torch.inf)


def scan_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> torch.Tensor:
    """The SSD form over T tokens in chunks: x [R, T, H, P] already times dt, dt [R, T, H] (discretized),
    a [H] (negative), b and c [R, T, H, N] (groups spread over heads), state [R, H, P, N] updated in place.
    Returns y [R, T, H, P] without the skip term."""
    rows, tokens, heads, head_dim = x.shape
    pad = (chunk - tokens % chunk) % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [R, T, ...] -> [R, chunks, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(rows, -1, chunk, *t.shape[2:])

    xc, bc, cc = chunks(x), chunks(b), chunks(c)
    ac = chunks(dt * a).permute(0, 3, 1, 2)  # [R, H, chunks, chunk]
    a_cum = torch.cumsum(ac, dim=-1)
    # within each chunk: attention-like weights C_l . B_s, decayed from s to l
    decay = torch.exp(_segment_sum(ac))  # [R, H, chunks, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", cc, bc) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xc)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cum[:, :, :, -1:] - a_cum)  # [R, H, chunks, chunk]
    states = torch.einsum("bclhn,bclhp->bchpn", bc * to_end.permute(0, 2, 3, 1)[..., None], xc)
    # states at chunk starts: the carried state, then each chunk's end, decayed across chunks
    states = torch.cat([state[:, None], states], dim=1)  # [R, chunks + 1, H, P, N]
    across = torch.exp(_segment_sum(F.pad(a_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)  # [R, z, c, H]
    starts = torch.einsum("bzch,bzhpn->bchpn", across, states)
    state.copy_(starts[:, -1])
    # each token reads its chunk's start state, decayed to its place
    y_off = torch.einsum("bclhn,bchpn->bclhp", cc, starts[:, :-1]) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    return (y_diag + y_off).reshape(rows, -1, heads, head_dim)[:, :tokens]


def scan_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """One token per row, the recurrence itself: shapes as scan_chunked's with T = 1."""
    decay = torch.exp(dt[:, 0] * a)  # [R, H]
    new = state * decay[:, :, None, None] + x[:, 0, :, :, None] * b[:, 0, :, None, :]
    state.copy_(new)
    return torch.einsum("bhpn,bhn->bhp", new, c[:, 0])[:, None]


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, chunk: int,
             dt_limit: tuple[float, float]) -> torch.Tensor:
    """Tracer.ssm_scan's arithmetic: x [R, T, H, P], dt [R, T, H], b and c [R, T, G, N], state [R, H, P, N]."""
    x, heads = x.float(), x.shape[2]
    dt = F.softplus(dt.float() + dt_bias).clamp(*dt_limit)
    a = -torch.exp(a_log)
    spread = heads // b.shape[2]
    b = b.float().repeat_interleave(spread, dim=2)
    c = c.float().repeat_interleave(spread, dim=2)
    xdt = x * dt[..., None]
    if x.shape[1] == 1:
        y = scan_step(xdt, dt, a, b, c, state)
    else:
        y = scan_chunked(xdt, dt, a, b, c, state, chunk)
    return y + x * d[:, None]


def bind_ssm_scan(node: Node, args: list[Arg], get: Callable[[Any], Any]) -> StepFn:
    x, dt, _, b, c, _, _, state, *paged = args
    # per-head vectors [H] (GGUF stores A and D as [H, 1])
    a_log, d, dt_bias = (_small(get(node.inputs[i])).reshape(-1) for i in (2, 5, 6))
    chunk, limit = node.attrs["chunk"], node.attrs["dt_limit"]
    if paged:
        return per_run(node, [x, dt, b, c], state, paged,
                       lambda v, st: ssm_scan(v[0], v[1], a_log, v[2], v[3], d, dt_bias, st, chunk, limit))
    return lambda e, s: ssm_scan(x(e, s), dt(e, s), a_log, b(e, s), c(e, s), d, dt_bias, state(e, s), chunk, limit)


def delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, chunk: int) -> torch.Tensor:
    """The gated delta rule over T tokens in chunks (the WY form, as flash-linear-attention's chunked kernel):
    q, k [R, H, T, Dk] (normalized, heads spread), v [R, H, T, Dv], g and beta [R, H, T], state [R, H, Dk, Dv]
    updated in place. Within a chunk, with G the cumulative sum of g and A[i, j] = beta_i k_i . k_j e^(G_i - G_j)
    for j < i, the chunk's corrections are U - W S, U = (I + A)^-1 (beta v), W = (I + A)^-1 (beta e^G k)."""
    out = torch.empty_like(v)
    S = state.clone()
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, gc, bc = q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part]
        length = qc.shape[2]
        cum = torch.cumsum(gc, dim=-1)  # [R, H, L]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -torch.inf).exp()  # [R, H, L, L]
        kb = kc * bc[..., None]
        system = (kb @ kc.transpose(-1, -2)) * decay  # unit lower triangle: its diagonal is not read
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
        fresh = u - w @ S  # [R, H, L, Dv]: what each token writes, beyond what the carried state predicts
        out[:, :, part] = (qc * cum.exp()[..., None]) @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ fresh
        to_end = (cum[..., -1:] - cum).exp()[..., None]  # [R, H, L, 1]
        S = S * cum[..., -1].exp()[..., None, None] + (kc * to_end).transpose(-1, -2) @ fresh
    state.copy_(S)
    return out


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """One token per row, the recurrence itself: shapes as delta_chunked's with T = 1."""
    S = state * g[..., 0].exp()[..., None, None]
    kt, qt = k[:, :, 0], q[:, :, 0]  # [R, H, Dk]
    delta = (v[:, :, 0] - torch.einsum("rhkv,rhk->rhv", S, kt)) * beta[:, :, 0, None]
    S = S + kt[..., None] * delta[..., None, :]
    state.copy_(S)
    return torch.einsum("rhkv,rhk->rhv", S, qt)[:, :, None]


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, chunk: int,
                eps: float) -> torch.Tensor:
    """Tracer.gated_delta's arithmetic: q, k [R, T, Hk, Dk], v [R, T, Hv, Dv], a, b [R, T, Hv],
    state [R, Hv, Dk, Dv] -> [R, T, Hv, Dv]."""
    spread = v.shape[2] // k.shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [R, T, Hk, D] -> [R, Hv, T, D], normalized
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
        return x.repeat_interleave(spread, dim=2).transpose(1, 2)

    q, k = heads(q) * q.shape[-1] ** -0.5, heads(k)
    g = (-torch.exp(a_log) * F.softplus(a.float() + dt_bias)).transpose(1, 2)  # [R, Hv, T]
    beta = torch.sigmoid(b.float()).transpose(1, 2)
    v = v.float().transpose(1, 2)
    y = delta_step(q, k, v, g, beta, state) if v.shape[2] == 1 else delta_chunked(q, k, v, g, beta, state, chunk)
    return y.transpose(1, 2)


def bind_gated_delta(node: Node, args: list[Arg], get: Callable[[Any], Any]) -> StepFn:
    q, k, v, a, b, _, _, state, *paged = args
    a_log, dt_bias = (_small(get(node.inputs[i])).reshape(-1) for i in (5, 6))  # per value head [Hv]
    chunk, eps = node.attrs["chunk"], node.attrs["eps"]
    if paged:
        return per_run(node, [q, k, v, a, b], state, paged,
                       lambda t, st: gated_delta(*t, a_log, dt_bias, st, chunk, eps))
    return lambda e, s: gated_delta(q(e, s), k(e, s), v(e, s), a(e, s), b(e, s), a_log, dt_bias, state(e, s), chunk,
                                    eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float, group: int,
                   norm_first: bool = False) -> torch.Tensor:
    """Mamba2's norm of x * silu(gate) per group, or (norm_first) Qwen3-Next's silu(gate) * the norm of x."""
    silu = F.silu(gate.float())
    h = x.float() if norm_first else x.float() * silu
    grouped = h.reshape(*h.shape[:-1], h.shape[-1] // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = grouped.reshape(h.shape) * w
    return out * silu if norm_first else out


def bind_gated_rms_norm(node: Node, args: list[Arg], get: Callable[[Any], Any]) -> StepFn:
    x, gate, _ = args
    w = _small(get(node.inputs[2])).reshape(-1)  # GGUF stores it [groups, group]
    eps, group, first = node.attrs["eps"], node.attrs["group"], node.attrs.get("norm_first", False)
    return lambda e, s: gated_rms_norm(x(e, s), gate(e, s), w, eps, group, first)


__all__ = ["bind_gated_delta", "bind_gated_rms_norm", "bind_short_conv", "bind_ssm_scan", "delta_chunked", "delta_step",
           "gated_delta", "gated_rms_norm", "per_run", "scan_chunked", "scan_step", "short_conv", "ssm_scan"]
