"""Mixture of experts on the device: routing in plain torch ops, each chosen expert's gated MLP through the
package's `linear` (dense, GGUF or GPTQ weights alike).

Tokens are grouped by expert (one stable sort of the (token, slot) choices) so an expert runs once over all
the tokens that chose it and an expert nobody chose costs nothing. Grouping needs the per-expert counts on
the host: one device-to-host copy per moe op, so graphs holding `moe` are not captured as CUDA graphs.
"""

from __future__ import annotations

import torch

from poot_core import Expert, PackedWeight, Weight, choose_experts, experts_of

from .activation import gated_activation
from .quant import linear


def router_logits(x: torch.Tensor, router: Weight) -> torch.Tensor:
    """x @ router^T in float32, so the choice of experts does not depend on the activation dtype."""
    if isinstance(router, PackedWeight):
        return linear(x, router, out_dtype=torch.float32)
    return torch.nn.functional.linear(x.float(), router.float())


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


__all__ = ["choose_experts", "experts_of", "router_logits", "run_experts"]
