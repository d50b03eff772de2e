"""Attention against a contiguous KV cache: flash-style prefill and split-KV (flash-decoding) decode.

Scores use exp2 with log2(e) folded into the scale. Masked scores are -inf while the running maximum starts
at a large finite negative, so a block with nothing visible adds exactly zero and never makes a NaN.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from poot_core.errors import Reason, Unsupported

from .launch import cdiv, check_dims, check_float, check_same_device, launch, next_pow2, require
from .matmul import dot
from .tuning import Tile, Tuning, tuning_for_device

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in the log2 domain (exp2)


@triton.jit
def _kv_tiles(k_base, v_base, kv_pos, kv_mask, offs_d, dmask, k_stride_p, v_stride_p, UPCAST: tl.constexpr):
    """Keys as [BLOCK_D, BLOCK_N] (ready for q @ k) and values as [BLOCK_N, BLOCK_D] at `kv_pos`, zeros where
    masked; widened to float32 when UPCAST."""
    k = tl.load(
        k_base + kv_pos[None, :].to(tl.int64) * k_stride_p + offs_d[:, None],
        mask=kv_mask[None, :] & dmask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_base + kv_pos[:, None].to(tl.int64) * v_stride_p + offs_d[None, :],
        mask=kv_mask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    limits_ptr,
    tokens,
    start,
    kv_len,
    scale,
    softcap,
    window,
    head_dim,
    q_stride_t,
    q_stride_h,
    k_stride_h,
    k_stride_p,
    v_stride_h,
    v_stride_p,
    o_stride_t,
    o_stride_h,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # the grid is (heads, query tiles): the heads of one tile run side by side (sharing its keys in the cache),
    # and the last tiles, which see the most keys, start first so the short ones fill the end
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    q = tl.load(
        q_ptr + offs_m[:, None].to(tl.int64) * q_stride_t + h * q_stride_h + offs_d[None, :],
        mask=(offs_m[:, None] < tokens) & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = start + offs_m
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(kv_len, start + (mb + 1) * BLOCK_M)
    if HAS_LIMITS:  # the last key each query sees, in place of its own position
        limit = tl.load(limits_ptr + offs_m, mask=offs_m < tokens, other=0)
        hi = tl.minimum(kv_len, tl.max(limit, axis=0) + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, start + mb * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * k_stride_h
    v_base = v_ptr + kvh.to(tl.int64) * v_stride_h
    # key tiles below `full` are seen whole by every query of the tile: they skip the per-score mask (the sums
    # are the same either way, a masked score adds exactly zero); a window masks every tile
    full = lo
    if not HAS_WINDOW:
        seen = kv_len
        if HAS_LIMITS:
            seen = tl.min(tl.where(offs_m < tokens, limit, kv_len), axis=0) + 1
        elif CAUSAL:
            seen = start + mb * BLOCK_M + 1
        full = (tl.minimum(seen, kv_len) // BLOCK_N) * BLOCK_N
    for n0 in range(lo, full, BLOCK_N):
        kv_pos = n0 + offs_n
        kv_mask = kv_pos < kv_len
        k, v = _kv_tiles(k_base, v_base, kv_pos, kv_mask, offs_d, dmask, k_stride_p, v_stride_p, UPCAST)
        m_i, l_i, acc = fold_tile(q, k, v, None, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, False)
    for n0 in range(full, hi, BLOCK_N):
        kv_pos = n0 + offs_n
        kv_mask = kv_pos < kv_len
        k, v = _kv_tiles(k_base, v_base, kv_pos, kv_mask, offs_d, dmask, k_stride_p, v_stride_p, UPCAST)
        visible = kv_mask[None, :]
        if HAS_LIMITS:
            visible = visible & (kv_pos[None, :] <= limit[:, None])
        elif CAUSAL:
            visible = visible & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
        m_i, l_i, acc = fold_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, True)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + offs_m[:, None].to(tl.int64) * o_stride_t + h * o_stride_h + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < tokens) & dmask[None, :],
    )


def _check_attention_options(causal: bool, window: int | None, softcap: float | None) -> None:
    if window is not None:
        require(window > 0, f"sliding window must be positive, got {window}")
        if not causal:
            raise Unsupported(Reason.OPERATION, "attention:bidirectional+sliding_window", "window needs causal")
    if softcap is not None:
        require(softcap > 0, f"soft-cap must be positive, got {softcap}")


def score_args(head_dim: int, scale: float | None, softcap: float | None, window: int | None,
               tuning: Tuning) -> dict:  # fmt: skip
    """The score arguments every attention kernel takes: the scale (1/sqrt(head_dim) unless given), the softcap
    (1.0 when off) and the window (0 when off) with their switches HAS_SOFTCAP and HAS_WINDOW, the head size, and
    UPCAST (the target widens tl.dot operands)."""
    return {"scale": float(scale if scale is not None else 1.0 / math.sqrt(head_dim)),
            "softcap": float(softcap or 1.0), "window": int(window or 0), "head_dim": head_dim,
            "HAS_WINDOW": window is not None, "HAS_SOFTCAP": softcap is not None, "UPCAST": tuning.upcast_dot}


def _prefill_shared(tile: Tile, block_d: int) -> int:
    """Elements of shared memory a prefill program holds: its query tile and `num_stages` key and value tiles."""
    return tile.block_m * block_d + tile.num_stages * 2 * tile.block_n * block_d


def fitted_prefill_tile(tile: Tile, block_d: int) -> Tile:
    """The target's prefill tile, narrowed for heads wider than 128 (Gemma's 256) until it holds no more shared
    memory than it does at 128, for which each target's tile was chosen: fewer stages first, then narrower key
    tiles, then fewer queries. Only a narrower key tile changes the order of the sums."""
    limit = _prefill_shared(tile, 128)
    while _prefill_shared(tile, block_d) > limit:
        if tile.num_stages > 1:
            tile = replace(tile, num_stages=tile.num_stages - 1)
        elif tile.block_n > 16:
            tile = replace(tile, block_n=tile.block_n // 2)
        elif tile.block_m > 16:
            tile = replace(tile, block_m=tile.block_m // 2)
        else:
            break
    return tile


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    kv_len: int | None = None,
    limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a chunk of one sequence's tokens against its KV cache (flash attention, online softmax).

    q: [tokens, q_heads, head_dim], the tokens at positions start .. start+tokens-1.
    k_cache, v_cache: [kv_heads, capacity, head_dim] (one layer's slice), already holding these tokens'
    keys and values; q_heads must be a multiple of kv_heads (GQA). Keys 0 .. kv_len-1 are read
    (kv_len defaults to start + tokens). causal: key j is visible to the query at position i when j <= i;
    window: also when i - j < window (sliding window, causal only); softcap: scores become
    softcap * tanh(scores / softcap) after scaling; scale defaults to 1/sqrt(head_dim).
    limits: int32 [tokens] on the device, the last key position each query sees instead of its own (causal
    only; at least its own, below kv_len: group_attention's image tokens see their whole image).
    Dtypes float32/float16/bfloat16; float32 accumulation. Returns [tokens, q_heads, head_dim] in q's dtype.
    """
    check_dims("q", q, 3)
    check_dims("k_cache", k_cache, 3)
    check_dims("v_cache", v_cache, 3)
    check_float("q", q)
    check_float("k_cache", k_cache)
    check_same_device(q, k_cache, v_cache)
    _check_attention_options(causal, window, softcap)
    tokens, q_heads, head_dim = q.shape
    kv_heads, capacity, _ = k_cache.shape
    require(k_cache.shape == v_cache.shape, "k and v caches differ in shape")
    require(k_cache.shape[2] == head_dim, f"cache head size {k_cache.shape[2]} != q head size {head_dim}")
    require(q_heads % kv_heads == 0, f"{q_heads} query heads do not group over {kv_heads} kv heads")
    kv_len = start + tokens if kv_len is None else kv_len
    if limits is not None:
        require(causal, "limits bound a causal attention")
        require(limits.shape == (tokens,) and limits.dtype == torch.int32, "limits must be int32 [tokens]")
        check_same_device(q, limits)
    require(
        0 <= start and start + tokens <= kv_len <= capacity,
        f"kv_len {kv_len} outside [start+tokens, capacity]",
    )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require(t.stride(-1) == 1, f"{name} needs a contiguous last dimension")
    out = torch.empty_like(q)
    tuning = tuning_for_device(q.device)
    block_d = max(16, next_pow2(head_dim))
    tile = fitted_prefill_tile(tuning.prefill, block_d)
    launch(
        _prefill_kernel,
        (q_heads, cdiv(tokens, tile.block_m)),
        tile,
        q_ptr=q,
        k_ptr=k_cache,
        v_ptr=v_cache,
        o_ptr=out,
        limits_ptr=q if limits is None else limits,
        tokens=tokens,
        start=start,
        kv_len=kv_len,
        **score_args(head_dim, scale, softcap, window, tuning),
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        k_stride_h=k_cache.stride(0),
        k_stride_p=k_cache.stride(1),
        v_stride_h=v_cache.stride(0),
        v_stride_p=v_cache.stride(1),
        o_stride_t=out.stride(0),
        o_stride_h=out.stride(1),
        GROUP=q_heads // kv_heads,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=block_d,
        CAUSAL=causal,
        HAS_LIMITS=limits is not None,
    )
    return out


