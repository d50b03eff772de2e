"""The dense decoder, written once over the tracer's ops (llama, mistral, qwen2, qwen3, gemma3).

Weights are read by their Hugging Face names; biases and optional norms are used when the checkpoint has
them. Shapes: R rows, T new tokens per row, D hidden, H query heads, K kv heads, Dh head size.
"""

from __future__ import annotations

from poot_core import ModelConfig, StepShape, Tracer, Value
from poot_family_llama.config import DecoderParams


def trace_decoder(cfg: ModelConfig, t: Tracer, shape: StepShape) -> None:
    p: DecoderParams = cfg.params
    R, T = shape.rows, shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens, scale=p.embed_scale)  # [R, T, D]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps, p.norm_offset)
        a = _attention(t, p, i, h, positions, shape)
        if p.sandwich_norms:
            a = t.rms_norm(a, t.weight(pre + "post_attention_layernorm.weight"), p.norm_eps, p.norm_offset)
        x = t.add(x, a)
        second = "pre_feedforward_layernorm" if p.sandwich_norms else "post_attention_layernorm"
        h = t.rms_norm(x, t.weight(pre + second + ".weight"), p.norm_eps, p.norm_offset)
        m = _mlp(t, p, pre + "mlp.", h)
        if p.sandwich_norms:
            m = t.rms_norm(m, t.weight(pre + "post_feedforward_layernorm.weight"), p.norm_eps, p.norm_offset)
        x = t.add(x, m)
    x = t.rms_norm(x, t.weight("model.norm.weight"), p.norm_eps, p.norm_offset)
    head = t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight")
    t.finish(x, head, p.final_softcap)


def _attention(t: Tracer, p: DecoderParams, i: int, h: Value, positions: Value, shape: StepShape) -> Value:
    pre = f"model.layers.{i}.self_attn."
    R, T = shape.rows, shape.tokens

    def project(name: str, heads: int) -> Value:
        y = t.linear(h, t.weight(pre + name + ".weight"), t.optional_weight(pre + name + ".bias"))
        return t.reshape(y, (R, T, heads, p.head_dim))

    q, k, v = project("q_proj", p.heads), project("k_proj", p.kv_heads), project("v_proj", p.kv_heads)
    if p.qk_norm:  # per-head RMSNorm before rope (qwen3, gemma3)
        q = t.rms_norm(q, t.weight(pre + "q_norm.weight"), p.norm_eps, p.norm_offset)
        k = t.rms_norm(k, t.weight(pre + "k_norm.weight"), p.norm_eps, p.norm_offset)
    rope = {"theta": p.layer_theta[i], "dim": p.rotary_dim, "style": p.rope_style,
            "scaling": p.layer_scaling[i]}
    q, k = t.rope(q, positions, **rope), t.rope(k, positions, **rope)
    o = t.attention(q, k, v, positions, layer=i, capacity=shape.capacity, scale=p.attn_scale,
                    window=p.layer_window[i], softcap=p.attn_softcap)  # [R, T, H, Dh]
    o = t.reshape(o, (R, T, p.heads * p.head_dim))
    return t.linear(o, t.weight(pre + "o_proj.weight"), t.optional_weight(pre + "o_proj.bias"))


def _mlp(t: Tracer, p: DecoderParams, pre: str, h: Value) -> Value:
    gate = t.linear(h, t.weight(pre + "gate_proj.weight"), t.optional_weight(pre + "gate_proj.bias"))
    up = t.linear(h, t.weight(pre + "up_proj.weight"), t.optional_weight(pre + "up_proj.bias"))
    down = t.weight(pre + "down_proj.weight")
    return t.linear(t.gated(gate, up, p.act), down, t.optional_weight(pre + "down_proj.bias"))
