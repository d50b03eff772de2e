"""Mixture of experts on the device: routing in plain torch ops, each chosen expert's gated MLP through the
package's `linear` (dense, GGUF or GPTQ weights alike).

Tokens are grouped by expert (one stable sort of the (token, slot) choices) so an expert runs once over all
the tokens that chose it and an expert nobody chose costs nothing. Grouping needs the per-expert counts on
the host: one device-to-host copy per moe op, so graphs holding `moe` are not captured as CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from poot_core import PackedWeight, Reason, Unsupported, Weight

from .activation import gated_activation
from .quant import linear

Expert = tuple[Weight, Weight, Weight]  # gate [F, D], up [F, D], down [D, F]


def expert_view(w: Weight, e: int) -> Weight:
    """Expert e of a stacked [E, out, in] weight, as a view (GGUF blocks stack by rows)."""
    if isinstance(w, PackedWeight):
        if w.layout != "gguf" or set(w.parts) != {"blocks"}:
            raise Unsupported(Reason.QUANTIZATION, f"stacked experts in {w.kind}", "only GGUF blocks stack")
        _, out_features, in_features = w.shape
        blocks = w.parts["blocks"][e * out_features : (e + 1) * out_features]
        return PackedWeight(w.layout, (out_features, in_features), {"blocks": blocks}, w.meta)
    return w[e]


def experts_of(weights: list[Weight], count: int, stacked: bool) -> list[Expert]:
    if stacked:
        gate, up, down = weights
        return [(expert_view(gate, e), expert_view(up, e), expert_view(down, e)) for e in range(count)]
    return [(weights[3 * e], weights[3 * e + 1], weights[3 * e + 2]) for e in range(count)]


def router_logits(x: torch.Tensor, router: Weight) -> torch.Tensor:
    """x @ router^T in float32, so the choice of experts does not depend on the activation dtype."""
    if isinstance(router, PackedWeight):
        return linear(x, router, out_dtype=torch.float32)
    return torch.nn.functional.linear(x.float(), router.float())


def route(logits: torch.Tensor, bias: torch.Tensor | None, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (expert ids [N, k], float32 weights [N, k]); plain torch ops on the device.

    The correction bias only shifts the choice; the weights are the unbiased scores of the chosen experts."""
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


def run_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[Expert], act: str
) -> torch.Tensor:
    """x [N, D] (activation dtype); ids, weights [N, k] -> float32 [N, D]."""
    _, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the one host sync
    tokens_sorted = order // k
    weights_sorted = weights.reshape(-1)[order]
    out = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        tok = tokens_sorted[start : start + c]
        gate, up, down = experts[e]
        h = x.index_select(0, tok)
        y = linear(gated_activation(linear(h, gate), linear(h, up), kind=act), down, out_dtype=torch.float32)
        out.index_add_(0, tok, y * weights_sorted[start : start + c, None])
        start += c
    return out


__all__ = ["expert_view", "experts_of", "route", "router_logits", "run_experts"]
