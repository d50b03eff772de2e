"""The two ops a step with images adds to a text model, on the Triton executor.

splice: the image features written over the embeddings of the image tokens, a row scatter (torch on the
device; a kernel would add nothing). group_attention (Gemma 3): causal attention in which an image's tokens
also see each other both ways. A group is one run of consecutive new tokens, so a query of a group sees every
key up to the group's last token and a text query every key up to itself: the flash prefill kernel with a
last visible key per query (`limits`), the window on sliding layers unchanged. Both read their step's inputs on
the host: splice's index range is checked on the step's host inputs before it runs (so a step with images
can be captured), group attention reads the groups' runs and each row's start, so its step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from poot_core import RequestError
from poot_core.graph import Node

from .attention import prefill_attention
from .rope import write_kv

if TYPE_CHECKING:
    from .program import Step


def splice_check(node: Node) -> Callable[[dict[str, np.ndarray]], None]:
    """The check of splice's index against the step's rows, on the host inputs before the step runs (the
    scatter itself does not check)."""
    i_name = node.inputs[2].name
    rows = int(np.prod(node.shape[:-1]))  # the output has x's shape

    def check(inputs: dict[str, np.ndarray]) -> None:
        index = np.asarray(inputs[i_name]).reshape(-1)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= rows):
            raise RequestError(f"splice index outside the step's {rows} rows")

    return check


def bind_splice(node: Node) -> Callable[[Step], None]:
    """x [.., D] with its flat rows index [N] replaced by features [N, D] (a copy: x may be read elsewhere);
    the index is checked by splice_check before the step runs."""
    x_name, f_name, i_name = (r.name for r in node.inputs)
    out = node.output

    def run(s: Step) -> None:
        x = s.env[x_name]
        flat = x.reshape(-1, x.shape[-1]).clone()
        features = s.env[f_name].reshape(-1, flat.shape[-1]).to(flat.dtype)
        flat.index_copy_(0, s.env[i_name].reshape(-1), features)
        s.env[out] = flat.reshape(x.shape)

    return run


def group_limits(groups: np.ndarray, start: int) -> np.ndarray:
    """int32 [T]: the last key position each of a row's new tokens sees: its own position for text (group -1),
    the position of its group's last token for a group's token. A group id that comes back after another
    token is refused: the kernel's bound is one run."""
    groups = np.asarray(groups).reshape(-1)
    tokens = len(groups)
    limits = np.arange(start, start + tokens, dtype=np.int64)
    seen: set[int] = set()
    i = 0
    while i < tokens:
        j = i
        while j + 1 < tokens and groups[j + 1] == groups[i]:
            j += 1
        g = int(groups[i])
        if g >= 0:
            if g in seen:
                raise RequestError(f"tokens of group {g} are not consecutive in the step")
            seen.add(g)
            limits[i : j + 1] = start + j
        i = j + 1
    return limits.astype(np.int32)


def device_limits(groups: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor | None = None) -> torch.Tensor:
    """group_limits on the device, for a row's groups and positions [T] (the consecutive-run check is the host
    check's, group_check): each token's own position for text (-1), its run's last position in a group. seqs
    [T]: a paged step's sequence of each token (a run also ends where the sequence changes: group numbers are
    each sequence's own)."""
    tokens = groups.shape[0]
    index = torch.arange(tokens, device=groups.device)
    last = torch.ones(tokens, dtype=torch.bool, device=groups.device)
    last[:-1] = groups[1:] != groups[:-1]
    if seqs is not None:
        last[:-1] |= seqs[1:] != seqs[:-1]
    run_end = torch.flip(torch.cummin(torch.flip(torch.where(last, index, tokens), [0]), 0).values, [0])
    return torch.where(groups >= 0, positions[run_end], positions).to(torch.int32)


def group_check(node: Node) -> Callable[[dict[str, np.ndarray]], None]:
    """The host check of a contiguous step's groups, before every run (captured or not): each group's tokens
    consecutive in their row (group_limits refuses the others)."""
    groups_name = node.inputs[6].name

    def check(inputs: dict[str, np.ndarray]) -> None:
        for row in np.asarray(inputs[groups_name]):
            group_limits(row, 0)

    return check


def bind_group_attention(node: Node) -> Callable[[Step], None]:
    """Each row's key limits are made on the device from its groups; its start position is read on the host, which
    a captured (replayed) longer step fixes at its capture (program.TritonProgram._same_starts)."""
    q_name, k_name, v_name, pos_name, kc_key, vc_key, groups_name = (r.name for r in node.inputs)
    a = node.attrs
    scale, window, softcap = float(a["scale"]), a.get("window"), a.get("softcap")
    out, shape = node.output, node.shape

    def run(s: Step) -> None:
        q, k, v, pos = s.env[q_name], s.env[k_name], s.env[v_name], s.env[pos_name]
        kc, vc = s.state[kc_key], s.state[vc_key]
        if q.dtype != kc.dtype:
            q = q.to(kc.dtype)
        outs = []
        for r in range(q.shape[0]):
            start = int(s.host[pos_name][r, 0])
            write_kv(k[r], v[r], kc[r], vc[r], pos[r])
            limits = device_limits(s.env[groups_name][r], pos[r])
            outs.append(prefill_attention(q[r].contiguous(), kc[r], vc[r], start, scale=scale, window=window,
                                          softcap=softcap, limits=limits))
        s.env[out] = torch.stack(outs).reshape(shape)

    return run


__all__ = ["bind_group_attention", "bind_splice", "device_limits", "group_check", "group_limits", "splice_check"]
