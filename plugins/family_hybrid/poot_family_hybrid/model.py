"""The hybrid decoders, written once over the tracer's ops. Shapes: R rows, T new tokens per row, D hidden.

LFM2: each layer is a gated short convolution or GQA attention (q/k norms), then a SwiGLU MLP.
Mamba2: each layer is a Mamba2 mixer (a convolution over x, B and C, the selective scan, a gated group norm).
Granite 4.0-H and Bamba: each layer is a Mamba2 mixer or GQA attention, then a SwiGLU MLP (Granite's MoE
variant: the moe op over its routed experts, with that MLP as the shared expert).
Weights are read by their Hugging Face names.
"""

from __future__ import annotations

from poot_core import AttentionSpec, ModelConfig, Tracer, Value, attention_block, gated_mlp, projection
from poot_family_hybrid.config import Lfm2Params, Mamba2Params, MambaHybridParams
from poot_family_hybrid.experts import EXPERT_NAMES


def gated_short_conv(t: Tracer, prefix: str, layer: int, h: Value) -> Value:
    """LFM2's operator: in_proj gives B, C and x [R, T, D] each; out_proj(C * conv(B * x))."""
    d = h.shape[-1]
    bcx = projection(t, h, prefix + "in_proj")  # [R, T, 3D]
    b, c, x = (t.slice(bcx, k * d, (k + 1) * d) for k in range(3))
    y = t.short_conv(t.mul(b, x), t.weight(prefix + "conv.weight"), t.optional_weight(prefix + "conv.bias"),
                     layer=layer)
    return projection(t, t.mul(c, y), prefix + "out_proj")


