"""A rank's weights: the stored tensors its step reads, and slices of those the tensor-parallel pass split.

Slices keep the stored layout: a dense tensor's rows are a view of the file's bytes, its columns a copy of just
that slice; a GGUF block matrix splits along whole rows or whole blocks of a row (never dequantized or widened).
Other packed layouts (GPTQ, AWQ, FP8) are not split, so their blocks stay replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from poot_core.checkpoint.layouts import PackedWeight, Weight, weight_nbytes
from poot_core.checkpoint.parts import WeightStore
from poot_core.checkpoint.quant.gguf_blocks import BLOCK_SIZES
from poot_core.errors import Reason, Unsupported
from poot_core.graph.tensor_parallel import Shard, Splittable


def _block(w: PackedWeight) -> tuple[int, int] | None:
    return BLOCK_SIZES.get(w.meta.get("type", "")) if w.layout == "gguf" and len(w.shape) == 2 else None


def splittable(store: Any) -> Splittable:
    """Whether the stored weight of a shard splits there in its own layout."""

    def check(s: Shard) -> bool:
        w = store.get(s.base)
        if isinstance(w, torch.Tensor):
            return w.dim() > s.axis
        block = _block(w)
        if block is None:
            return False
        return s.axis == 0 or (s.start % block[0] == 0 and s.stop % block[0] == 0)

    return check


def split(w: Weight, s: Shard) -> Weight:
    if isinstance(w, torch.Tensor):
        part = w.narrow(s.axis, s.start, s.stop - s.start)
        return part if part.is_contiguous() else part.contiguous()
    block = _block(w)
    if block is None or (s.axis == 1 and (s.start % block[0] or s.stop % block[0])):
        raise Unsupported(Reason.QUANTIZATION, f"{w.kind} tensor {s.base} split at {s.axis}:{s.start}:{s.stop}",
                          "a packed layout splits only along its blocks")
    blocks = w.parts["blocks"]
    if s.axis == 0:
        part = blocks[s.start:s.stop]
    else:
        elements, size = block
        part = blocks[:, s.start // elements * size: s.stop // elements * size].contiguous()
    return PackedWeight(w.layout, s.shape(tuple(w.shape)), {"blocks": part}, dict(w.meta))


def rank_store(store: Any, names: set[str], shards: dict[str, Shard]) -> WeightStore:
    """The weights one rank reads, each loaded (or sliced) at its first use, as a WeightStore."""
    shapes = store.shapes()
    loaders: dict[str, Any] = {}
    out_shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(names):
        s = shards.get(name)
        if s is None:
            loaders[name] = lambda name=name: store.get(name)
            out_shapes[name] = shapes[name]
        else:
            loaders[name] = lambda s=s: split(store.get(s.base), s)
            out_shapes[name] = s.shape(shapes[s.base])
    return WeightStore(loaders, out_shapes)


def shard_nbytes(store: Any, name: str, shards: dict[str, Shard]) -> int:
    """Bytes a weight (or a shard of one) takes, without reading its data."""
    s = shards.get(name)
    if s is None:
        return weight_nbytes(store.get(name))
    full = store.shapes()[s.base]
    return weight_nbytes(store.get(s.base)) * (s.stop - s.start) // full[s.axis]


__all__ = ["rank_store", "shard_nbytes", "split", "splittable"]
