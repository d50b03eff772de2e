"""The CPU executor's mixture-of-experts op: route, then run only the experts tokens were sent to.

Tokens are grouped by expert (one sort of the (token, slot) choices), so each chosen expert runs once on all
of its tokens and an expert no token chose costs nothing. Experts are used where they lie: a stacked
[E, out, in] tensor (GGUF's `ffn_*_exps`, dense or packed) is viewed per expert, never copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.cpu import ops
from poot_core.errors import Reason, Unsupported
from poot_core.graph import Node, Ref
from poot_core.moe import Expert, by_expert, choose_experts, experts_of


def _router_logits(x: torch.Tensor, router: Weight) -> torch.Tensor:
    """x @ router^T in float32: the choice of experts must not depend on the weights' storage dtype."""
    if isinstance(router, PackedWeight):
        return ops.linear(x, router)
    return F.linear(x, router.float())


def route(
    x: torch.Tensor, router: Weight, bias: torch.Tensor | None, a: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (expert ids [N, k], weights [N, k] float32)."""
    return choose_experts(_router_logits(x, router), bias, a)


def run_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[Expert], act: str
) -> torch.Tensor:
    """x [N, D]; ids, weights [N, k] -> [N, D]: each chosen expert once, over the tokens that chose it."""
    out = torch.zeros(ids.shape[0], x.shape[-1])
    for e, tok, w in by_expert(ids, weights, len(experts)):
        gate, up, down = experts[e]
        h = x[tok]
        y = ops.linear(ops.gated(ops.linear(h, gate), ops.linear(h, up), act), down)
        out.index_add_(0, tok, y * w[:, None])
    return out


def moe(
    x: torch.Tensor,
    router: Weight,
    bias: torch.Tensor | None,
    shared: torch.Tensor | None,
    shared_gate: Weight | None,
    experts: list[Expert],
    a: dict[str, Any],
) -> torch.Tensor:
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ids, weights = route(flat, router, bias, a)
    out = run_experts(flat, ids, weights, experts, a["act"]).reshape(shape)
    if shared is not None:
        if shared_gate is not None:
            shared = shared * torch.sigmoid(ops.linear(x, shared_gate))
        out = out + shared
    return out


def bind(node: Node, args: list[Callable[..., Any]], get: Callable[[Ref | None], Any]) -> Callable[..., torch.Tensor]:
    """The executor's binding: inputs (x, router, bias, shared, shared_gate, expert weights...)."""
    a = node.attrs
    if a["scoring"] not in ("softmax", "sigmoid") or a["group_score"] not in ("max", "top2"):
        raise Unsupported(Reason.OPERATION, f"moe scoring {a['scoring']}/{a['group_score']}", "cpu backend")
    x, _, bias, shared, _ = args[:5]
    router = get(node.inputs[1])
    gate = get(node.inputs[4]) if node.inputs[4] else None
    if isinstance(gate, torch.Tensor) and gate.dim() == 1:  # some files store the shared gate as [D]
        gate = gate.view(1, -1)
    experts = experts_of([get(name) for name in node.inputs[5:]], a["experts"], a["stacked"])
    return lambda e, s: moe(x(e, s), router, bias(e, s), shared(e, s), gate, experts, a)
