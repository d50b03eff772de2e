"""Joining linears on the CPU without copying weights.

Linears that read the same input (q/k/v, gate/up) cost one matrix product each; at decode that is one pass
over a small matrix per call, which the CPU streams less efficiently than one larger matrix. When their dense
weights already lie back to back in memory (a safetensors file usually stores gate_proj right before up_proj,
q_proj right before v_proj), one zero-copy view covers them all and a single product does the work: a
re-layout of nothing, no extra memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import Weight
from poot_core.graph import Node

HALF = (torch.bfloat16, torch.float16)


def _dense_weight(node: Node, weights: dict[str, Weight]) -> torch.Tensor | None:
    if node.op != "linear" or not node.inputs[1].startswith("w:") or node.inputs[2] != "":
        return None
    w = weights[node.inputs[1][2:]]
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous() and w.is_floating_point():
        return w
    return None


def adjacent_groups(nodes: list[Node], weights: dict[str, Weight]) -> list[list[int]]:
    """Indices of linear nodes (two or more) that share an input and whose weights are contiguous in memory,
    listed in memory order."""
    by_input: dict[str, list[tuple[torch.Tensor, int]]] = {}
    for i, node in enumerate(nodes):
        w = _dense_weight(node, weights)
        if w is not None:
            by_input.setdefault(node.inputs[0], []).append((w, i))
    groups: list[list[int]] = []
    for members in by_input.values():
        members.sort(key=lambda m: m[0].data_ptr())
        run = [members[0]]
        for w, i in members[1:]:
            prev = run[-1][0]
            if (w.dtype == prev.dtype and w.shape[1] == prev.shape[1]
                    and w.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size()):
                run.append((w, i))
                continue
            if len(run) > 1:
                groups.append([i for _, i in run])
            run = [(w, i)]
        if len(run) > 1:
            groups.append([i for _, i in run])
    return groups


def _joined_view(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor over memory the parts already occupy back to back (they keep that memory alive)."""
    first = parts[0]
    rows, cols = sum(p.shape[0] for p in parts), first.shape[1]
    raw = (ctypes.c_char * (rows * cols * first.element_size())).from_address(first.data_ptr())
    return torch.frombuffer(raw, dtype=first.dtype, count=rows * cols).view(rows, cols)


def bind_group(nodes: list[Node], runner: Node, weights: dict[str, Weight],
               arg: Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]
               ) -> Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]:
    """The step function of `runner` (the group's first node in program order): one product for the whole
    group; it leaves the other members' outputs in the environment and returns its own."""
    parts = [weights[n.inputs[1][2:]] for n in nodes]
    assert all(isinstance(p, torch.Tensor) for p in parts)
    joined = _joined_view(parts)  # type: ignore[arg-type]
    sizes = [p.shape[0] for p in parts]
    outputs = [n.output for n in nodes]
    key = f"{runner.inputs[0]}:{joined.dtype}"
    half = joined.dtype in HALF

    def run(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        if half:
            xs = e.get(key)
            if xs is None:
                xs = e[key] = arg(e, s).to(joined.dtype)
            y = F.linear(xs, joined).float()
        else:
            y = F.linear(arg(e, s), joined)
        mine = None
        for name, piece in zip(outputs, y.split(sizes, dim=-1), strict=True):
            if name == runner.output:
                mine = piece
            else:
                e[name] = piece
        assert mine is not None
        return mine

    run.keep_alive = parts  # type: ignore[attr-defined]  # the view borrows the parts' memory
    return run
