"""Rotary position embedding (neox / rotate-half style) and the write of k/v into a contiguous KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_dims, check_float, check_same_device, launch, next_pow2, require
from .tuning import Tile, tuning_for_device


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    heads,
    head_dim,
    x_stride_t,
    x_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    COPY_REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    mask = (h[:, None] < heads) & dmask[None, :]
    cos = tl.load(cos_ptr + pos * table_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * table_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        # pairs (0, 1), (2, 3), ...: llama.cpp's layout of q and k
        first = 2 * d
        second = 2 * d + 1
    else:
        # neox: dimension i pairs with i + HALF
        first = d
        second = d + HALF
    src = x_ptr + t * x_stride_t + h[:, None] * x_stride_h
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * out_stride_t + h[:, None] * out_stride_h
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_REST:
        # partial rotary, out of place: the dimensions past the rotary ones pass through
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        rmask = (h[:, None] < heads) & (r[None, :] < head_dim)
        rest = tl.load(x_ptr + t * x_stride_t + h[:, None] * x_stride_h + r[None, :], mask=rmask)
        tl.store(out_ptr + t * out_stride_t + h[:, None] * out_stride_h + r[None, :], rest, mask=rmask)


def rope_cos_sin(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables [max_positions, len(inv_freq)] float32 that `apply_rope` reads.

    inv_freq: [rotary_dim // 2] float32, already adjusted by any rope scaling (llama3, yarn, ...);
    attention_scaling multiplies both tables (yarn's mscale).
    """
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    angles = pos[:, None] * inv_freq.to(torch.float32)[None, :]
    return (angles.cos() * attention_scaling).contiguous(), (angles.sin() * attention_scaling).contiguous()