@triton.jit
def group_query(q_row, kvh, q_stride_h, head_dim, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr):  # fmt: skip
    """One token's query heads of kv head kvh's group (BLOCK_H rows, the first GROUP real) from its row q_row:
    (q, heads, hmask, offs_d, dmask)."""
    g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    q = tl.load(q_row + heads[:, None] * q_stride_h + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q, heads, hmask, offs_d, dmask


@triton.jit
def decode_tile(q, k, v, kv_mask, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """One tile of keys and values folded into a decode query group's running softmax. Shared by the contiguous
    and the paged decode."""
    return fold_tile(q, k, v, kv_mask[None, :], m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, True)


@triton.jit
def fold_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One tile of keys [D, N] and values [N, D] folded into the queries' running softmax (base 2): the running
    maximum m_i, the sum l_i and the weighted values acc; when MASKED, `visible` [M, N] (or [1, N]) masks the
    scores (a tile every query sees whole skips it and passes None). Every attention kernel's inner step. The
    scale (with log2(e)) is applied inside the exponent's multiply-add, so a score costs few operations beside the
    products."""
    s = dot(q, k, tl.zeros([q.shape[0], k.shape[1]], tl.float32))
    to_log2 = scale * LOG2E
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s * scale) / softcap) - 1.0) * LOG2E
        to_log2 = 1.0
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * to_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * to_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def store_split(mid_o_ptr, mid_lse_ptr, row, heads, split, offs_d, hmask, dmask, acc, l_i, m_i, mo_stride_b,
                mo_stride_h, mo_stride_s, ml_stride_b, ml_stride_h):  # fmt: skip
    """A split's normalised output and log-sum-exp (base 2; -inf for a split that saw no key) for the reduce
    kernel."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(
        mid_o_ptr + row * mo_stride_b + heads[:, None] * mo_stride_h + split * mo_stride_s + offs_d[None, :],
        out,
        mask=hmask[:, None] & dmask[None, :],
    )
    tl.store(mid_lse_ptr + row * ml_stride_b + heads * ml_stride_h + split, lse, mask=hmask)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    split_size,
    scale,
    softcap,
    window,
    head_dim,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    k_stride_p,
    v_stride_b,
    v_stride_h,
    v_stride_p,
    mo_stride_b,
    mo_stride_h,
    mo_stride_s,
    ml_stride_b,
    ml_stride_h,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q, heads, hmask, offs_d, dmask = group_query(q_ptr + b * q_stride_b, kvh, q_stride_h, head_dim, GROUP,
                                                 BLOCK_H, BLOCK_D, UPCAST)  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    lo = split * split_size
    hi = tl.minimum(lo + split_size, kv_len)
    if HAS_WINDOW:
        # the query sits at kv_len - 1 and sees keys with (kv_len - 1) - j < window
        lo = tl.maximum(lo, kv_len - window)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + b * k_stride_b + kvh.to(tl.int64) * k_stride_h
    v_base = v_ptr + b * v_stride_b + kvh.to(tl.int64) * v_stride_h
    for n0 in range(lo, hi, BLOCK_N):
        kv_pos = n0 + offs_n
        kv_mask = kv_pos < hi
        k, v = _kv_tiles(k_base, v_base, kv_pos, kv_mask, offs_d, dmask, k_stride_p, v_stride_p, UPCAST)
        m_i, l_i, acc = decode_tile(q, k, v, kv_mask, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP)
    store_split(mid_o_ptr, mid_lse_ptr, b, heads, split, offs_d, hmask, dmask, acc, l_i, m_i, mo_stride_b,
                mo_stride_h, mo_stride_s, ml_stride_b, ml_stride_h)  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    splits,
    head_dim,
    mo_stride_b,
    mo_stride_h,
    mo_stride_s,
    ml_stride_b,
    ml_stride_h,
    o_stride_b,
    o_stride_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < splits
    lse = tl.load(mid_lse_ptr + b * ml_stride_b + h * ml_stride_h + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(
        mid_o_ptr + b * mo_stride_b + h * mo_stride_h + s[:, None] * mo_stride_s + d[None, :],
        mask=smask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + b * o_stride_b + h * o_stride_h + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One new token per row attending to its cache, split over the KV length (flash-decoding).

    q: [batch, q_heads, head_dim], each row's token at position kv_lens[row] - 1 (its k/v already written).
    k_cache, v_cache: [batch, kv_heads, capacity, head_dim], or [kv_heads, capacity, head_dim] when batch
    is 1. kv_lens: [batch] int32/int64 on the device (read there: no host sync, so CUDA-graph safe).
    window / softcap / scale as in `prefill_attention`. The split count depends only on the capacity, never
    on kv_lens. Partial results are float32 [batch, q_heads, splits, head_dim] plus a log-sum-exp, then a
    second kernel merges them. Returns [batch, q_heads, head_dim] in q's dtype.
    """
    check_dims("q", q, 3)
    check_float("q", q)
    check_float("k_cache", k_cache)
    if k_cache.dim() == 3:
        k_cache, v_cache = k_cache.unsqueeze(0), v_cache.unsqueeze(0)
    check_dims("k_cache", k_cache, 4)
    check_dims("v_cache", v_cache, 4)
    check_same_device(q, k_cache, v_cache, kv_lens)
    _check_attention_options(True, window, softcap)
    batch, q_heads, head_dim = q.shape
    _, kv_heads, capacity, _ = k_cache.shape
    require(k_cache.shape == v_cache.shape, "k and v caches differ in shape")
    require(k_cache.shape[0] == batch, f"cache batch {k_cache.shape[0]} != q batch {batch}")
    require(k_cache.shape[3] == head_dim, f"cache head size {k_cache.shape[3]} != q head size {head_dim}")
    require(q_heads % kv_heads == 0, f"{q_heads} query heads do not group over {kv_heads} kv heads")
    require(kv_lens.shape == (batch,), "kv_lens must be [batch]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require(t.stride(-1) == 1, f"{name} needs a contiguous last dimension")
    tuning = tuning_for_device(q.device)
    tile = tuning.decode
    group = q_heads // kv_heads
    if num_splits is None:
        num_splits = max(1, tuning.decode_programs // max(1, batch * kv_heads))
    num_splits = max(1, min(num_splits, cdiv(capacity, tile.block_n)))
    split_size = cdiv(cdiv(capacity, num_splits), tile.block_n) * tile.block_n
    num_splits = cdiv(capacity, split_size)
    mid_o = torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = max(16, next_pow2(head_dim))
    launch(
        _decode_split_kernel,
        (batch, kv_heads, num_splits),
        tile,
        q_ptr=q,
        k_ptr=k_cache,
        v_ptr=v_cache,
        lens_ptr=kv_lens,
        mid_o_ptr=mid_o,
        mid_lse_ptr=mid_lse,
        split_size=split_size,
        **score_args(head_dim, scale, softcap, window, tuning),
        q_stride_b=q.stride(0),
        q_stride_h=q.stride(1),
        k_stride_b=k_cache.stride(0),
        k_stride_h=k_cache.stride(1),
        k_stride_p=k_cache.stride(2),
        v_stride_b=v_cache.stride(0),
        v_stride_h=v_cache.stride(1),
        v_stride_p=v_cache.stride(2),
        mo_stride_b=mid_o.stride(0),
        mo_stride_h=mid_o.stride(1),
        mo_stride_s=mid_o.stride(2),
        ml_stride_b=mid_lse.stride(0),
        ml_stride_h=mid_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(tile.block_m, next_pow2(group)),
        BLOCK_N=tile.block_n,
        BLOCK_D=block_d,
    )
    merge_splits(mid_o, mid_lse, out, tuning)
    return out


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, tuning: Tuning) -> None:
    """out [rows, q_heads, head_dim] from the splits' outputs mid_o [rows, q_heads, splits, head_dim] and
    log-sum-exps mid_lse [rows, q_heads, splits] (the second kernel of every split decode)."""
    rows, q_heads, splits, head_dim = mid_o.shape
    launch(
        _decode_reduce_kernel,
        (rows, q_heads),
        Tile(num_warps=min(4, tuning.row_warps), num_stages=1),
        mid_o_ptr=mid_o,
        mid_lse_ptr=mid_lse,
        o_ptr=out,
        splits=splits,
        head_dim=head_dim,
        mo_stride_b=mid_o.stride(0),
        mo_stride_h=mid_o.stride(1),
        mo_stride_s=mid_o.stride(2),
        ml_stride_b=mid_lse.stride(0),
        ml_stride_h=mid_lse.stride(1),
        o_stride_b=out.stride(0),
        o_stride_h=out.stride(1),
        BLOCK_S=next_pow2(splits),
        BLOCK_D=next_pow2(head_dim),
    )
