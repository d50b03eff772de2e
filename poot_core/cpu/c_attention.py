"""Attention in C over the CPU's float32 key/value cache: a few queries per row (decode), and blocks of many
queries (prefill).

Decode: torch's scaled_dot_product_attention is built for many queries; for one query over a few hundred cached
keys it spends most of its time outside the arithmetic (about 110 us per layer for SmolLM2 at position 600,
where the keys and values are under 1 MB). `attend_few` does the plain thing instead: per query head, the
scores against the kept keys of its key/value head, a float32 softmax, and the weighted sum of the values.

Prefill: `attend_blocks` is flash attention with register tiles: per key/value head, its keys are transposed
once into scratch, then each block of 4 queries of each head in the group meets blocks of 64 keys (a 4 x 64
tile of scores: 16 AVX-512 registers, or on AVX2 + FMA four passes of 4 x 16 in 8 of its 16 registers), with
the running maximum and sum of the online softmax, and the values are added into a 4 x head-size accumulator.
Only key blocks the causal window reaches are read (on AVX2, within the last block only the 16-key passes it
reaches). On the 2-core AVX2 machine (AMD EPYC) the AVX2 route took 5.8-6.0 ms of CPU time for SmolLM2's
512-token prompt per layer (9 heads, 3 key/value heads, head size 64) against 10-13 ms in torch's SDPA.

The arithmetic is float32 throughout; only the order of the sums (and exp: the 2-ulp exp16 / exp8 of
csrc/common.h) differ from torch's. The C is csrc/attention.c.
"""

from __future__ import annotations

import torch

from poot_core.cpu.c_kernels import kernels
from poot_core.cpu.packed_linear import DECODE_ROWS

# Up to this many queries per row `attend_few` runs (decode and verify steps: packed_linear.DECODE_ROWS); more go
# to `attend_blocks`.
MAX_QUERIES = DECODE_ROWS
# attend_blocks keeps a tile of 4 queries' outputs and 64 value rows on the stack: head sizes up to this.
MAX_HEAD = 256
# Keys per tile of attend_blocks (KB in csrc/attention.c): a query's keys are read from a multiple of it on.
KEY_TILE = 64


def attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None, softcap: float | None,
               rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> torch.Tensor | None:
    """Writes k, v [R, T, Hkv, D] into the caches [R, Hkv, C, D] at positions [R, T], then attends q [R, T, Hq, Dk]
    over the kept keys. With `rope` (cos, sin [R, T, 1, half] as ops.rope_tables gives them, and whether pairs
    are interleaved) q and k are rotated first, in the same call. Returns [R, T, Hq, Dv], or None where the
    kernel does not apply, having written nothing (then the caller uses torch)."""
    lib = kernels()
    rows, tokens, heads, dk = q.shape
    f32 = torch.float32
    if (lib is None or tokens > MAX_QUERIES or any(t.dtype != f32 for t in (q, k, v, k_cache, v_cache))
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or heads % k_cache.shape[1] != 0):
        return None
    kv_heads, capacity, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = positions.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    out = torch.empty(rows, tokens, heads, dv)
    scratch = torch.empty(threads, capacity)
    cos = sin = rotated = None
    half, interleaved = 0, False
    if rope is not None:
        cos, sin, interleaved = rope
        half = cos.shape[-1]
        if cos.dtype != f32 or not cos.is_contiguous() or not sin.is_contiguous() or 2 * half > dk:
            return None
        rotated = torch.empty(q.shape)
    lib.poot_attend_few(q.data_ptr(), k.data_ptr(), v.data_ptr(), rows, tokens, heads, kv_heads, dk, dv,
                        k_cache.data_ptr(), v_cache.data_ptr(), capacity, pos.data_ptr(), scale, window or 0,
                        softcap or 0.0, out.data_ptr(), scratch.data_ptr(), threads,
                        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), half,
                        int(interleaved), None if rotated is None else rotated.data_ptr())
    return out


def attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                 tables: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None) -> torch.Tensor | None:
    """The paged layout's decode tokens in one call: q [N, Hq, Dk], k, v [N, Hkv, D] of tokens at positions [N]
    of sequences seqs [N] (rows of the block tables [S, M]); pools [blocks, Hkv, B, D]. Writes the keys and values
    into their blocks and attends through the tables, query for query the arithmetic of `attend_few`. Returns
    [N, Hq, Dv], or None where the kernel does not apply, having written nothing."""
    lib = kernels()
    f32 = torch.float32
    if (lib is None or any(t.dtype != f32 for t in (q, k, v, k_pool, v_pool)) or not k_pool.is_contiguous()
            or not v_pool.is_contiguous() or q.shape[1] % k_pool.shape[1] != 0):
        return None
    tokens, heads, dk = q.shape
    kv_heads, block, dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = positions.to(torch.int64).contiguous()
    seqs, tables = seqs.to(torch.int64).contiguous(), tables.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    longest = int(pos.max()) + 1 if window is None else min(int(pos.max()) + 1, window)
    out = torch.empty(tokens, heads, dv)
    scratch = torch.empty(threads, longest)
    lib.poot_attend_paged(q.data_ptr(), k.data_ptr(), v.data_ptr(), tokens, heads, kv_heads, dk, dv,
                          k_pool.data_ptr(), v_pool.data_ptr(), block, tables.data_ptr(), tables.shape[1],
                          seqs.data_ptr(), pos.data_ptr(), scale, window or 0, softcap or 0.0, out.data_ptr(),
                          scratch.data_ptr(), longest, threads)
    return out


def attend_paged_blocks(q: torch.Tensor, positions: torch.Tensor, runs: list[tuple[int, int, int]],
                        tables: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor | None:
    """The paged layout's prefill chunks: q [N, Hq, D] float32 (token rows may lie apart) of a step whose runs
    (sequence slot, first token, end token: consecutive positions [N] int64) have their keys and values in
    their blocks already (pools [blocks, Hkv, B, D], tables [S, M] int64). Each query attends as attend_blocks
    attends over a contiguous cache of its sequence, reading the rows out of the blocks itself. Returns
    [N, Hq, D] (rows of other tokens unset), or None where the kernel does not apply."""
    lib = kernels()
    tokens, heads, d = q.shape
    f32 = torch.float32
    if (lib is None or not runs or any(t.dtype != f32 for t in (q, k_pool, v_pool)) or not k_pool.is_contiguous()
            or not v_pool.is_contiguous() or v_pool.shape[3] != d or d % 16 != 0 or d > MAX_HEAD
            or heads % k_pool.shape[1] != 0 or q.stride(2) != 1 or q.stride(1) != d):
        return None
    kv_heads, block = k_pool.shape[1], k_pool.shape[2]
    span = 0  # the most positions one run reads, from its first tile of keys
    for _, t0, t1 in runs:
        start, last = int(positions[t0]), int(positions[t1 - 1])
        first = 0 if window is None else max(0, start - window + 1)
        span = max(span, last + 1 - (first - first % KEY_TILE))
    span = -(-span // KEY_TILE) * KEY_TILE
    threads = torch.get_num_threads()
    out = torch.empty(tokens, heads, d)
    scratch = torch.empty(threads, d * (3 * span + KEY_TILE))
    flat = torch.tensor([v for run in runs for v in run], dtype=torch.int64)
    status = lib.poot_attend_paged_blocks(q.data_ptr(), q.stride(0), heads, kv_heads, d, k_pool.data_ptr(),
                                          v_pool.data_ptr(), block, tables.data_ptr(), tables.shape[1],
                                          flat.data_ptr(), len(runs), positions.data_ptr(), scale, window or 0,
                                          softcap or 0.0, out.data_ptr(), scratch.data_ptr(), span, threads)
    return out if status == 0 else None


def attend_blocks(q: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scale: float, window: int | None, softcap: float | None) -> torch.Tensor | None:
    """q [R, T, Hq, D] float32 (token rows may lie apart) over the caches [R, Hkv, C, D] that already hold this
    step's keys and values; positions [R, T] consecutive per row. Returns [R, T, Hq, D], or None where the
    kernel does not apply (then the caller uses torch)."""
    lib = kernels()
    rows, tokens, heads, d = q.shape
    f32 = torch.float32
    if (lib is None or any(t.dtype != f32 for t in (q, k_cache, v_cache)) or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or v_cache.shape[3] != d or d % 16 != 0 or d > MAX_HEAD
            or heads % k_cache.shape[1] != 0 or q.stride(3) != 1 or q.stride(2) != d
            or (rows > 1 and q.stride(0) != tokens * q.stride(1))):
        return None
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    threads = torch.get_num_threads()
    pos = positions.to(torch.int64).contiguous()
    out = torch.empty(rows, tokens, heads, d)
    scratch = torch.empty(threads, d * (capacity + 64))
    status = lib.poot_attend_blocks(q.data_ptr(), q.stride(1), rows, tokens, heads, kv_heads, d, k_cache.data_ptr(),
                                    v_cache.data_ptr(), capacity, pos.data_ptr(), scale, window or 0,
                                    softcap or 0.0, out.data_ptr(), scratch.data_ptr(), threads)
    return out if status == 0 else None
