"""The mixture-of-experts decoder, written once over the tracer's ops.

Attention is grouped-query (mixtral, qwen2_moe, qwen3_moe) or latent (deepseek); the feed-forward part of a
layer is a dense MLP or the moe op (route + experts), with a shared expert beside it where the model has one.
Shapes: R rows, T new tokens per row, D hidden, H heads, Dh head size.
"""

from __future__ import annotations

import torch

from poot_core import (
    AttentionSpec,
    DerivedWeight,
    ModelConfig,
    Reason,
    StoredWeights,
    Tracer,
    Unsupported,
    Value,
    attention_block,
    gated_mlp,
    projection,
)
from poot_family_moe.config import MoeParams


def trace_moe(cfg: ModelConfig, t: Tracer) -> None:
    p: MoeParams = cfg.params
    if t.graph.shape.mtp:
        trace_mtp(cfg, t)
        return
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens)  # [R, T, D]
    for i in range(p.layers):
        x = _block(cfg, t, i, x, positions)
    x = t.rms_norm(x, t.weight("model.norm.weight"), p.norm_eps)
    t.finish(x, _head(t))


def trace_mtp(cfg: ModelConfig, t: Tracer) -> None:
    """DeepSeek V3's multi-token-prediction layer (model.layers.<layers>.*): the token's embedding and the
    target's final hidden state at the position before it, each RMS-normed, joined [emb, hidden] and projected
    by eh_proj (here as its two halves, summed), then one decoder layer with its own KV, the shared head's norm
    and the head. Outputs the logits and the layer's output before that norm (the next draft step's hidden)."""
    p: MoeParams = cfg.params
    R, T, D = t.graph.shape.rows, t.graph.shape.tokens, p.hidden
    i = p.layers
    pre = f"model.layers.{i}."
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    hidden = t.input("hidden", (R, T, D), dtype="f32")
    embedding = t.optional_weight(pre + "embed_tokens.weight") or t.weight("model.embed_tokens.weight")
    e = t.rms_norm(t.embed(embedding, tokens), t.weight(pre + "enorm.weight"), p.norm_eps)
    h = t.rms_norm(hidden, t.weight(pre + "hnorm.weight"), p.norm_eps)
    x = t.add(t.linear(e, t.weight(pre + "eh_proj.emb.weight")), t.linear(h, t.weight(pre + "eh_proj.hidden.weight")))
    x = _block(cfg, t, i, x, positions)
    normed = t.rms_norm(x, t.weight(pre + "shared_head.norm.weight"), p.norm_eps)
    t.finish(normed, t.optional_weight(pre + "shared_head.head.weight") or _head(t))
    t.output(x)


def mtp_eh_halves(cfg: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
    """eh_proj [D, 2D] of each multi-token-prediction layer as its two column halves [D, D]: the one the normed
    embedding goes through and the one the normed hidden state goes through."""
    p: MoeParams = cfg.params
    shapes, D = store.shapes(), p.hidden
    derived: dict[str, DerivedWeight] = {}
    for i in range(p.layers, p.layers + p.mtp_layers):
        name = f"model.layers.{i}.eh_proj.weight"
        if tuple(shapes.get(name, ())) != (D, 2 * D):
            continue  # absent (or not this shape): MTP is refused when it traces
        for half, cols in (("emb", slice(0, D)), ("hidden", slice(D, 2 * D))):
            derived[f"model.layers.{i}.eh_proj.{half}.weight"] = ((lambda n=name, c=cols: _columns(store, n, c)),
                                                                  (D, D))
    return derived


def _columns(store: StoredWeights, name: str, cols: slice) -> torch.Tensor:
    w = store.get(name)
    if not isinstance(w, torch.Tensor):  # a packed layout's blocks run along the rows: not cut here
        raise Unsupported(Reason.QUANTIZATION, f"quantized {name}", "MTP reads eh_proj from a float checkpoint")
    return w[:, cols].contiguous()


def _head(t: Tracer) -> Value:
    return t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight")


def _block(cfg: ModelConfig, t: Tracer, i: int, x: Value, positions: Value) -> Value:
    """Decoder layer i: attention (grouped-query or latent) and the dense MLP or the experts, each residual."""
    p: MoeParams = cfg.params
    pre = f"model.layers.{i}."
    h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps)
    if p.latent is not None:
        a = _latent_attention(t, p, i, h, positions)
    else:
        spec = AttentionSpec(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, scale=p.attn_scale,
                             norm_eps=p.norm_eps, qk_norm=p.qk_norm, rope_style=p.rope_style)
        a = attention_block(t, spec, pre + "self_attn.", i, h, positions, theta=p.theta, scaling=p.scaling,
                            window=p.windows[i] if i < len(p.windows) else None)
    x = t.add(x, a)
    h = t.rms_norm(x, t.weight(pre + "post_attention_layernorm.weight"), p.norm_eps)
    # GGUF metadata cannot say which layers are dense (qwen's mlp_only_layers), nor the config whether the
    # multi-token-prediction layer past the last is: the file's tensors do.
    known = cfg.source_format == "hf" and i < len(p.sparse)
    sparse = p.sparse[i] if known else t.has_weight(f"{pre}{p.moe_prefix}.gate.weight")
    m = _experts(t, p, pre, h) if sparse else gated_mlp(t, pre + "mlp.", h)
    return t.add(x, m)


def _latent_attention(t: Tracer, p: MoeParams, i: int, h: Value, positions: Value) -> Value:
    pre = f"model.layers.{i}.self_attn."
    R, T = h.shape[0], h.shape[1]
    lat = p.latent
    assert lat is not None
    if lat.q_rank:  # low-rank query: q_a, its norm, q_b
        q = projection(t, h, pre + "q_a_proj")
        q = t.rms_norm(q, t.weight(pre + "q_a_layernorm.weight"), p.norm_eps)
        q = projection(t, q, pre + "q_b_proj")
    else:
        q = projection(t, h, pre + "q_proj")
    q = t.reshape(q, (R, T, p.heads, lat.nope_dim + lat.rope_dim))
    kv = projection(t, h, pre + "kv_a_proj_with_mqa")
    o = t.mla_attention(
        q,
        kv,
        positions,
        t.weight(pre + "kv_a_layernorm.weight"),
        t.weight(pre + "kv_b_proj.weight"),
        layer=i,
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
    return projection(t, o, pre + "o_proj")


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
        shared = gated_mlp(t, pre + name, h)
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
