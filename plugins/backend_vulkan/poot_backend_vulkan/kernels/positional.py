"""Rotary embedding (neox rotate-half) and KV-cache writes."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from poot_core.errors import CapacityError, Reason, Unsupported

from .runtime import Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check


def rope_inv_freq(rot_dim: int, theta: float, scaling: Mapping[str, float | str] | None = None) -> np.ndarray:
    """The rot_dim / 2 inverse frequencies theta^(-2i / rot_dim), with optional scaling applied.

    scaling: None, {"rope_type": "linear", "factor"}, or {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} (Llama 3.1's table:
    long wavelengths are divided by factor, short ones kept, the band between blended smoothly).
    """
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > original / low, inv / factor, np.where(wavelen < original / high, inv, blended))
    else:
        raise Unsupported(Reason.OPERATION, f"rope:{kind}", "the Vulkan rope reads default, linear and llama3")
    return inv.astype(np.float32)


def rope(
    batch: Batch,
    x: DeviceArray,
    positions: DeviceArray,
    inv_freq: DeviceArray,
    *,
    heads: int,
    head_dim: int,
    style: str = "neox",
) -> None:
    """Rotate x[tokens, heads, head_dim] in place; positions: u32 [tokens]; inv_freq: f32 [rot_dim / 2].

    style: "neox" rotates (i, i + rot_dim / 2); "interleaved" rotates (2i, 2i + 1).
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
    params = pack_params(tokens, heads, head_dim, rot_dim, step, gap)
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
