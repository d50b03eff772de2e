"""Building blocks families write their forward with: a stored projection, grouped-query attention over
the KV state, the gated MLP. Written once here so the dense and the MoE families share them (a plugin may
import only poot_core's public API, never another plugin).

Weights are read by Hugging Face names under a prefix ("model.layers.3.self_attn."). Shapes: R rows,
T new tokens per row, D hidden, H query heads, K kv heads, Dh head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poot_core.graph import Tracer, Value


def projection(t: Tracer, x: Value, name: str) -> Value:
    """x through the stored linear `name` ("...self_attn.q_proj"): its weight, and its bias when the
    checkpoint has one."""
    return t.linear(x, t.weight(f"{name}.weight"), t.optional_weight(f"{name}.bias"))


@dataclass(frozen=True)
class AttentionSpec:
    """What grouped-query attention needs to know of a model. rotary_dim: the features of each head that
    rope turns (None: all of them; 0: none)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    norm_eps: float = 1e-6
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (qwen3, gemma3)
    norm_offset: float = 0.0  # gemma's (1 + w) norms
    rope_style: str = "neox"
    rotary_dim: int | None = None
    # the checkpoint's names of the q/k norms and the output projection under the attention prefix (LFM2's
    # differ: q_layernorm, k_layernorm, out_proj)
    norm_names: tuple[str, str] = ("q_norm", "k_norm")
    out_name: str = "o_proj"


def attention_block(t: Tracer, spec: AttentionSpec, prefix: str, layer: int, h: Value, positions: Value, *,
                    theta: float, scaling: dict[str, Any], window: int | None = None,
                    softcap: float | None = None) -> Value:
    """q/k/v projections, optional q/k norms, rope, causal attention through layer `layer`'s KV state, and
    the output projection. h [R, T, D] -> [R, T, D]."""
    rows, tokens = h.shape[0], h.shape[1]

    def heads(name: str, count: int) -> Value:
        return t.reshape(projection(t, h, prefix + name), (rows, tokens, count, spec.head_dim))

    q, k, v = heads("q_proj", spec.heads), heads("k_proj", spec.kv_heads), heads("v_proj", spec.kv_heads)
    if spec.qk_norm:
        q_norm, k_norm = spec.norm_names
        q = t.rms_norm(q, t.weight(f"{prefix}{q_norm}.weight"), spec.norm_eps, spec.norm_offset)
        k = t.rms_norm(k, t.weight(f"{prefix}{k_norm}.weight"), spec.norm_eps, spec.norm_offset)
    if spec.rotary_dim != 0:  # 0: no rope at all (Granite 4.0-H's attention layers)
        rope = {"theta": theta, "dim": spec.rotary_dim or spec.head_dim, "style": spec.rope_style,
                "scaling": scaling}
        q, k = t.rope(q, positions, **rope), t.rope(k, positions, **rope)
    o = t.attention(q, k, v, positions, layer=layer, scale=spec.scale, window=window, softcap=softcap)
    o = t.reshape(o, (rows, tokens, spec.heads * spec.head_dim))
    return projection(t, o, prefix + spec.out_name)


def gated_mlp(t: Tracer, prefix: str, h: Value, act: str = "silu",
              names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Value:
    """down(act(gate(h)) * up(h)), each projection with its bias when stored."""
    gate, up, down = (prefix + n for n in names)
    return projection(t, t.gated(projection(t, h, gate), projection(t, h, up), act), down)


__all__ = ["AttentionSpec", "attention_block", "gated_mlp", "projection"]
