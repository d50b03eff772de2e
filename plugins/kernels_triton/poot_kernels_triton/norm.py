"""Fused residual add + RMSNorm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_dims, check_float, check_same_device, launch, next_pow2, require, unit_stride_last
from .tuning import Tile, row_warps, tuning_for_device


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    hidden,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, total, mask=mask)
        # the norm reads the sum as it was stored, as the next layer will
        x = total.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    y = x * tl.rsqrt(mean_square + eps) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    inplace: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add `x` to the residual stream, then RMS-normalize the sum.

    x: [rows, hidden] float32/float16/bfloat16. residual: [rows, hidden] (any float dtype) or None (then the
    new residual is `x` itself). weight: [hidden]. The scale is `weight + weight_offset` (gemma: offset 1.0).
    Arithmetic is float32; the sum is rounded to the residual's dtype before it is normalized.
    Returns (new_residual [rows, hidden] in residual's dtype, normed [rows, hidden] in x's dtype).
    With inplace=True the sum is written into `residual` and `residual` is returned. out_dtype, when given,
    is the dtype of the normed output instead of x's (a float32 residual stream feeding 16-bit matmuls).
    """
    check_dims("x", x, 2)
    check_dims("weight", weight, 1)
    check_float("x", x)
    rows, hidden = x.shape
    require(weight.shape[0] == hidden, f"weight has {weight.shape[0]} entries, hidden size is {hidden}")
    x = unit_stride_last(x)
    weight = weight.contiguous()
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    if residual is not None:
        check_float("residual", residual)
        require(tuple(residual.shape) == (rows, hidden), f"residual shape {tuple(residual.shape)} != x shape")
        check_same_device(x, residual, weight)
        residual = unit_stride_last(residual)
        res_out = residual if inplace else torch.empty_like(residual)
    else:
        check_same_device(x, weight)
        res_out = x
    tuning = tuning_for_device(x.device)
    block = next_pow2(hidden)
    launch(
        _add_rms_norm_kernel,
        (rows,),
        Tile(num_warps=row_warps(block, tuning), num_stages=1),
        x_ptr=x,
        res_ptr=residual if residual is not None else x,
        w_ptr=weight,
        out_ptr=out,
        res_out_ptr=res_out,
        hidden=hidden,
        x_stride=x.stride(0),
        res_stride=(residual if residual is not None else x).stride(0),
        out_stride=out.stride(0),
        res_out_stride=res_out.stride(0),
        eps=float(eps),
        weight_offset=float(weight_offset),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
    )
    return res_out, out
