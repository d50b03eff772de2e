"""The group_attention op: causal attention through the KV state, where the step's new tokens of one group (an
image's tokens in Gemma 3) also attend to each other both ways, as transformers' blockwise mask does: a key is
seen when it is not after the query, or when both are new tokens of the same group (id >= 0); either way
within the window when the layer has one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.graph import Node

Arg = Callable[[dict[str, Any], dict[str, torch.Tensor]], Any]
StepFn = Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, groups: torch.Tensor, scale: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """q [R, T, Hq, D]; k, v [R, T, Hkv, D]; caches [R, Hkv, C, D]; positions [R, T] consecutive per row;
    groups [R, T]."""
    rows, tokens, heads, _ = q.shape
    group = heads // k.shape[2]
    outs = []
    for r in range(rows):
        start = int(positions[r, 0])
        end = start + tokens
        k_cache[r, :, start:end] = k[r].transpose(0, 1)
        v_cache[r, :, start:end] = v[r].transpose(0, 1)
        first = 0 if window is None else max(0, start - window + 1)  # no query sees a key before this
        keys, values = k_cache[r, :, first:end].to(q.dtype), v_cache[r, :, first:end].to(q.dtype)
        qpos, kpos = positions[r][:, None].long(), torch.arange(first, end)[None, :]
        key_groups = torch.full((end - first,), -1, dtype=torch.long)
        key_groups[start - first :] = groups[r].long()
        query_groups = groups[r].long()[:, None]
        mask = (kpos <= qpos) | ((query_groups == key_groups[None, :]) & (query_groups >= 0))
        if window is not None:
            mask = mask & (qpos - kpos < window)
        qr = q[r].transpose(0, 1)  # [Hq, T, D]
        if softcap is None:
            o = F.scaled_dot_product_attention(qr[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)[0]
        else:
            scores = (qr @ keys.repeat_interleave(group, 0).transpose(-1, -2)) * scale
            scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ values.repeat_interleave(group, 0)
        outs.append(o.transpose(0, 1))  # [T, Hq, Dv]
    return torch.stack(outs)


def bind_group_attention(node: Node, args: list[Arg]) -> StepFn:
    q, k, v, pos, kc, vc, groups, *paged_inputs = args
    a = node.attrs
    if node.input(7) is None:
        return lambda e, s: group_attention(q(e, s), k(e, s), v(e, s), pos(e, s), kc(e, s), vc(e, s), groups(e, s),
                                            a["scale"], a["window"], a["softcap"])
    from poot_core.cpu import paged  # a paged step: the caches are pools of blocks

    seqs, tables = paged_inputs

    def paged_groups(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        positions, k_pool = pos(e, s), kc(e, s)
        step = paged.plan(e, positions, seqs(e, s), tables(e, s), k_pool.shape[2])
        return paged.group_attention(q(e, s), k(e, s), v(e, s), positions, groups(e, s), step, k_pool, vc(e, s),
                                     a["scale"], a["window"], a["softcap"])

    return paged_groups
