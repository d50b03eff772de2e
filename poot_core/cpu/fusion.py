"""Joining linears on the CPU without copying weights.

Linears that read the same input (q/k/v, gate/up) cost one matrix product each; at decode that is one pass
over a small matrix per call, which the CPU streams less efficiently than one larger matrix. When their weights
already lie back to back in memory (safetensors and GGUF files usually store gate right before up, q right
before v), one zero-copy view covers them all and a single product does the work: a re-layout of nothing, no
extra memory. Dense weights of one dtype and GGUF blocks of one type are joined alike.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.cpu import ops
from poot_core.cpu.packed_linear import DECODE_ROWS, few_rows_product
from poot_core.graph import Node, passes

HALF = (torch.bfloat16, torch.float16)


def _memory(node: Node, weights: dict[str, Weight]) -> tuple[torch.Tensor, tuple[Any, ...]] | None:
    """The tensor holding a linear's weight bytes row by row, and what must match to join it with another
    (kind, row width); None when its weight cannot take part."""
    name = passes.linear_weight(node)
    if name is None:
        return None
    w = weights[name]
    if isinstance(w, PackedWeight):
        blocks = w.parts.get("blocks")
        if w.layout != "gguf" or blocks is None or blocks.dim() != 2 or not blocks.is_contiguous() or len(w.shape) != 2:
            return None
        return blocks, ("gguf", w.meta.get("type"), w.shape[1], blocks.shape[1])
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous() and w.is_floating_point():
        return w, (w.dtype, w.shape[1])
    return None


def adjacent_groups(nodes: list[Node], weights: dict[str, Weight]) -> list[list[int]]:
    """Indices of linear nodes (two or more) that share an input (passes.shared_input_linears) and whose
    weights are contiguous in memory, listed in memory order."""
    groups: list[list[int]] = []
    for shared in passes.shared_input_linears(nodes):
        members = [(*found, i) for i in shared if (found := _memory(nodes[i], weights)) is not None]
        if not members:
            continue
        members.sort(key=lambda m: m[0].data_ptr())
        run = [members[0]]
        for mem, key, i in members[1:]:
            prev_mem, prev_key, _ = run[-1]
            if key == prev_key and mem.data_ptr() == prev_mem.data_ptr() + prev_mem.numel() * prev_mem.element_size():
                run.append((mem, key, i))
                continue
            if len(run) > 1:
                groups.append([i for _, _, i in run])
            run = [(mem, key, i)]
        if len(run) > 1:
            groups.append([i for _, _, i in run])
    return groups


def _joined_view(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor over memory the parts already occupy back to back (they keep that memory alive)."""
    first = parts[0]
    rows, cols = sum(p.shape[0] for p in parts), first.shape[1]
    raw = (ctypes.c_char * (rows * cols * first.element_size())).from_address(first.data_ptr())
    return torch.frombuffer(raw, dtype=first.dtype, count=rows * cols).view(rows, cols)


def _joined_weight(parts: list[Weight]) -> Weight:
    if isinstance(parts[0], PackedWeight):
        packed = [p for p in parts if isinstance(p, PackedWeight)]
        blocks = _joined_view([p.parts["blocks"] for p in packed])
        rows = sum(p.shape[0] for p in packed)
        return PackedWeight("gguf", (rows, packed[0].shape[1]), {"blocks": blocks}, dict(packed[0].meta))
    return _joined_view([p for p in parts if isinstance(p, torch.Tensor)])


def bind_group(nodes: list[Node], runner: Node, weights: dict[str, Weight],
               arg: Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor], rowwise: bool = False
               ) -> Callable[[dict[str, Any], dict[str, torch.Tensor]], torch.Tensor]:
    """The step function of `runner` (the group's first node in program order): one product for the whole
    group; it leaves the other members' outputs in the environment and returns its own. rowwise: packed
    products of up to ROWWISE_MAX rows run as decode products (packed_linear.few_rows_product)."""
    parts = [weights[n.inputs[1].name] for n in nodes]
    joined = _joined_weight(parts)
    sizes = [p.shape[0] for p in parts]
    outputs = [n.output for n in nodes]
    half = isinstance(joined, torch.Tensor) and joined.dtype in HALF
    key = f"{runner.inputs[0]}:{joined.dtype}" if isinstance(joined, torch.Tensor) else ""
    product = few_rows_product(joined, ROWWISE_MAX if rowwise else DECODE_ROWS) if isinstance(joined, PackedWeight) \
        else None

    def run(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        if half:
            xv = arg(e, s)
            xs = e.get(key)
            if xs is None and xv.numel() // xv.shape[-1] > DECODE_ROWS:  # many rows: oneDNN on x rounded once
                xs = e[key] = xv.to(joined.dtype)
            y = ops.linear16(xv, joined, xs)
        else:
            xv = arg(e, s)
            # decode: the C kernel, its plan made once (a serving step's decode rows: LONE_ROWS of them)
            y = product(xv, e.get(LONE_ROWS, 0)) if product is not None else None
            if y is None:
                y = ops.linear(xv, joined)
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


# The environment's key for how many of a serving step's first tokens are decode tokens (runs of at most
# FUSED_MAX_ROWS tokens; the scheduler puts them first): in a step of more rows their products still take the decode
# kernel, so that they are the rows a decode step of each alone gives.
LONE_ROWS = "paged:lone_rows"

# Serving steps of up to this many rows take the decode kernel (packed_linear.few_rows_product): for them it
# costs less than dequantizing the matrix into tiles, and each row's arithmetic is a decode row's, whatever
# shares its step.
ROWWISE_MAX = 32
