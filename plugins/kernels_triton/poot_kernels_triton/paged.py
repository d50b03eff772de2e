"""Attention over a paged KV cache (StepShape.paging): pools of fixed-size blocks, one block table per sequence.

A pool is [blocks, kv_heads, block_size, head_dim]; a sequence's position p lives in block
`tables[seq, p // block_size]` at offset p % block_size. `write_paged_kv` stores a flat step's new keys and
values into their blocks; `paged_decode_attention` attends each listed token through its sequence's table,
split over the key positions like `attention.decode_attention` (one program per (token, kv head, split), then
the same merge kernel). The split count depends only on the table's width, never on how many tokens share the
launch, so a token's arithmetic does not depend on its neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (
    _check_attention_options,
    decode_tile,
    fitted_prefill_tile,
    fold_tile,
    group_query,
    merge_splits,
    score_args,
    store_split,
)
from .launch import cdiv, check_dims, check_float, check_same_device, launch, next_pow2, require
from .tuning import Tile, tuning_for_device


@triton.jit
def _paged_write_kernel(
    k_ptr,
    v_ptr,
    kp_ptr,
    vp_ptr,
    pos_ptr,
    seq_ptr,
    tab_ptr,
    kv_heads,
    head_dim,
    block_size,
    tab_stride,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    p_stride_b,
    p_stride_h,
    p_stride_p,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_ptr + t)
    if seq >= 0:  # padding tokens (slot -1) write nothing
        pos = tl.load(pos_ptr + t)
        block = tl.load(tab_ptr + seq * tab_stride + pos // block_size).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < kv_heads) & (d[None, :] < head_dim)
        dst = block * p_stride_b + h[:, None] * p_stride_h + (pos % block_size) * p_stride_p + d[None, :]
        k = tl.load(k_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=mask)
        tl.store(kp_ptr + dst, k.to(kp_ptr.dtype.element_ty), mask=mask)
        tl.store(vp_ptr + dst, v.to(vp_ptr.dtype.element_ty), mask=mask)


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor) -> None:
    check_dims("k_pool", k_pool, 4)
    check_dims("block_tables", tables, 2)
    check_float("k_pool", k_pool)
    require(k_pool.shape == v_pool.shape, "k and v pools differ in shape")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", tables)):
        require(t.stride(-1) == 1, f"{name} needs a contiguous last dimension")


def write_paged_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   positions: torch.Tensor, seqs: torch.Tensor, tables: torch.Tensor) -> None:
    """Store k, v [tokens, kv_heads, head_dim] of a flat step into their blocks: token t (of sequence slot
    seqs[t], -1 for padding, which writes nothing) at position positions[t]. Pools [blocks, kv_heads,
    block_size, head_dim]; tables [slots, max_blocks] int64. Values take the pool's dtype. Nothing is read on
    the host (positions beyond a table are the caller's to refuse, as check_positions does)."""
    check_dims("k", k, 3)
    _check_pools(k_pool, v_pool, tables)
    check_same_device(k, v, k_pool, v_pool, positions, seqs, tables)
    tokens, kv_heads, head_dim = k.shape
    require(v.shape == k.shape, "k and v shapes differ")
    require(k_pool.shape[1] == kv_heads and k_pool.shape[3] == head_dim, "pool and k disagree on heads/dim")
    require(positions.shape == (tokens,) and seqs.shape == (tokens,), "positions and seqs must be [tokens]")
    require(k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need a contiguous last dimension")
    tuning = tuning_for_device(k.device)
    launch(
        _paged_write_kernel,
        (tokens,),
        Tile(num_warps=min(4, tuning.row_warps), num_stages=1),
        k_ptr=k,
        v_ptr=v,
        kp_ptr=k_pool,
        vp_ptr=v_pool,
        pos_ptr=positions,
        seq_ptr=seqs,
        tab_ptr=tables,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=k_pool.shape[2],
        tab_stride=tables.stride(0),
        k_stride_t=k.stride(0),
        k_stride_h=k.stride(1),
        v_stride_t=v.stride(0),
        v_stride_h=v.stride(1),
        p_stride_b=k_pool.stride(0),
        p_stride_h=k_pool.stride(1),
        p_stride_p=k_pool.stride(2),
        BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )


@triton.jit
def _paged_kv(kp_ptr, vp_ptr, table, kv_pos, kv_mask, head_off, offs_d, dmask, block_size, p_stride_b, p_stride_p,
              UPCAST: tl.constexpr):  # fmt: skip
    """A sequence's keys [D, N] and values [N, D] at `kv_pos`, read through its block table (zeros where masked),
    widened to float32 when UPCAST. Shared by the paged decode and prefill kernels."""
    block = tl.load(table + kv_pos // block_size, mask=kv_mask, other=0).to(tl.int64)
    row = block * p_stride_b + head_off + (kv_pos % block_size).to(tl.int64) * p_stride_p
    k = tl.load(kp_ptr + row[None, :] + offs_d[:, None], mask=kv_mask[None, :] & dmask[:, None], other=0.0)
    v = tl.load(vp_ptr + row[:, None] + offs_d[None, :], mask=kv_mask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    kp_ptr,
    vp_ptr,
    pos_ptr,
    seq_ptr,
    tab_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    split_size,
    block_size,
    scale,
    softcap,
    window,
    head_dim,
    tab_stride,
    q_stride_t,
    q_stride_h,
    p_stride_b,
    p_stride_h,
    p_stride_p,
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
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q, heads, hmask, offs_d, dmask = group_query(q_ptr + t * q_stride_t, kvh, q_stride_h, head_dim, GROUP,
                                                 BLOCK_H, BLOCK_D, UPCAST)  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    seq = tl.load(seq_ptr + t)
    # the token sits at its position and sees keys 0 .. position (a padding token, slot -1, sees none)
    kv_len = tl.where(seq >= 0, tl.load(pos_ptr + t).to(tl.int32) + 1, 0)
    table = tab_ptr + tl.maximum(seq, 0) * tab_stride
    lo = split * split_size
    hi = tl.minimum(lo + split_size, kv_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, kv_len - window)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    head_off = kvh.to(tl.int64) * p_stride_h
    for n0 in range(lo, hi, BLOCK_N):
        kv_pos = n0 + offs_n
        kv_mask = kv_pos < hi
        k, v = _paged_kv(kp_ptr, vp_ptr, table, kv_pos, kv_mask, head_off, offs_d, dmask, block_size, p_stride_b,
                         p_stride_p, UPCAST)  # fmt: skip
        m_i, l_i, acc = decode_tile(q, k, v, kv_mask, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP)
    store_split(mid_o_ptr, mid_lse_ptr, t, heads, split, offs_d, hmask, dmask, acc, l_i, m_i, mo_stride_b,
                mo_stride_h, mo_stride_s, ml_stride_b, ml_stride_h)  # fmt: skip


def _check_paged_query(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, positions: torch.Tensor,
                       seqs: torch.Tensor, tables: torch.Tensor, window: int | None, softcap: float | None
                       ) -> tuple[int, int, int, int, int]:
    """The paged attention calls' arguments checked: (tokens, q_heads, head_dim, kv_heads, block_size)."""
    check_dims("q", q, 3)
    check_float("q", q)
    _check_pools(k_pool, v_pool, tables)
    check_same_device(q, k_pool, v_pool, positions, seqs, tables)
    _check_attention_options(True, window, softcap)
    tokens, q_heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_pool.shape
    require(k_pool.shape[3] == head_dim, f"pool head size {k_pool.shape[3]} != q head size {head_dim}")
    require(q_heads % kv_heads == 0, f"{q_heads} query heads do not group over {kv_heads} kv heads")
    require(positions.shape == (tokens,) and seqs.shape == (tokens,), "positions and seqs must be [tokens]")
    require(q.stride(-1) == 1, "q needs a contiguous last dimension")
    return tokens, q_heads, head_dim, kv_heads, block_size


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    seqs: torch.Tensor,
    tables: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each token of q [tokens, q_heads, head_dim] attends to its sequence's keys 0 .. positions[t] through
    tables[seqs[t]] (its own k/v already written, `write_paged_kv`); padding tokens (seqs[t] = -1) give zeros.
    Pools [blocks, kv_heads, block_size, head_dim]; positions, seqs [tokens] and tables [slots, max_blocks]
    int64 on the device (nothing read on the host). window / softcap / scale as in
    attention.prefill_attention. Returns [tokens, q_heads, head_dim] in q's dtype."""
    tokens, q_heads, head_dim, kv_heads, block_size = _check_paged_query(q, k_pool, v_pool, positions, seqs, tables,
                                                                         window, softcap)  # fmt: skip
    tuning = tuning_for_device(q.device)
    tile = tuning.paged_decode or tuning.decode
    group = q_heads // kv_heads
    capacity = tables.shape[1] * block_size
    # splits from the table's width, the heads and the tuning only: the same for a token whatever else is in
    # the launch
    if tuning.paged_split_keys:
        split_size = cdiv(tuning.paged_split_keys, tile.block_n) * tile.block_n
    else:
        num_splits = max(1, min(tuning.decode_programs // kv_heads, cdiv(capacity, tile.block_n)))
        split_size = cdiv(cdiv(capacity, num_splits), tile.block_n) * tile.block_n
    num_splits = cdiv(capacity, split_size)
    mid_o = torch.empty((tokens, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((tokens, q_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    launch(
        _paged_decode_split_kernel,
        (tokens, kv_heads, num_splits),
        tile,
        q_ptr=q,
        kp_ptr=k_pool,
        vp_ptr=v_pool,
        pos_ptr=positions,
        seq_ptr=seqs,
        tab_ptr=tables,
        mid_o_ptr=mid_o,
        mid_lse_ptr=mid_lse,
        split_size=split_size,
        block_size=block_size,
        **score_args(head_dim, scale, softcap, window, tuning),
        tab_stride=tables.stride(0),
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        p_stride_b=k_pool.stride(0),
        p_stride_h=k_pool.stride(1),
        p_stride_p=k_pool.stride(2),
        mo_stride_b=mid_o.stride(0),
        mo_stride_h=mid_o.stride(1),
        mo_stride_s=mid_o.stride(2),
        ml_stride_b=mid_lse.stride(0),
        ml_stride_h=mid_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(tile.block_m, next_pow2(group)),
        BLOCK_N=tile.block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
    )
    merge_splits(mid_o, mid_lse, out, tuning)
    return out


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    kp_ptr,
    vp_ptr,
    o_ptr,
    pos_ptr,
    seq_ptr,
    tab_ptr,
    tile_ptr,
    limits_ptr,
    tokens,
    block_size,
    scale,
    softcap,
    window,
    head_dim,
    tab_stride,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    p_stride_b,
    p_stride_h,
    p_stride_p,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t0 = tl.load(tile_ptr + tl.program_id(1))
    if t0 >= 0:  # the tile list is padded with -1 to its bound
        h = tl.program_id(0)  # the heads of one tile run side by side, sharing its keys
        seq = tl.load(seq_ptr + t0)
        # up to BLOCK_M tokens from t0 on, those of t0's sequence (its run is contiguous in the step)
        offs_m = t0 + tl.arange(0, BLOCK_M)
        mine = (offs_m < tokens) & (tl.load(seq_ptr + offs_m, mask=offs_m < tokens, other=-1) == seq)
        q_pos = tl.load(pos_ptr + offs_m, mask=mine, other=0).to(tl.int32)
        limit = q_pos  # the last key each query sees: its own position, or its image's last (group attention)
        if HAS_LIMITS:
            limit = tl.load(limits_ptr + offs_m, mask=mine, other=0)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < head_dim
        q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * q_stride_t + h * q_stride_h + offs_d[None, :],
                    mask=mine[:, None] & dmask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)
        hi = tl.max(tl.where(mine, limit, 0), axis=0) + 1
        lo = 0
        if HAS_WINDOW:  # key tiles aligned to absolute positions, as for any other run of the sequence
            lo = (tl.maximum(0, tl.load(pos_ptr + t0).to(tl.int32) - window + 1) // BLOCK_N) * BLOCK_N
        table = tab_ptr + seq.to(tl.int64) * tab_stride
        head_off = (h // GROUP).to(tl.int64) * p_stride_h
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # key tiles below `full` are seen whole by every query of the tile: they skip the per-score mask (the sums
        # are the same either way, a masked score adds exactly zero); a window masks every tile
        full = lo
        if not HAS_WINDOW:
            full = ((tl.min(tl.where(mine, limit, hi), axis=0) + 1) // BLOCK_N) * BLOCK_N
        for n0 in range(lo, full, BLOCK_N):
            kv_pos = n0 + offs_n
            kv_mask = kv_pos < hi
            k, v = _paged_kv(kp_ptr, vp_ptr, table, kv_pos, kv_mask, head_off, offs_d, dmask, block_size,
                             p_stride_b, p_stride_p, UPCAST)  # fmt: skip
            m_i, l_i, acc = fold_tile(q, k, v, None, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, False)
        for n0 in range(full, hi, BLOCK_N):
            kv_pos = n0 + offs_n
            kv_mask = kv_pos < hi
            k, v = _paged_kv(kp_ptr, vp_ptr, table, kv_pos, kv_mask, head_off, offs_d, dmask, block_size,
                             p_stride_b, p_stride_p, UPCAST)  # fmt: skip
            visible = kv_mask[None, :] & (kv_pos[None, :] <= limit[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
            m_i, l_i, acc = fold_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, True)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_ptr + offs_m[:, None].to(tl.int64) * o_stride_t + h * o_stride_h + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mine[:, None] & dmask[None, :])  # fmt: skip


def prefill_tile(device: torch.device, head_dim: int) -> Tile:
    """The prefill tile the paged prefill kernel launches with on `device` (its query tiles' size: prefill_tiles)."""
    return fitted_prefill_tile(tuning_for_device(device).prefill, max(16, next_pow2(head_dim)))


def _listed(flags: torch.Tensor, size: int) -> torch.Tensor:
    """The indices where `flags` holds, in order, padded with -1 to `size` entries (at least as many as hold),
    made on the device without reading how many there are."""
    index = torch.arange(flags.shape[0], device=flags.device)
    slot = torch.where(flags, torch.cumsum(flags, 0) - 1, size)  # the others land in a spare entry
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=flags.device)
    out.scatter_(0, slot, torch.where(flags, index, -1))
    return out[:size]


def prefill_tiles(seqs: torch.Tensor, positions: torch.Tensor, block_m: int, slots: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """From a flat step's sequence slots [tokens] (-1: padding; each sequence's tokens one contiguous run, at most
    `slots` sequences), on the device with nothing read on the host: the first token of every query tile of the
    runs longer than one token (tiles of block_m tokens from each run's start), those whose first query stands
    latest (`positions` [tokens]) first, padded with -1 to cdiv(tokens, block_m) + slots entries; and the tokens
    of the one-token runs (decode tokens), padded with -1 to `slots` entries."""
    tokens = seqs.shape[0]
    index = torch.arange(tokens, device=seqs.device)
    edge = seqs.new_full((1,), -2)
    before, after = torch.cat((edge, seqs[:-1])), torch.cat((seqs[1:], edge))
    real = seqs >= 0
    starts = real & (seqs != before)
    single = starts & (seqs != after)
    run_start = torch.cummax(torch.where(starts, index, 0), 0).values
    first = real & ~single & ((index - run_start) % block_m == 0)
    tiles = _listed(first, cdiv(tokens, block_m) + slots)
    # the tiles that see the most keys first (their first query's position, the padding last), so that the short
    # ones fill the end of the launch
    work = torch.where(tiles >= 0, positions[tiles.clamp(min=0)], -1)
    return tiles[torch.argsort(work, descending=True, stable=True)], _listed(single, slots)


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    seqs: torch.Tensor,
    tables: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    limits: torch.Tensor | None = None,
) -> None:
    """The prefill tokens of a flat step attend through their tables, written into `out` [tokens, q_heads,
    head_dim] (other tokens' rows are left as they are): each tile of `tiles` (prefill_tiles, made with this
    device's prefill_tile(...).block_m) is up to block_m tokens of one sequence, each seeing keys 0 .. its
    position (causal; window, softcap and scale as in attention.prefill_attention), or to limits[t] (int32
    [tokens], at least its position: group attention's image tokens see their whole image). Arguments as
    paged_decode_attention's; nothing is read on the host, so a step that runs it can be replayed as a graph."""
    tokens, q_heads, head_dim, kv_heads, block_size = _check_paged_query(q, k_pool, v_pool, positions, seqs, tables,
                                                                         window, softcap)  # fmt: skip
    check_same_device(q, tiles, out, *([] if limits is None else [limits]))
    require(out.shape == q.shape and out.stride(-1) == 1, "out must be [tokens, heads, dim] like q")
    require(limits is None or (limits.shape == (tokens,) and limits.dtype == torch.int32),
            "limits must be int32 [tokens]")
    tuning = tuning_for_device(q.device)
    tile = prefill_tile(q.device, head_dim)
    launch(
        _paged_prefill_kernel,
        (q_heads, tiles.shape[0]),
        tile,
        q_ptr=q,
        kp_ptr=k_pool,
        vp_ptr=v_pool,
        o_ptr=out,
        pos_ptr=positions,
        seq_ptr=seqs,
        tab_ptr=tables,
        tile_ptr=tiles,
        limits_ptr=tiles if limits is None else limits,
        tokens=tokens,
        block_size=block_size,
        **score_args(head_dim, scale, softcap, window, tuning),
        tab_stride=tables.stride(0),
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        o_stride_t=out.stride(0),
        o_stride_h=out.stride(1),
        p_stride_b=k_pool.stride(0),
        p_stride_h=k_pool.stride(1),
        p_stride_p=k_pool.stride(2),
        GROUP=q_heads // kv_heads,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        HAS_LIMITS=limits is not None,
    )


__all__ = ["paged_decode_attention", "paged_prefill_attention", "prefill_tile", "prefill_tiles", "write_paged_kv"]
