"""The recurrent ops on the CPU: the short causal convolution, Mamba2's selective scan and its gated group norm.

Each keeps its layer's fixed-size state (graph kinds "conv" and "ssm", float32) in the step's state dict: read
before the step, written after it, so prefill chunks and decode steps continue one sequence. Arithmetic is
float32 whatever the weights' dtype (their small vectors are widened once, at bind time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.graph import Node

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
    x, _, _, window = args
    w = _small(get(node.inputs[1]))
    w = w.reshape(w.shape[0], w.shape[-1])  # Hugging Face's Conv1d stores [C, 1, K]
    b = _small(get(node.inputs[2]))
    act = node.attrs["act"]
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
    x, dt, _, b, c, _, _, state = args
    # per-head vectors [H] (GGUF stores A and D as [H, 1])
    a_log, d, dt_bias = (_small(get(node.inputs[i])).reshape(-1) for i in (2, 5, 6))
    chunk, limit = node.attrs["chunk"], node.attrs["dt_limit"]
    return lambda e, s: ssm_scan(x(e, s), dt(e, s), a_log, b(e, s), c(e, s), d, dt_bias, state(e, s), chunk, limit)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float, group: int) -> torch.Tensor:
    h = x.float() * F.silu(gate.float())
    grouped = h.reshape(*h.shape[:-1], h.shape[-1] // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return grouped.reshape(h.shape) * w


def bind_gated_rms_norm(node: Node, args: list[Arg], get: Callable[[Any], Any]) -> StepFn:
    x, gate, _ = args
    w = _small(get(node.inputs[2])).reshape(-1)  # GGUF stores it [groups, group]
    eps, group = node.attrs["eps"], node.attrs["group"]
    return lambda e, s: gated_rms_norm(x(e, s), gate(e, s), w, eps, group)


__all__ = ["bind_gated_rms_norm", "bind_short_conv", "bind_ssm_scan", "gated_rms_norm", "scan_chunked", "scan_step",
           "short_conv", "ssm_scan"]
