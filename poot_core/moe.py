"""Mixture-of-experts pieces every executor shares: which experts each token goes to, and per-expert views of
stacked expert weights. Plain torch, on whatever device the tensors live; public so backends do not keep
copies of the routing rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.errors import Reason, Unsupported

Expert = tuple[Weight, Weight, Weight]  # gate [F, D], up [F, D], down [D, F]


def expert_view(w: Weight, e: int) -> Weight:
    """Expert e of a stacked [E, out, in] weight (GGUF's `ffn_*_exps`), as a view: GGUF blocks stack by rows."""
    if isinstance(w, PackedWeight):
        if w.layout != "gguf" or set(w.parts) != {"blocks"}:
            raise Unsupported(Reason.QUANTIZATION, f"stacked experts in {w.kind}", "only GGUF blocks stack")
        _, out_features, in_features = w.shape
        blocks = w.parts["blocks"][e * out_features : (e + 1) * out_features]
        return PackedWeight(w.layout, (out_features, in_features), {"blocks": blocks}, w.meta)
    return w[e]


def experts_of(weights: list[Weight], count: int, stacked: bool) -> list[Expert]:
    """The moe op's expert inputs as (gate, up, down) per expert: stacked (three [E, ...] weights) or listed."""
    if stacked:
        gate, up, down = weights
        return [(expert_view(gate, e), expert_view(up, e), expert_view(down, e)) for e in range(count)]
    return [(weights[3 * e], weights[3 * e + 1], weights[3 * e + 2]) for e in range(count)]


def choose_experts(logits: torch.Tensor, bias: torch.Tensor | None,
                   a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (float32) -> (expert ids [N, k], float32 weights [N, k]), by the moe op's attributes:
    softmax or sigmoid scores; the correction bias shifts the choice only; with groups > 1 only the best
    `topk_groups` groups (by their best score, or the sum of their two best) are eligible; weights of the
    chosen experts renormalized when `norm_topk`, then scaled by `routed_scale`."""
    scores = torch.sigmoid(logits) if a["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    groups = int(a["groups"])
    if groups > 1:
        n, count = choice.shape
        per_group = choice.view(n, groups, count // groups)
        if a["group_score"] == "top2":
            group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = per_group.amax(dim=-1)
        best = group_scores.topk(int(a["topk_groups"]), dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(count // groups, dim=1), float("-inf"))
    ids = choice.topk(int(a["top_k"]), dim=-1).indices
    weights = scores.gather(1, ids)
    if a["norm_topk"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * float(a["routed_scale"])


def by_expert(ids: torch.Tensor, weights: torch.Tensor,
              count: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """ids, weights [N, k] (each token's chosen experts) -> (expert, its tokens' indices, their weights) for each
    of the `count` experts that any token chose, in expert order: each chosen expert then runs once, over all the
    tokens that chose it. Reads the per-expert counts on the host (one sync on a GPU)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=count).tolist()
    tokens_sorted = order // k
    weights_sorted = weights.reshape(-1)[order]
    start = 0
    for e, c in enumerate(counts):
        if c:
            yield e, tokens_sorted[start : start + c], weights_sorted[start : start + c]
            start += c