def trace_lfm2(cfg: ModelConfig, t: Tracer) -> None:
    p: Lfm2Params = cfg.params
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    spec = AttentionSpec(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, scale=p.head_dim**-0.5,
                         norm_eps=p.norm_eps, qk_norm=True, norm_names=("q_layernorm", "k_layernorm"),
                         out_name="out_proj")
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens)  # [R, T, D]
    for i, kind in enumerate(p.layer_types):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "operator_norm.weight"), p.norm_eps)
        if kind == "conv":
            a = gated_short_conv(t, pre + "conv.", i, h)
        else:
            a = attention_block(t, spec, pre + "self_attn.", i, h, positions, theta=p.theta, scaling=p.scaling)
        x = t.add(x, a)
        h = t.rms_norm(x, t.weight(pre + "ffn_norm.weight"), p.norm_eps)
        x = t.add(x, gated_mlp(t, pre + "feed_forward.", h, "silu", names=("w1", "w3", "w2")))
    x = t.rms_norm(x, t.weight("model.embedding_norm.weight"), p.norm_eps)  # LFM2's final norm
    t.finish(x, t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight"))


def mamba2_mixer(t: Tracer, p: Mamba2Params, prefix: str, layer: int, h: Value) -> Value:
    """in_proj gives the gate z [I], x with B and C [I + 2GN] and dt [H]; the convolution runs over x, B and C
    together; then the scan, the norm of y * silu(z) per group, out_proj."""
    R, T = h.shape[0], h.shape[1]
    inner, gn, heads = p.inner, p.groups * p.state, p.heads
    proj = projection(t, h, prefix + "in_proj")  # [R, T, I + I + 2GN + H]
    gate = t.slice(proj, 0, inner)
    xbc = t.slice(proj, inner, 2 * inner + 2 * gn)
    dt = t.slice(proj, 2 * inner + 2 * gn, 2 * inner + 2 * gn + heads)  # [R, T, H]
    xbc = t.short_conv(xbc, t.weight(prefix + "conv1d.weight"), t.optional_weight(prefix + "conv1d.bias"),
                       layer=layer, act="silu")
    x = t.reshape(t.slice(xbc, 0, inner), (R, T, heads, p.head_dim))
    b = t.reshape(t.slice(xbc, inner, inner + gn), (R, T, p.groups, p.state))
    c = t.reshape(t.slice(xbc, inner + gn, inner + 2 * gn), (R, T, p.groups, p.state))
    y = t.ssm_scan(x, dt, t.weight(prefix + "A_log"), b, c, t.weight(prefix + "D"), t.weight(prefix + "dt_bias"),
                   layer=layer, chunk=p.chunk, dt_limit=p.dt_limit)
    y = t.gated_rms_norm(t.reshape(y, (R, T, inner)), gate, t.weight(prefix + "norm.weight"), eps=p.norm_eps,
                         group=inner // p.groups)
    return projection(t, y, prefix + "out_proj")


def trace_mamba2(cfg: ModelConfig, t: Tracer) -> None:
    p: Mamba2Params = cfg.params
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    x = t.embed(t.weight("backbone.embeddings.weight"), tokens)  # [R, T, D]
    for i in range(p.layers):
        pre = f"backbone.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "norm.weight"), p.norm_eps)
        x = t.add(x, mamba2_mixer(t, p, pre + "mixer.", i, h))
    x = t.rms_norm(x, t.weight("backbone.norm_f.weight"), p.norm_eps)
    t.finish(x, t.optional_weight("lm_head.weight") or t.weight("backbone.embeddings.weight"))


def trace_mamba_hybrid(cfg: ModelConfig, t: Tracer) -> None:
    p: MambaHybridParams = cfg.params
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    spec = AttentionSpec(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, scale=p.attn_scale,
                         norm_eps=p.norm_eps, rotary_dim=p.rotary_dim)
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens, scale=p.embed_scale)  # [R, T, D]

    def residual(x: Value, branch: Value) -> Value:
        return t.add(x, branch if p.residual_scale is None else t.scale(branch, p.residual_scale))

    for i, kind in enumerate(p.layer_types):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps)
        if kind == "mamba":
            a = mamba2_mixer(t, p.mamba, pre + "mamba.", i, h)
        else:
            a = attention_block(t, spec, pre + "self_attn.", i, h, positions, theta=p.theta, scaling=p.scaling)
        x = residual(x, a)
        h = t.rms_norm(x, t.weight(pre + p.mlp_norm + ".weight"), p.norm_eps)
        m = granite_mlp(t, pre + "shared_mlp.", h) if p.ffn == "shared_mlp" else gated_mlp(t, pre + "feed_forward.", h)
        if p.experts:
            m = granite_experts(t, p, pre + "block_sparse_moe.", h, m)
        x = residual(x, m)
    x = t.rms_norm(x, t.weight(p.final_norm + ".weight"), p.norm_eps)
    if p.logits_scale is not None:
        x = t.scale(x, 1.0 / p.logits_scale)
    t.finish(x, t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight"))


def granite_mlp(t: Tracer, prefix: str, h: Value) -> Value:
    """Granite's (shared) MLP: gate and up joined in one input_linear [2F, D] as Hugging Face stores it, or
    apart (gate_proj, up_proj, down_proj) as llama.cpp's converter writes them."""
    if not t.has_weight(prefix + "input_linear.weight"):
        return gated_mlp(t, prefix, h)
    gu = projection(t, h, prefix + "input_linear")
    f = gu.shape[-1] // 2
    return projection(t, t.gated(t.slice(gu, 0, f), t.slice(gu, f, 2 * f)), prefix + "output_linear")


def granite_experts(t: Tracer, p: MambaHybridParams, prefix: str, h: Value, shared: Value) -> Value:
    """top_k of the routed experts per token, weighted by the softmax of their router logits (transformers
    takes the top logits, then their softmax: the renormalized softmax of all), plus the shared MLP."""
    experts: tuple[Value, Value, Value] | list[tuple[Value, Value, Value]]
    if t.has_weight(prefix + "experts.gate_exps.weight"):  # stacked [E, F, D], as GGUF stores them
        experts = tuple(t.weight(f"{prefix}experts.{n}_exps.weight") for n in ("gate", "up", "down"))  # type: ignore[assignment]
    else:  # per-expert views of Hugging Face's joined tensors (experts.granite_expert_weights)
        experts = [tuple(t.weight(f"{prefix}experts.{e}.{n}.weight") for n in EXPERT_NAMES)  # type: ignore[misc]
                   for e in range(p.experts)]
    return t.moe(h, t.weight(prefix + "router.layer.weight"), experts, top_k=p.top_k, scoring="softmax",
                 norm_topk=True, shared=shared)
