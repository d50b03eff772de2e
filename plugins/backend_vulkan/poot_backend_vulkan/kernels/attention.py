"""Causal GQA attention over a contiguous KV cache: prefill (many queries) and split-K decode."""

from __future__ import annotations

from poot_core.errors import CapacityError, Reason, Unsupported

from .runtime import MAX_GROUPS, Batch, DeviceArray, pack_params, shader_source
from .shapes import check

MAX_HEAD_DIM = 256  # attention.wgsl keeps 4 output values per thread of 64


def _validate(q: DeviceArray, k_cache: DeviceArray, heads: int, start: int, tokens: int) -> tuple[int, int]:
    capacity, kv_heads, head_dim = k_cache.shape
    check("attention.q", q, (tokens, heads, head_dim))
    if head_dim > MAX_HEAD_DIM:
        raise Unsupported(Reason.SHAPE, "attention", f"head dim {head_dim} exceeds {MAX_HEAD_DIM}")
    if head_dim % 4:  # keys are read as 16-byte words
        raise Unsupported(Reason.SHAPE, "attention", f"head dim {head_dim} is not a multiple of 4")
    if heads % kv_heads:
        raise Unsupported(Reason.SHAPE, "attention", f"{heads} query heads over {kv_heads} KV heads")
    if start + tokens > capacity:
        raise CapacityError(f"positions up to {start + tokens} exceed a KV cache of {capacity}")
    if tokens > MAX_GROUPS:
        raise Unsupported(Reason.SHAPE, "attention", f"{tokens} query tokens exceed one dispatch")
    return kv_heads, head_dim


def _params(tokens, heads, kv_heads, head_dim, start, window, splits, split_len, scale, softcap) -> bytes:
    return pack_params(
        tokens, heads, kv_heads, head_dim, start, window, splits, split_len, float(scale), float(softcap)
    )


def attention_prefill(
    batch: Batch,
    q: DeviceArray,
    k_cache: DeviceArray,
    v_cache: DeviceArray,
    out: DeviceArray,
    *,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """out[T, H, D] for queries q[T, H, D] at positions start..start+T-1 over caches [cap, KVH, D].

    The caches must already hold positions 0..start+T-1 (kv_write first). window > 0 limits each
    query to its last `window` positions (itself included); softcap > 0 applies cap * tanh(s / cap).
    """
    tokens, heads = q.shape[0], q.shape[1]
    kv_heads, head_dim = _validate(q, k_cache, heads, start, tokens)
    check("attention.v_cache", v_cache, k_cache.shape)
    check("attention.out", out, (tokens, heads, head_dim))
    pipeline = batch.runtime.pipeline("attention", shader_source("attention"))
    stats = batch.runtime.scratch("attention.stats", 8 * tokens * heads)
    params = _params(tokens, heads, kv_heads, head_dim, start, window, 1, start + tokens, scale, softcap)
    batch.dispatch(pipeline, [q.buffer, k_cache.buffer, v_cache.buffer, out.buffer, stats], params, (heads, tokens, 1))


def attention_decode(
    batch: Batch,
    q: DeviceArray,
    k_cache: DeviceArray,
    v_cache: DeviceArray,
    out: DeviceArray,
    *,
    position: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    split_len: int = 256,
    splits: int | None = None,
) -> None:
    """One query token q[1, H, D] at `position` over cache positions 0..position (split-K).

    The keys are cut into splits of `split_len` positions, each its own workgroup per head; a
    second dispatch merges their partial softmax sums. `splits` fixes their number (splits past
    the position are empty and add nothing), so a recorded step keeps one grid for every position.
    """
    heads = q.shape[-2] if len(q.shape) >= 2 else 0
    kv_heads, head_dim = _validate(q, k_cache, heads, position, 1)
    check("attention.v_cache", v_cache, k_cache.shape)
    check("attention.out", out, (1, heads, head_dim))
    needed = -(-(position + 1) // split_len)
    if splits is None:
        splits = needed
    elif splits < needed:
        raise CapacityError(f"{splits} splits of {split_len} do not cover position {position}")
    runtime = batch.runtime
    stats = runtime.scratch("attention.stats", 8 * heads * splits)
    params = _params(1, heads, kv_heads, head_dim, position, window, splits, split_len, scale, softcap)
    attend = runtime.pipeline("attention", shader_source("attention"))
    if splits == 1:  # a short cache: one pass writes the normalised output, no merge needed
        batch.dispatch(attend, [q.buffer, k_cache.buffer, v_cache.buffer, out.buffer, stats], params, (heads, 1, 1))
        return
    partial = runtime.scratch("attention.partial", 4 * heads * splits * head_dim)
    batch.dispatch(attend, [q.buffer, k_cache.buffer, v_cache.buffer, partial, stats], params, (heads, 1, splits))
    combine = runtime.pipeline("attention_combine", shader_source("attention_combine"))
    batch.dispatch(combine, [partial, stats, out.buffer], pack_params(heads, head_dim, splits), (heads, 1, 1))
