"""The CPU handlers of the collective ops (all_reduce, all_gather): gloo through the step's Coordinator,
looked up by the node's `group` key once, when the program is prepared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from poot_core.graph import Node

Step = Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]


def bind_all_reduce(node: Node, x: Step) -> Step:
    from poot_core.distributed.coordinator import group

    coordinator = group(node.attrs["group"])

    def all_reduce(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        # a fresh float32 buffer: the partial sum may be a view another value shares
        return coordinator.all_reduce(x(e, s).to(torch.float32, copy=True).contiguous())

    return all_reduce


def bind_all_gather(node: Node, x: Step) -> Step:
    from poot_core.distributed.coordinator import group

    coordinator, sizes = group(node.attrs["group"]), list(node.attrs["sizes"])
    return lambda e, s: coordinator.all_gather(x(e, s).float(), sizes)
