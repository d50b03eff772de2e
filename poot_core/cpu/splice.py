"""The splice op: image features written into the text embeddings at the image tokens' rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from poot_core.graph import Node

Arg = Callable[[dict[str, Any], dict[str, torch.Tensor]], Any]
StepFn = Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]


def splice(x: torch.Tensor, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [.., D] with rows index [N] of its flattened rows replaced by features [N, D] (a copy: x may be read
    elsewhere)."""
    flat = x.reshape(-1, x.shape[-1]).clone()
    idx = index.reshape(-1).long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= flat.shape[0]):
        raise IndexError(f"splice index outside the step's {flat.shape[0]} rows")
    flat[idx] = features.reshape(-1, x.shape[-1]).to(flat.dtype)
    return flat.reshape(x.shape)


def bind_splice(node: Node, args: list[Arg]) -> StepFn:
    x, features, index = args
    return lambda e, s: splice(x(e, s), features(e, s), index(e, s))
