"""Rotary position frequencies, with the scalings Hugging Face configs name (linear, llama3, yarn) and the
per-frequency factors llama.cpp's converter stores as a `rope_freqs` tensor instead of llama3's parameters.

Public so every backend computes exactly the reference's frequencies instead of keeping its own copy.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from poot_core.errors import Reason, Unsupported

if TYPE_CHECKING:
    from poot_core.family import GGUFTensors
    from poot_core.family_gguf import GGUFKeys


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
    elif kind == FREQ_FACTORS:  # llama.cpp's rope_freqs: each frequency divided by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise Unsupported(Reason.SHAPE, f"{factors.numel()} rope frequency factors",
                              f"the rope has {inv.numel()} frequencies")
        inv = inv / factors
    elif kind not in (None, "default"):
        raise Unsupported(Reason.OPERATION, f"rope scaling {kind}",
                          f"known: default, linear, llama3, yarn, {FREQ_FACTORS}")
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
FREQ_FACTORS = "freq_factors"


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
    if kind not in SCALINGS and kind != FREQ_FACTORS:  # the latter: a GGUF config translated to this form
        raise Unsupported(Reason.OPERATION, f"rope scaling {kind}", f"{hf.get('model_type')} config; "
                          f"poot computes {', '.join(SCALINGS)}")
    return theta, scaling


def rope_from_gguf(keys: GGUFKeys, tensors: GGUFTensors) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of a GGUF file, in the Hugging Face form `inverse_frequencies` takes, read the way
    llama.cpp reads it: `rope.freq_base`; `rope.scaling.type` (absent with a factor means linear) with its
    factor, YaRN's original context, betas and attention factor; and the `rope_freqs` tensor of
    per-frequency factors (llama3 scaling as the converter writes it). Keys whose effect poot does not
    compute are refused by name."""
    theta = float(keys("rope.freq_base", 10000.0))
    keys.understood("rope.scaling.finetuned")
    factor = keys("rope.scaling.factor", None)
    if factor is None:
        factor = keys("rope.scale_linear", None)  # the older key
    kind = str(keys("rope.scaling.type", "linear" if factor else "none"))
    for name, neutral in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_ext_factor", 1.0)):
        value = keys(name, neutral)
        if float(value) != neutral:
            raise Unsupported(Reason.OPERATION, f"GGUF metadata {keys.key(name)} = {value}",
                              "poot's rope computes the Hugging Face scalings, where this is always "
                              f"{neutral}")
    scaling: dict[str, Any] = {}
    if kind == "linear" and factor and float(factor) != 1.0:
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        original = keys("rope.scaling.original_context_length", None)  # llama.cpp: else the context length
        scaling = {"rope_type": "yarn", "factor": float(factor or 1.0),
                   "original_max_position_embeddings": int(original or keys("context_length"))}
        for name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                              ("yarn_attn_factor", "attention_factor")):
            value = keys(f"rope.scaling.{name}", None)
            if value is not None:
                scaling[hf_name] = float(value)
    elif kind not in ("none", "linear"):
        raise Unsupported(Reason.OPERATION, f"GGUF rope scaling {kind!r} ({keys.key('rope.scaling.type')})",
                          "poot computes none, linear, yarn and the rope_freqs tensor")
    if "rope_freqs.weight" in tensors.names():
        if scaling:
            raise Unsupported(Reason.OPERATION, f"rope_freqs together with {kind} rope scaling",
                              "poot applies per-frequency factors only to the plain rope")
        values = tensors.read("rope_freqs.weight").reshape(-1)
        scaling = {"rope_type": FREQ_FACTORS, "factors": tuple(float(v) for v in values)}
    return theta, scaling
