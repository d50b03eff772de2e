"""The dense decoder, written once over the tracer's ops (llama, mistral, qwen2, qwen3, gemma3).

Weights are read by their Hugging Face names; biases and optional norms are used when the checkpoint has
them. Shapes: R rows, T new tokens per row, D hidden.
"""

from __future__ import annotations

from poot_core import AttentionSpec, ModelConfig, Tracer, attention_block, gated_mlp
from poot_family_llama.config import DecoderParams


def trace_decoder(cfg: ModelConfig, t: Tracer) -> None:
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
