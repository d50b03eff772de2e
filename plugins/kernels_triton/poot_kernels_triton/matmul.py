"""x @ W^T for dense 16-bit weights: a GEMV for a few rows (decode) and a tiled GEMM for many (prefill)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import cdiv, check_dims, check_float, check_same_device, launch, require, unit_stride_last
from .splitk import choose_split, finish_split, split_buffers, steps_per_split
from .tuning import Tile, Tuning, tuning_for_device


@triton.jit
def dot(a, b, acc):
    """acc + a @ b. Float32 operands multiply in full float32: Triton's default for them on NVIDIA is TF32 (10
    mantissa bits), which torch's float32 matmul does not do, so a float32 model would drift from transformers."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def dot_tiles(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for a GEMM step: both tiles in float32 when UPCAST (the interpreter), else b in a's dtype
    (the tensor cores' input type)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        b = b.to(a.dtype)
    return dot(a, b, acc)


@triton.jit
def gemm_tile(m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] output tile of an m x n GEMM (program ids 0 and 1): its rows, its
    columns and their masks (shared by the GEMM kernels)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < m, offs_n < n


@triton.jit
def gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask):
    """One [BLOCK_M, BLOCK_K] tile of the activations, zeros past the edges (shared by the GEMM kernels)."""
    return tl.load(
        x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
        mask=mmask[:, None] & kmask[None, :],
        other=0.0,
    )


@triton.jit
def gemm_store(o_ptr, o_stride, b_ptr, acc, offs_m, offs_n, mmask, nmask, HAS_BIAS: tl.constexpr):
    """The float32 accumulator (plus the bias) into its output tile, in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + offs_m[:, None].to(tl.int64) * o_stride + offs_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )

GEMV_MAX_ROWS = 4  # up to this many rows, weights are streamed once per row (bandwidth bound anyway)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    part_ptr,
    lock_ptr,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    k_per_split,
    n_tiles,
    split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k, k_start + k_per_split)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        x = tl.load(x_ptr + row * x_stride + offs_k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :],
            mask=nmask[:, None] & kmask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    finish_split(acc, offs_n, nmask, b_ptr, o_ptr, o_stride, part_ptr, lock_ptr, n, n_tiles, split,
                 HAS_BIAS, SPLIT, BLOCK_N)  # fmt: skip


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
    offs_m, offs_n, mmask, nmask = gemm_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        a = gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask)
        b = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None],
            mask=nmask[None, :] & kmask[:, None],
            other=0.0,
        )
        acc = dot_tiles(a, b, acc, UPCAST)
    gemm_store(o_ptr, o_stride, b_ptr, acc, offs_m, offs_n, mmask, nmask, HAS_BIAS)


def gemv_tile(
    n: int,
    rows: int,
    tuning: Tuning,
    tile: Tile | None = None,
    min_block: int = 8,
    k: int = 0,
    kind: str = "dense",
) -> Tile:
    """The GEMV tile for an output of width n: a measured tile for (kind, n, k) when `GEMV_TILES` has one,
    else the tuning's tile with narrower blocks when that would leave fewer programs than the target keeps
    busy (a 4096-wide projection in 64-wide blocks fills only 64 programs, half an H200). The split along k
    is chosen later (splitk.choose_split) unless the tile sets it. `GEMV_OVERRIDE[kind]` replaces it all
    (benchmark sweeps, tests)."""
    if kind in GEMV_OVERRIDE:
        return GEMV_OVERRIDE[kind]
    if (kind, n, k) in GEMV_TILES:
        return GEMV_TILES[(kind, n, k)]
    tile = tuning.gemv if tile is None else tile
    block_n = tile.block_n
    while block_n > min_block and cdiv(n, block_n) * rows < tuning.decode_programs:
        block_n //= 2
    if block_n == tile.block_n:
        return tile
    return dataclasses.replace(tile, block_n=block_n, extra=dict(tile.extra))


# kind ("dense", "q4_k", "gptq") -> the tile every GEMV of that kind uses (benchmark sweeps, tests)
GEMV_OVERRIDE: dict[str, Tile] = {}
# Tiles measured best for particular (kind, n, k) shapes on the running device (filled by a benchmark sweep).
GEMV_TILES: dict[tuple[str, int, int], Tile] = {}


def launch_gemv(kernel: Any, tile: Tile, width: int, rows: int, steps: int, step: int, device: torch.device,
                tuning: Tuning, /, programs: int = 0, **args: Any) -> None:  # fmt: skip
    """Launch a GEMV kernel over (width / block_n tiles, rows, split) programs: `steps` steps of `step` along k shared
    among the split programs of each tile (split to reach `programs`, default the tuning's gemv_programs).
    The kernel takes k_per_split in its own unit of k (elements, 64-element chunks or 8-element words:
    `step` is a step's size in that unit)."""
    tiles = cdiv(width, tile.block_n)
    per = steps_per_split(steps, choose_split(tile, tiles * rows, steps, tuning, programs))
    split, part, locks = split_buffers(cdiv(steps, per), rows, width, tiles, device)
    if split == 1:
        per = steps
    launch(
        kernel,
        (tiles, rows, split),
        tile,
        part_ptr=part if part is not None else args["o_ptr"],
        lock_ptr=locks if locks is not None else args["o_ptr"],
        n_tiles=tiles,
        split=split,
        SPLIT=split > 1,
        k_per_split=per * step,
        **args,
    )


def _vendor_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                 tuning: Tuning) -> bool:
    """Whether the vendor's BLAS computes this product (Tuning.vendor_gemm_rows): 16-bit operands of one dtype,
    the output in that dtype (float32 logits keep the Triton GEMM, which stores its float32 sums)."""
    rows = tuning.vendor_gemm_rows
    return (rows > 0 and x.shape[0] >= max(rows, GEMV_MAX_ROWS + 1) and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and out_dtype in (None, x.dtype))


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
    GEMV kernel; more take the tiled GEMM (its tl.dot runs in x's dtype on a GPU), or the vendor's BLAS where
    the target's tuning says so (`_vendor_gemm`). out_dtype: the output's dtype when not x's (float32 logits
    from 16-bit activations).
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
    tuning = tuning_for_device(x.device)
    if _vendor_gemm(x, weight, bias, out_dtype, tuning):
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
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
        launch_gemv(
            _gemv_kernel, tile, n, m, cdiv(k, tile.block_k), tile.block_k, x.device, tuning,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, **common,
        )  # fmt: skip
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
