"""The Triton executor's handlers of the collective ops (all_reduce, all_gather) of a placed step.

They call the step's Coordinator (looked up by the node's `group` key when the program is bound) on the
device's tensors: under NCCL the sum is made where the tensors are, and a decode step stays eligible for CUDA
graph capture (the collective is recorded into the graph); under gloo each collective copies through the host,
so the binder marks the step as one that reads the host (never captured). Partial sums are summed in float32,
as on the CPU executor, so the ranks' rounding matches the one-device step's closely.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from poot_core.graph import Node

if TYPE_CHECKING:
    from .program import Step


def bind_all_reduce(node: Node) -> tuple[Callable[[Step], None], bool]:
    """The step function, and whether it reads the host (gloo: copies through the CPU)."""
    coordinator = _group(node)
    x_name, out = node.inputs[0].name, node.output

    def run(s: Step) -> None:
        # a fresh float32 buffer: the partial sum may be a view another value shares
        s.env[out] = coordinator.all_reduce(s.env[x_name].to(torch.float32, copy=True).contiguous())

    return run, not coordinator.on_gpu


def bind_all_gather(node: Node) -> tuple[Callable[[Step], None], bool]:
    coordinator, sizes = _group(node), list(node.attrs["sizes"])
    x_name, out = node.inputs[0].name, node.output

    def run(s: Step) -> None:
        s.env[out] = coordinator.all_gather(s.env[x_name].float(), sizes)

    return run, not coordinator.on_gpu


def _group(node: Node) -> Any:
    from poot_core import collective_group

    return collective_group(node.attrs["group"])


__all__ = ["bind_all_gather", "bind_all_reduce"]
