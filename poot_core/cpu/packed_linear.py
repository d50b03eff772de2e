"""x @ W^T (+ bias) for a packed W, computed tile by tile from the packed form.

Each tile of output rows is decoded to float32 (a few MB at most), multiplied, and dropped: no float copy of the
whole matrix is ever kept. The result equals dequantize-then-matmul in float32 up to summation order.

`fast=True` is an explicit, less exact option for the 4-bit GGUF types with an affine form (Q4_0, Q4_1, Q4_K):
their codes are re-laid once, losslessly, into torch's packed int4 CPU format (same 4 bits per weight) and the
product runs in torch's int4 kernel with bfloat16 activations and scales (about 1e-3 relative error).
"""

from __future__ import annotations

import weakref

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.checkpoint.quant import gguf_blocks as gb

TILE_BYTES = 2 << 20  # float32 bytes of one decoded tile; small enough to stay in L2/L3


def tile_rows(in_features: int) -> int:
    """Output rows per tile: about TILE_BYTES of float32, a multiple of 16."""
    return max(16, (TILE_BYTES // (4 * max(in_features, 1))) // 16 * 16)


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT4_CACHE: weakref.WeakKeyDictionary[PackedWeight, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _int4_codes_and_affine(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes int32 [out, in] in 0..15 and per-32 group scale, offset [out, in / 32] with value = code * s + o."""
    kind, out_f = w.meta["type"], w.shape[0]
    b = w.parts["blocks"].reshape(-1, gb.BLOCK_SIZES[kind][1])
    if kind == "Q4_K":
        codes = gb._k_nibbles(b[:, 16:144])
        scales, mins = gb._k4_scales(b[:, 4:16])
        s, o = gb._f16(b, 0) * scales.float(), -(gb._f16(b, 2) * mins.float())
    else:
        start = 2 if kind == "Q4_0" else 4
        codes = gb._nibbles(b[:, start : start + 16])
        s = gb._f16(b, 0)
        o = -8 * s if kind == "Q4_0" else gb._f16(b, 2)
    return codes.reshape(out_f, -1).to(torch.int32), s.reshape(out_f, -1), o.reshape(out_f, -1)


def _int4_packed(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    cached = _INT4_CACHE.get(w)
    if cached is None:
        codes, s, o = _int4_codes_and_affine(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # torch's int4 kernel computes (code - 8) * scale + zero.
        scales_zeros = torch.stack((s, o + 8 * s), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        cached = _INT4_CACHE[w] = (packed, scales_zeros)
    return cached


def packed_linear(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, fast: bool = False
) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out]; fast=True trades exactness for speed where a route exists."""
    if fast and w.layout == "gguf" and w.meta.get("type") in INT4_TYPES and len(w.shape) == 2:
        packed, scales_zeros = _int4_packed(w)
        flat = x.reshape(-1, w.shape[1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, 32, scales_zeros).float()
        if bias is not None:
            out += bias.float()
        return out.reshape(*x.shape[:-1], w.shape[0])
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
