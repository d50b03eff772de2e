"""x @ W^T for dense 16-bit weights: a GEMV for a few rows (decode) and a tiled GEMM for many (prefill)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, check_dims, check_float, check_same_device, launch, require, unit_stride_last
from .tuning import Tile, Tuning, tuning_for_device

GEMV_MAX_ROWS = 4  # up to this many rows, weights are streamed once per row (bandwidth bound anyway)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        x = tl.load(x_ptr + row * x_stride + offs_k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :],
            mask=nmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_stride + offs_n, acc.to(o_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    m,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < m
    nmask = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None],
            mask=nmask[None, :] & kmask[:, None],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + offs_m[:, None].to(tl.int64) * o_stride + offs_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def gemv_tile(n: int, rows: int, tuning: Tuning, tile: Tile | None = None, min_block: int = 8, k: int = 0) -> Tile:
    """The GEMV tile for an output of width n: the tuning's tile, with narrower blocks when that would
    leave fewer programs than the target keeps busy (a 4096-wide projection in 64-wide blocks fills only
    64 programs, half an H200). `GEMV_OVERRIDE` replaces it (benchmark sweeps)."""
    if GEMV_OVERRIDE is not None and tile is None:
        return GEMV_OVERRIDE
    if tile is None and (n, k) in GEMV_TILES:
        return GEMV_TILES[(n, k)]
    tile = tuning.gemv if tile is None else tile
    block_n = tile.block_n
    while block_n > min_block and cdiv(n, block_n) * rows < tuning.decode_programs:
        block_n //= 2
    if block_n == tile.block_n:
        return tile
    return Tile(
        block_n=block_n,
        block_k=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        extra=dict(tile.extra),
    )


GEMV_OVERRIDE: Tile | None = None
# Tiles measured best for particular (n, k) dense shapes on the running device (filled by a benchmark sweep).
GEMV_TILES: dict[tuple[int, int], Tile] = {}


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight^T (+ bias).

    x: [m, k] float32/float16/bfloat16. weight: [n, k] float16/bfloat16/float32, last dim contiguous.
    bias: [n] or None. Accumulates in float32. Returns [m, n] in x's dtype. Rows <= GEMV_MAX_ROWS take the
    GEMV kernel; more take the tiled GEMM (its tl.dot runs in x's dtype on a GPU). out_dtype: the output's
    dtype when not x's (float32 logits from 16-bit activations).
    """
    check_dims("x", x, 2)
    check_dims("weight", weight, 2)
    check_float("x", x)
    check_float("weight", weight)
    m, k = x.shape
    n = weight.shape[0]
    require(weight.shape[1] == k, f"weight is {tuple(weight.shape)}, x has {k} columns")
    if bias is not None:
        require(bias.shape == (n,), f"bias must be [{n}]")
        check_same_device(x, weight, bias)
    else:
        check_same_device(x, weight)
    x = unit_stride_last(x)
    weight = unit_stride_last(weight)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    tuning = tuning_for_device(x.device)
    common = dict(
        x_ptr=x,
        w_ptr=weight,
        b_ptr=bias if bias is not None else weight,
        o_ptr=out,
        n=n,
        k=k,
        x_stride=x.stride(0),
        w_stride=weight.stride(0),
        o_stride=out.stride(0),
        HAS_BIAS=bias is not None,
    )
    if m <= GEMV_MAX_ROWS:
        tile = gemv_tile(n, m, tuning, k=k)
        launch(
            _gemv_kernel,
            (cdiv(n, tile.block_n), m),
            tile,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            **common,
        )
    else:
        tile = tuning.gemm
        if x.dtype == torch.float32 and tile.num_stages > 2:
            # float32 tiles are twice the bytes: 4 stages of 128x64 + 64x128 overflow Hopper's shared memory
            tile = Tile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, 2, dict(tile.extra))
        launch(
            _gemm_kernel,
            (cdiv(m, tile.block_m), cdiv(n, tile.block_n)),
            tile,
            m=m,
            UPCAST=tuning.upcast_dot,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            **common,
        )
    return out
