"""Rotary position frequencies, with the scalings Hugging Face configs name (linear, llama3, yarn).

Public so every backend computes exactly the reference's frequencies instead of keeping its own copy.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from poot_core.errors import Reason, Unsupported


@lru_cache(maxsize=64)
def inverse_frequencies(theta: float, dim: int, scaling_items: tuple[tuple[str, Any], ...]) -> torch.Tensor:
    """Rotary inverse frequencies, with the rope scalings Hugging Face configs name."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(scaling_items)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "yarn":
        inv = _yarn(inv, theta, dim, scaling)
    elif kind not in (None, "default"):
        raise Unsupported(Reason.OPERATION, f"rope scaling {kind}", "known: default, linear, llama3, yarn")
    return inv


def _yarn(inv: torch.Tensor, theta: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between the wavelengths
    that turn beta_fast and beta_slow times over the original context."""
    factor = scaling["factor"]
    old = scaling.get("original_max_position_embeddings", 4096)
    fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def turns_to_dim(turns: float) -> float:
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_to_dim(fast), turns_to_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv / factor * (1 - keep) + inv * keep


def rope_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN scales cos and sin by this (1 for the other scalings)."""
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


SCALINGS = ("linear", "llama3", "yarn")


def rope_from_hf_config(hf: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of one layer type of a Hugging Face config: transformers 5's `rope_parameters` (flat,
    or one entry per layer type as gemma3 has), or the older `rope_theta` / `rope_scaling` /
    `rope_local_base_freq`. The default rope gives an empty scaling; one poot cannot compute is refused here,
    before any work."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
            theta, scaling = float(hf["rope_local_base_freq"]), {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return theta, {}
    if kind not in SCALINGS:
        raise Unsupported(Reason.OPERATION, f"rope scaling {kind}", f"{hf.get('model_type')} config; "
                          f"poot computes {', '.join(SCALINGS)}")
    return theta, scaling
