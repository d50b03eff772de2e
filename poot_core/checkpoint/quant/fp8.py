"""FP8 (e4m3) weights with their scales.

Three granularities: "tensor" (one scale), "channel" (one scale per output row, [out, 1]) and "block" (one
scale per block of rows x columns, [ceil(out / br), ceil(in / bc)], as in `weight_scale_inv` of Hugging Face's
fine-grained FP8 and compressed-tensors' block strategy). Element value: float(fp8) * scale.
"""

from __future__ import annotations

import torch


def fp8_dequantize(parts: dict[str, torch.Tensor], meta: dict, rows: slice | None = None) -> torch.Tensor:
    """float32 [selected out rows, in] of an FP8 matrix."""
    weight, scale = parts["weight"], parts["scale"].float()
    start = 0
    if rows is not None:
        start = rows.indices(weight.shape[0])[0]
        weight = weight[rows]
    w = weight.float()
    granularity = meta["granularity"]
    if granularity == "tensor":
        return w * scale.reshape(())
    if granularity == "channel":
        s = scale.reshape(-1, 1)
        return w * (s[rows] if rows is not None else s)
    br, bc = meta["block"]
    r = (torch.arange(w.shape[0]) + start) // br
    c = torch.arange(w.shape[1]) // bc
    return w * scale[r][:, c]
