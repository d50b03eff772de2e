"""x @ W^T (+ bias) for a packed W, computed tile by tile from the packed form.

Each tile of output rows is decoded to float32 (a few MB at most), multiplied, and dropped: no float copy of the
whole matrix is ever kept. The result equals dequantize-then-matmul in float32 up to summation order.
"""

from __future__ import annotations

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize

TILE_BYTES = 2 << 20  # float32 bytes of one decoded tile; small enough to stay in L2/L3


def tile_rows(in_features: int) -> int:
    """Output rows per tile: about TILE_BYTES of float32, a multiple of 16."""
    return max(16, (TILE_BYTES // (4 * max(in_features, 1))) // 16 * 16)


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out]."""
    out_features, in_features = w.shape[0], w.shape[-1]
    if len(w.shape) != 2:
        out_features = int(torch.tensor(w.shape[:-1]).prod())
    flat = x.reshape(-1, in_features).float()
    out = torch.empty(flat.shape[0], out_features)
    tile = tile_rows(in_features)
    for start in range(0, out_features, tile):
        rows = slice(start, min(start + tile, out_features))
        torch.matmul(flat, dequantize(w, rows).T, out=out[:, rows])
    if bias is not None:
        out += bias.float()
    return out.reshape(*x.shape[:-1], out_features)
