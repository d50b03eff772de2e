"""The mixture-of-experts decoder, written once over the tracer's ops.

Attention is grouped-query (mixtral, qwen2_moe, qwen3_moe) or latent (deepseek); the feed-forward part of a
layer is a dense MLP or the moe op (route + experts), with a shared expert beside it where the model has one.
Shapes: R rows, T new tokens per row, D hidden, H heads, Dh head size.
"""

from __future__ import annotations

from poot_core import ModelConfig, StepShape, Tracer, Value
from poot_family_moe.config import MoeParams


def trace_moe(cfg: ModelConfig, t: Tracer, shape: StepShape) -> None:
    p: MoeParams = cfg.params
    R, T = shape.rows, shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens)  # [R, T, D]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps)
        if p.latent is not None:
            a = _latent_attention(t, p, i, h, positions, shape)
        else:
            a = _attention(t, p, i, h, positions, shape)
        x = t.add(x, a)
        h = t.rms_norm(x, t.weight(pre + "post_attention_layernorm.weight"), p.norm_eps)
        # GGUF metadata cannot say which layers are dense (qwen's mlp_only_layers): the file's tensors do.
        sparse = p.sparse[i] if cfg.source_format == "hf" else t.has_weight(f"{pre}{p.moe_prefix}.gate.weight")
        m = _experts(t, p, pre, h) if sparse else _mlp(t, pre + "mlp.", h)
        x = t.add(x, m)
    x = t.rms_norm(x, t.weight("model.norm.weight"), p.norm_eps)
    head = t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight")
    t.finish(x, head)


def _attention(t: Tracer, p: MoeParams, i: int, h: Value, positions: Value, shape: StepShape) -> Value:
    pre = f"model.layers.{i}.self_attn."
    R, T = shape.rows, shape.tokens

    def project(name: str, heads: int) -> Value:
        y = t.linear(h, t.weight(pre + name + ".weight"), t.optional_weight(pre + name + ".bias"))
        return t.reshape(y, (R, T, heads, p.head_dim))

    q, k, v = project("q_proj", p.heads), project("k_proj", p.kv_heads), project("v_proj", p.kv_heads)
    if p.qk_norm:  # qwen3_moe: per-head RMSNorm before rope
        q = t.rms_norm(q, t.weight(pre + "q_norm.weight"), p.norm_eps)
        k = t.rms_norm(k, t.weight(pre + "k_norm.weight"), p.norm_eps)
    rope = {"theta": p.theta, "dim": p.head_dim, "style": p.rope_style, "scaling": p.scaling}
    q, k = t.rope(q, positions, **rope), t.rope(k, positions, **rope)
    o = t.attention(
        q, k, v, positions, layer=i, capacity=shape.capacity, scale=p.attn_scale, window=p.windows[i]
    )  # [R, T, H, Dh]
    o = t.reshape(o, (R, T, p.heads * p.head_dim))
    return t.linear(o, t.weight(pre + "o_proj.weight"), t.optional_weight(pre + "o_proj.bias"))


def _latent_attention(t: Tracer, p: MoeParams, i: int, h: Value, positions: Value, shape: StepShape) -> Value:
    pre = f"model.layers.{i}.self_attn."
    R, T = shape.rows, shape.tokens
    lat = p.latent
    assert lat is not None
    if lat.q_rank:  # low-rank query: q_a, its norm, q_b
        q = t.linear(h, t.weight(pre + "q_a_proj.weight"), t.optional_weight(pre + "q_a_proj.bias"))
        q = t.rms_norm(q, t.weight(pre + "q_a_layernorm.weight"), p.norm_eps)
        q = t.linear(q, t.weight(pre + "q_b_proj.weight"))
    else:
        q = t.linear(h, t.weight(pre + "q_proj.weight"))
    q = t.reshape(q, (R, T, p.heads, lat.nope_dim + lat.rope_dim))
    kv = t.linear(h, t.weight(pre + "kv_a_proj_with_mqa.weight"), t.optional_weight(pre + "kv_a_proj_with_mqa.bias"))
    o = t.mla_attention(
        q,
        kv,
        positions,
        t.weight(pre + "kv_a_layernorm.weight"),
        t.weight(pre + "kv_b_proj.weight"),
        layer=i,
        capacity=shape.capacity,
        scale=p.attn_scale,
        nope_dim=lat.nope_dim,
        rope_dim=lat.rope_dim,
        v_dim=lat.v_dim,
        eps=p.norm_eps,
        theta=p.theta,
        style=p.rope_style,
        scaling=p.scaling,
    )  # [R, T, H, v_dim]
    o = t.reshape(o, (R, T, p.heads * lat.v_dim))
    return t.linear(o, t.weight(pre + "o_proj.weight"), t.optional_weight(pre + "o_proj.bias"))


def _mlp(t: Tracer, pre: str, h: Value, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Value:
    gate = t.linear(h, t.weight(f"{pre}{names[0]}.weight"))
    up = t.linear(h, t.weight(f"{pre}{names[1]}.weight"))
    return t.linear(t.gated(gate, up), t.weight(f"{pre}{names[2]}.weight"))


def _experts(t: Tracer, p: MoeParams, pre: str, h: Value) -> Value:
    r = p.routing
    pre = f"{pre}{p.moe_prefix}."
    g, u, d = p.expert_names
    experts: tuple[Value, Value, Value] | list[tuple[Value, Value, Value]]
    if t.has_weight(pre + "experts.gate_exps.weight"):  # stacked [E, F, D], as GGUF stores them
        experts = tuple(t.weight(f"{pre}experts.{n}_exps.weight") for n in ("gate", "up", "down"))  # type: ignore[assignment]
    else:
        experts = [
            tuple(t.weight(f"{pre}experts.{e}.{n}.weight") for n in (g, u, d))  # type: ignore[misc]
            for e in range(r.experts)
        ]
    shared = shared_gate = None
    if r.shared_intermediate:
        name = "shared_expert." if r.shared_gate else "shared_experts."
        shared = _mlp(t, pre + name, h)
        shared_gate = t.weight(pre + "shared_expert_gate.weight") if r.shared_gate else None
    return t.moe(
        h,
        t.weight(pre + "gate.weight"),
        experts,
        top_k=r.top_k,
        scoring=r.scoring,
        norm_topk=r.norm_topk,
        routed_scale=r.routed_scale,
        groups=r.groups,
        topk_groups=r.topk_groups,
        group_score=r.group_score,
        bias=t.optional_weight(pre + "gate.e_score_correction_bias"),
        shared=shared,
        shared_gate=shared_gate,
    )
