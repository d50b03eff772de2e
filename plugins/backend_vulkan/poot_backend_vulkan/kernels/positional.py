"""Rotary embedding (neox rotate-half), KV-cache writes, and both in one dispatch before attention."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from poot_core import inverse_frequencies
from poot_core.errors import CapacityError, Reason, Unsupported

from .runtime import Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check


def rope_inv_freq(rot_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """The rot_dim / 2 inverse frequencies theta^(-2i / rot_dim) with the config's scaling applied (linear,
    llama3, yarn): poot_core's, so the shader rotates by exactly the angles every other backend uses."""
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (scaling or {}).items()))
    return inverse_frequencies(float(theta), int(rot_dim), items).numpy()


def rope(
    batch: Batch,
    x: DeviceArray,
    positions: DeviceArray,
    inv_freq: DeviceArray,
    *,
    heads: int,
    head_dim: int,
    style: str = "neox",
    factor: float = 1.0,
) -> None:
    """Rotate x[tokens, heads, head_dim] in place; positions: u32 [tokens]; inv_freq: f32 [rot_dim / 2].

    style: "neox" rotates (i, i + rot_dim / 2); "interleaved" rotates (2i, 2i + 1). factor scales cos and sin
    (YaRN's attention factor, poot_core's rope_attention_factor; 1 for the other scalings).
    """
    tokens = positions.size
    rot_dim = 2 * inv_freq.size
    check("rope.x", x, (tokens, heads, head_dim))
    check("rope.positions", positions, (tokens,), "u32")
    if rot_dim > head_dim:
        raise Unsupported(Reason.SHAPE, "rope", f"rotary dim {rot_dim} exceeds head dim {head_dim}")
    if style not in ("neox", "interleaved"):
        raise Unsupported(Reason.OPERATION, f"rope style {style}", "the Vulkan rope has neox and interleaved")
    step, gap = (1, rot_dim // 2) if style == "neox" else (2, 1)
    pipeline = batch.runtime.pipeline("rope", shader_source("rope"))
    params = pack_params(tokens, heads, head_dim, rot_dim, step, gap, float(factor))
    work = tokens * heads * (rot_dim // 2)
    batch.dispatch(pipeline, [x.buffer, positions.buffer, inv_freq.buffer], params, grid_1d(-(-work // 64)))


def kv_write(batch: Batch, new: DeviceArray, cache: DeviceArray, start: int) -> None:
    """Copy new[tokens, kv_heads, head_dim] into cache[capacity, kv_heads, head_dim] at rows start.."""
    row = math.prod(cache.shape[1:])
    tokens = new.size // row
    check("kv_write.new", new, (tokens, *cache.shape[1:]))
    if start < 0 or start + tokens > cache.shape[0]:
        raise CapacityError(f"writing {tokens} positions at {start} overflows a KV cache of {cache.shape[0]}")
    pipeline = batch.runtime.pipeline("copy", shader_source("copy"))
    params = pack_params(new.size, 0, start * row)
    batch.dispatch(pipeline, [new.buffer, cache.buffer], params, grid_1d(-(-new.size // 64)))


def rope_kv(
    batch: Batch,
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    q_out: DeviceArray,
    k_cache: DeviceArray,
    v_cache: DeviceArray,
    positions: DeviceArray,
    inv_freq: DeviceArray,
    start: int,
    *,
    style: str = "neox",
    factor: float = 1.0,
    partials: tuple[int, int, tuple[int, int, int]] | None = None,
) -> None:
    """rope(q) -> q_out, rope(k) and v -> the caches' rows start.., in one dispatch (rope_kv.wgsl): what rope on
    q, rope on k and kv_write of k and v compute, bit for bit. q: [tokens, heads, head_dim]; k, v: [tokens,
    kv_heads, head_dim]; caches [capacity, kv_heads, head_dim]. partials = (splits, stride, (q, k, v offsets)):
    q, k and v lie in one buffer of split-K partial sums (linear.gemv partials=True of their concatenation),
    added here instead of by a combine pass."""
    tokens, heads, head_dim = q.shape
    capacity, kv_heads, _ = k_cache.shape
    rot_dim = 2 * inv_freq.size
    check("rope_kv.q_out", q_out, q.shape)
    check("rope_kv.k", k, (tokens, kv_heads, head_dim))
    check("rope_kv.v", v, (tokens, kv_heads, head_dim))
    check("rope_kv.v_cache", v_cache, k_cache.shape)
    check("rope_kv.positions", positions, (tokens,), "u32")
    if rot_dim > head_dim:
        raise Unsupported(Reason.SHAPE, "rope", f"rotary dim {rot_dim} exceeds head dim {head_dim}")
    if style not in ("neox", "interleaved"):
        raise Unsupported(Reason.OPERATION, f"rope style {style}", "the Vulkan rope has neox and interleaved")
    if start < 0 or start + tokens > capacity:
        raise CapacityError(f"writing {tokens} positions at {start} overflows a KV cache of {capacity}")
    pipeline = batch.runtime.pipeline("rope_kv", shader_source("rope_kv"))
    splits, stride, offsets = partials or (1, 0, (0, 0, 0))
    if partials is not None and q.buffer.size < 4 * splits * stride:
        raise Unsupported(Reason.SHAPE, "rope_kv partials", f"a buffer of {splits} x {stride} values")
    params = pack_params(tokens, heads, kv_heads, head_dim, rot_dim, int(style == "interleaved"),
                         start * kv_heads * head_dim, float(factor), splits, stride, *offsets)
    work = tokens * (heads + 2 * kv_heads) * head_dim
    buffers = [q.buffer, k.buffer, v.buffer, q_out.buffer, k_cache.buffer, v_cache.buffer, positions.buffer,
               inv_freq.buffer]
    batch.dispatch(pipeline, buffers, params, grid_1d(-(-work // 64)))
