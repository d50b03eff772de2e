"""The dense decoder (llama, mistral, qwen2, qwen3, gemma3): its parameters, read from a Hugging Face
config.json, and its forward over the tracer's ops, written once here so every family whose text model is
this decoder shares it (the llama family; the vision family's language model). A plugin may import only
poot_core's public API, never another plugin.

Weights are read by their Hugging Face names; biases and optional norms are used when the checkpoint has
them. Shapes: R rows, T new tokens per row, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poot_core.blocks import AttentionSpec, attention_block, gated_mlp
from poot_core.errors import Reason, Unsupported
from poot_core.family import ModelConfig, require_key
from poot_core.graph import Tracer
from poot_core.rope import rope_from_hf_config


@dataclass
class DecoderParams:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    # Per layer: rope base, rope scaling dict, sliding window (None: global attention).
    layer_theta: list[float]
    layer_scaling: list[dict[str, Any]]
    layer_window: list[int | None]
    rotary_dim: int
    tie_embeddings: bool = False
    qk_norm: bool = False
    act: str = "silu"
    embed_scale: float | None = None
    norm_offset: float = 0.0  # gemma stores w - 1 and multiplies by (1 + w)
    sandwich_norms: bool = False  # gemma3: post-attention and pre/post feed-forward norms
    attn_scale: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_style: str = "neox"
    extra: dict[str, Any] = field(default_factory=dict)


HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}


def decoder_params_from_hf(hf: dict[str, Any], model_type: str) -> DecoderParams:
    """The dense decoder's parameters from a Hugging Face config.json of `model_type` (llama, mistral, qwen2,
    qwen3, gemma3*), as transformers reads them."""
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden = int(require_key(hf, "hidden_size"))
    heads = int(require_key(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    gemma = model_type.startswith("gemma3")
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if not types:
        if gemma:
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        elif model_type == "mistral" and window:
            types = ["sliding_attention"] * layers
        elif model_type == "qwen2" and hf.get("use_sliding_window") and window:
            start = int(hf.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        else:
            types = ["full_attention"] * layers
    if model_type == "qwen2" and not hf.get("use_sliding_window"):
        types = ["full_attention"] * layers  # qwen2 ignores its sliding_window unless use_sliding_window
    ropes = [rope_from_hf_config(hf, t) for t in types]
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act_name not in HF_ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"activation {act_name}", f"{model_type} config")
    partial = float(hf.get("partial_rotary_factor", 1.0))
    return DecoderParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=int(require_key(hf, "intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        layer_theta=[r[0] for r in ropes], layer_scaling=[r[1] for r in ropes],
        layer_window=[int(window) if t == "sliding_attention" and window else None for t in types],
        rotary_dim=int(head_dim * partial),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qk_norm=model_type in ("qwen3",) or gemma,
        act=HF_ACTIVATIONS[act_name],
        embed_scale=hidden**0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else head_dim**-0.5,
        attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_softcap=hf.get("final_logit_softcapping") if gemma else None,
    )


def trace_dense_decoder(cfg: ModelConfig, t: Tracer) -> None:
    """The forward of a model whose cfg.params are DecoderParams: embedding, the layers, the final norm and
    the head (the embedding table when the checkpoint has no lm_head)."""
    p: DecoderParams = cfg.params
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    spec = AttentionSpec(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, scale=p.attn_scale,
                         norm_eps=p.norm_eps, qk_norm=p.qk_norm, norm_offset=p.norm_offset,
                         rope_style=p.rope_style, rotary_dim=p.rotary_dim)
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens, scale=p.embed_scale)  # [R, T, D]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps, p.norm_offset)
        a = attention_block(t, spec, pre + "self_attn.", i, h, positions, theta=p.layer_theta[i],
                            scaling=p.layer_scaling[i], window=p.layer_window[i], softcap=p.attn_softcap)
        if p.sandwich_norms:
            a = t.rms_norm(a, t.weight(pre + "post_attention_layernorm.weight"), p.norm_eps, p.norm_offset)
        x = t.add(x, a)
        second = "pre_feedforward_layernorm" if p.sandwich_norms else "post_attention_layernorm"
        h = t.rms_norm(x, t.weight(pre + second + ".weight"), p.norm_eps, p.norm_offset)
        m = gated_mlp(t, pre + "mlp.", h, p.act)
        if p.sandwich_norms:
            m = t.rms_norm(m, t.weight(pre + "post_feedforward_layernorm.weight"), p.norm_eps, p.norm_offset)
        x = t.add(x, m)
    x = t.rms_norm(x, t.weight("model.norm.weight"), p.norm_eps, p.norm_offset)
    head = t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight")
    t.finish(x, head, p.final_softcap)
