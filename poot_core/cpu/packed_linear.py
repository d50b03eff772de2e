"""x @ W^T for a packed W, computed tile by tile from the packed bytes: a few MB of float32 at a time,
never a float copy of the whole matrix."""

from __future__ import annotations

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize

TILE_BYTES = 4 << 20


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    out_features, in_features = w.shape[-2], w.shape[-1]
    tile = max(1, TILE_BYTES // (4 * in_features))
    flat = x.reshape(-1, in_features)
    out = torch.empty(flat.shape[0], out_features)
    for start in range(0, out_features, tile):
        rows = slice(start, min(start + tile, out_features))
        out[:, rows] = flat @ dequantize(w, rows).T
    return out.reshape(*x.shape[:-1], out_features)