def _rope_one(
    x: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> None:
    tokens, heads, head_dim = x.shape
    half = cos.shape[1]
    copy_rest = out.data_ptr() != x.data_ptr() and 2 * half < head_dim
    tuning = tuning_for_device(x.device)
    block_h = next_pow2(heads)
    block_half = next_pow2(half)
    launch(
        _rope_kernel,
        (tokens,),
        Tile(num_warps=min(4, tuning.row_warps), num_stages=1),
        x_ptr=x,
        out_ptr=out,
        pos_ptr=positions,
        cos_ptr=cos,
        sin_ptr=sin,
        heads=heads,
        head_dim=head_dim,
        x_stride_t=x.stride(0),
        x_stride_h=x.stride(1),
        out_stride_t=out.stride(0),
        out_stride_h=out.stride(1),
        table_stride=cos.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        COPY_REST=copy_rest,
        BLOCK_REST=next_pow2(max(1, head_dim - 2 * half)),
        INTERLEAVED=interleaved,
    )


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    inplace: bool = True,
) -> torch.Tensor:
    """Rotate one tensor x [tokens, heads, head_dim] by its positions: neox style (i pairs with
    i + rotary_dim/2), or interleaved (pairs (0, 1), (2, 3), ...). Tables and dtypes as in `apply_rope`."""
    check_dims("x", x, 3)
    check_float("x", x)
    check_dims("positions", positions, 1)
    check_same_device(x, positions, cos, sin)
    require(x.shape[0] == positions.shape[0], "x and positions disagree on the token count")
    require(cos.shape == sin.shape and cos.dim() == 2, "cos and sin must be [max_positions, rotary_dim // 2]")
    require(2 * cos.shape[1] <= x.shape[2], f"rotary dim {2 * cos.shape[1]} exceeds head size {x.shape[2]}")
    require(x.stride(2) == 1, "x needs a contiguous last dimension")
    require(cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos and sin must be contiguous alike")
    out = x if inplace else torch.empty_like(x)
    _rope_one(x, out, positions, cos, sin, interleaved)
    return out


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions, neox style (dimension i pairs with i + rotary_dim/2).

    q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim], float32/float16/bfloat16, last dim
    contiguous. positions: [tokens] int32/int64 (each < cos.shape[0]). cos, sin: [max_positions,
    rotary_dim // 2] float32 (see `rope_cos_sin`); rotary_dim may be less than head_dim (partial rotary:
    the remaining dimensions are left as they are). Math in float32.
    Returns (q, k) rotated: the same tensors when inplace, new ones otherwise.
    """
    check_dims("q", q, 3)
    check_dims("k", k, 3)
    check_float("q", q)
    check_float("k", k)
    check_dims("positions", positions, 1)
    check_same_device(q, k, positions, cos, sin)
    require(q.shape[0] == k.shape[0] == positions.shape[0], "q, k and positions disagree on the token count")
    require(q.shape[2] == k.shape[2], "q and k have different head sizes")
    require(cos.shape == sin.shape and cos.dim() == 2, "cos and sin must be [max_positions, rotary_dim // 2]")
    require(2 * cos.shape[1] <= q.shape[2], f"rotary dim {2 * cos.shape[1]} exceeds head size {q.shape[2]}")
    require(q.stride(2) == 1 and k.stride(2) == 1, "q and k need a contiguous last dimension")
    require(cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos and sin must be contiguous alike")
    q_out = q if inplace else torch.empty_like(q)
    k_out = k if inplace else torch.empty_like(k)
    _rope_one(q, q_out, positions, cos, sin)
    _rope_one(k, k_out, positions, cos, sin)
    return q_out, k_out


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    kv_heads,
    head_dim,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kc_stride_h,
    kc_stride_p,
    vc_stride_h,
    vc_stride_p,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < kv_heads) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=mask)
    kc = kc_ptr + h[:, None] * kc_stride_h + pos * kc_stride_p + d[None, :]
    vc = vc_ptr + h[:, None] * vc_stride_h + pos * vc_stride_p + d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    layer: int | None = None,
) -> None:
    """Store k and v of new tokens into a contiguous KV cache at their positions.

    k, v: [tokens, kv_heads, head_dim]. k_cache, v_cache: [kv_heads, capacity, head_dim], or
    [layers, kv_heads, capacity, head_dim] with `layer` naming the one to write; values are converted to
    the cache's dtype. positions: [tokens] int32/int64, each < capacity (not checked on the device: that
    would need a host sync).
    """
    if layer is not None:
        check_dims("k_cache", k_cache, 4)
        check_dims("v_cache", v_cache, 4)
        require(0 <= layer < k_cache.shape[0], f"layer {layer} outside a cache of {k_cache.shape[0]} layers")
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    check_dims("k", k, 3)
    check_dims("v", v, 3)
    check_dims("k_cache", k_cache, 3)
    check_dims("v_cache", v_cache, 3)
    check_same_device(k, v, k_cache, v_cache, positions)
    tokens, kv_heads, head_dim = k.shape
    require(v.shape == k.shape, "k and v shapes differ")
    require(k_cache.shape == v_cache.shape, "k and v caches differ in shape")
    require(k_cache.shape[0] == kv_heads and k_cache.shape[2] == head_dim, "cache and k disagree on heads/dim")
    require(positions.shape == (tokens,), "positions must be [tokens]")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        require(t.stride(-1) == 1, f"{name} needs a contiguous last dimension")
    tuning = tuning_for_device(k.device)
    launch(
        _write_kv_kernel,
        (tokens,),
        Tile(num_warps=min(4, tuning.row_warps), num_stages=1),
        k_ptr=k,
        v_ptr=v,
        kc_ptr=k_cache,
        vc_ptr=v_cache,
        pos_ptr=positions,
        kv_heads=kv_heads,
        head_dim=head_dim,
        k_stride_t=k.stride(0),
        k_stride_h=k.stride(1),
        v_stride_t=v.stride(0),
        v_stride_h=v.stride(1),
        kc_stride_h=k_cache.stride(0),
        kc_stride_p=k_cache.stride(1),
        vc_stride_h=v_cache.stride(0),
        vc_stride_p=v_cache.stride(1),
        BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
