"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers beside gated full attention, each followed by a sparse
MoE with a shared expert (or a dense MLP). Shapes: R rows, T new tokens per row, D hidden.

Gated DeltaNet: in_proj_qkvz gives q, k [Hk, Dk], v and the gate z [Hv, Dv]; in_proj_ba gives beta's and the
decay's inputs [Hv]; a causal convolution (silu) over q, k and v together, the gated delta rule, the norm of
each head's output times silu(z), out_proj. Gated attention: q_proj gives each head's query and an output gate
side by side; q/k norms, rope over the first quarter of each head, attention, output times sigmoid(gate).
Every RMSNorm but the DeltaNet's gated one scales by (1 + w). Weights are read by their Hugging Face names; the
step reads in_proj_qkvz as the two tensors llama.cpp's converter also writes (in_proj_qkv, in_proj_z).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from poot_core import (
    CheckpointError,
    DerivedWeight,
    ModelConfig,
    Reason,
    StoredWeights,
    Tracer,
    Unsupported,
    Value,
    gated_mlp,
    projection,
    require_key,
    rope_from_hf_config,
)

DELTA_CHUNK = 64  # the chunk of the delta rule's prefill (flash-linear-attention's and transformers')
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3NextParams:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    theta: float
    scaling: dict[str, Any]
    norm_eps: float
    layer_types: list[str]  # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    k_heads: int  # the DeltaNet's q/k heads
    v_heads: int  # its v heads (a multiple of k_heads; value head h reads key head h // (v_heads / k_heads))
    k_dim: int
    v_dim: int
    conv_kernel: int
    moe_layers: list[bool]  # per layer: the sparse MoE (True) or the dense MLP
    experts: int
    top_k: int
    norm_topk: bool
    norm_offset: float = 1.0  # the (1 + w) norms; llama.cpp's converter stores 1 + w itself (offset 0)

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim


def qwen3next_params(hf: dict[str, Any]) -> Qwen3NextParams:
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden, heads = int(require_key(hf, "hidden_size")), int(require_key(hf, "num_attention_heads"))
    interval = int(hf.get("full_attention_interval", 4))
    types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % interval == 0] for i in range(layers)]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown or len(types) != layers:
        raise Unsupported(Reason.OPERATION, f"Qwen3-Next layer types {unknown or types}",
                          "poot's Qwen3-Next has linear_attention and full_attention layers, one per layer")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise Unsupported(Reason.OPERATION, f"Qwen3-Next activation {act}", "poot computes silu")
    if hf.get("attention_bias"):
        raise Unsupported(Reason.OPERATION, "Qwen3-Next attention biases", "its checkpoints have none")
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta, scaling = rope_from_hf_config(hf)
    rope = hf.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    experts = int(hf.get("num_experts") or 0)
    sparse_step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
    k_heads, v_heads = int(require_key(hf, "linear_num_key_heads")), int(require_key(hf, "linear_num_value_heads"))
    if v_heads % k_heads:
        raise CheckpointError("config.json", f"linear_num_value_heads {v_heads} is not a multiple of "
                                             f"linear_num_key_heads {k_heads}")
    return Qwen3NextParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim, rotary_dim=int(head_dim * factor), theta=theta, scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), layer_types=list(types), k_heads=k_heads, v_heads=v_heads,
        k_dim=int(require_key(hf, "linear_key_head_dim")), v_dim=int(require_key(hf, "linear_value_head_dim")),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        moe_layers=[experts > 0 and i not in dense and (i + 1) % sparse_step == 0 for i in range(layers)],
        experts=experts, top_k=int(require_key(hf, "num_experts_per_tok")) if experts else 0,
        norm_topk=bool(hf.get("norm_topk_prob", True)))


# --- weights --------------------------------------------------------------------------------------------------

def qkvz_rows(p: Qwen3NextParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of Hugging Face's in_proj_qkvz that make q, k, v (in the convolution's channel order: every q
    head, every k head, every v head) and z. It stores them per key head: [q, k, v (ratio heads), z (ratio)]."""
    ratio = p.v_heads // p.k_heads
    widths = (p.k_dim, p.k_dim, ratio * p.v_dim, ratio * p.v_dim)
    group = sum(widths)
    parts = []
    for i, width in enumerate(widths):
        offset = sum(widths[:i])
        parts.append(torch.cat([torch.arange(g * group + offset, g * group + offset + width)
                                for g in range(p.k_heads)]))
    return torch.cat(parts[:3]), parts[3]


def qwen3next_derived_weights(config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
    """in_proj_qkv [2 Hk Dk + Hv Dv, D] and in_proj_z [Hv Dv, D]: the rows of each layer's in_proj_qkvz in
    the order the step reads them (llama.cpp's converter stores the same two tensors, attn_qkv and attn_gate)."""
    p: Qwen3NextParams = config.params
    shapes = store.shapes()
    qkv_rows, z_rows = qkvz_rows(p)
    derived: dict[str, DerivedWeight] = {}
    for layer, kind in enumerate(p.layer_types):
        if kind != "linear_attention":
            continue
        pre = f"model.layers.{layer}.linear_attn."
        name = pre + "in_proj_qkvz.weight"
        want = (2 * p.key_dim + 2 * p.value_dim, p.hidden)
        if name not in shapes:
            raise CheckpointError(name, "missing: the config has a linear_attention layer here")
        if tuple(shapes[name]) != want:
            raise CheckpointError(name, f"shape {tuple(shapes[name])}, the config says {want}")
        for part, rows in (("in_proj_qkv", qkv_rows), ("in_proj_z", z_rows)):
            derived[f"{pre}{part}.weight"] = ((lambda n=name, r=rows: _rows(store, n, r)), (len(rows), p.hidden))
    return derived


def _rows(store: StoredWeights, name: str, rows: torch.Tensor) -> torch.Tensor:
    w = store.get(name)
    if not isinstance(w, torch.Tensor):  # a PackedWeight: its rows are not regathered here
        raise Unsupported(Reason.QUANTIZATION, f"quantized {name}", "Qwen3-Next's in_proj_qkvz is read from float "
                                                                    "checkpoints")
    return w.index_select(0, rows)


# --- the step -------------------------------------------------------------------------------------------------

def gated_deltanet(t: Tracer, p: Qwen3NextParams, prefix: str, layer: int, h: Value) -> Value:
    R, T = h.shape[0], h.shape[1]
    kd, vd, ratio = p.key_dim, p.value_dim, p.v_heads // p.k_heads
    qkv = projection(t, h, prefix + "in_proj_qkv")  # [R, T, 2 Hk Dk + Hv Dv]
    z = t.reshape(projection(t, h, prefix + "in_proj_z"), (R, T, p.v_heads, p.v_dim))
    ba = t.reshape(projection(t, h, prefix + "in_proj_ba"), (R, T, p.k_heads, 2 * ratio))  # per key head: b, a
    b = t.reshape(t.slice(ba, 0, ratio), (R, T, p.v_heads))
    a = t.reshape(t.slice(ba, ratio, 2 * ratio), (R, T, p.v_heads))
    qkv = t.short_conv(qkv, t.weight(prefix + "conv1d.weight"), t.optional_weight(prefix + "conv1d.bias"),
                       layer=layer, act="silu")
    q = t.reshape(t.slice(qkv, 0, kd), (R, T, p.k_heads, p.k_dim))
    k = t.reshape(t.slice(qkv, kd, 2 * kd), (R, T, p.k_heads, p.k_dim))
    v = t.reshape(t.slice(qkv, 2 * kd, 2 * kd + vd), (R, T, p.v_heads, p.v_dim))
    y = t.gated_delta(q, k, v, a, b, t.weight(prefix + "A_log"), t.weight(prefix + "dt_bias"), layer=layer,
                      chunk=DELTA_CHUNK)
    y = t.gated_rms_norm(y, z, t.weight(prefix + "norm.weight"), eps=p.norm_eps, group=p.v_dim, norm_first=True)
    return projection(t, t.reshape(y, (R, T, vd)), prefix + "out_proj")


def gated_attention(t: Tracer, p: Qwen3NextParams, prefix: str, layer: int, h: Value, positions: Value) -> Value:
    R, T = h.shape[0], h.shape[1]
    H, Dh = p.heads, p.head_dim
    qg = t.reshape(projection(t, h, prefix + "q_proj"), (R, T, H, 2 * Dh))  # per head: query, then its gate
    q, gate = t.slice(qg, 0, Dh), t.reshape(t.slice(qg, Dh, 2 * Dh), (R, T, H * Dh))
    k = t.reshape(projection(t, h, prefix + "k_proj"), (R, T, p.kv_heads, Dh))
    v = t.reshape(projection(t, h, prefix + "v_proj"), (R, T, p.kv_heads, Dh))
    q = t.rms_norm(q, t.weight(prefix + "q_norm.weight"), p.norm_eps, p.norm_offset)
    k = t.rms_norm(k, t.weight(prefix + "k_norm.weight"), p.norm_eps, p.norm_offset)
    rope = {"theta": p.theta, "dim": p.rotary_dim, "style": "neox", "scaling": p.scaling}
    q, k = t.rope(q, positions, **rope), t.rope(k, positions, **rope)
    o = t.reshape(t.attention(q, k, v, positions, layer=layer, scale=Dh**-0.5), (R, T, H * Dh))
    return projection(t, t.gated(gate, o, "sigmoid"), prefix + "o_proj")


def sparse_moe(t: Tracer, p: Qwen3NextParams, prefix: str, h: Value) -> Value:
    """top_k routed experts (softmax over all router logits, renormalized over the chosen when norm_topk) plus
    the shared expert scaled by sigmoid(shared_expert_gate . h)."""
    shared = gated_mlp(t, prefix + "shared_expert.", h)
    experts: tuple[Value, Value, Value] | list[tuple[Value, Value, Value]]
    if t.has_weight(prefix + "experts.gate_exps.weight"):  # stacked [E, F, D], as GGUF stores them
        experts = tuple(t.weight(f"{prefix}experts.{n}_exps.weight") for n in ("gate", "up", "down"))  # type: ignore[assignment]
    else:
        experts = [tuple(t.weight(f"{prefix}experts.{e}.{n}.weight")  # type: ignore[misc]
                         for n in ("gate_proj", "up_proj", "down_proj")) for e in range(p.experts)]
    return t.moe(h, t.weight(prefix + "gate.weight"), experts, top_k=p.top_k, scoring="softmax",
                 norm_topk=p.norm_topk, shared=shared, shared_gate=t.weight(prefix + "shared_expert_gate.weight"))


def trace_qwen3next(cfg: ModelConfig, t: Tracer) -> None:
    p: Qwen3NextParams = cfg.params
    R, T = t.graph.shape.rows, t.graph.shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    x = t.embed(t.weight("model.embed_tokens.weight"), tokens)  # [R, T, D]
    for i, kind in enumerate(p.layer_types):
        pre = f"model.layers.{i}."
        h = t.rms_norm(x, t.weight(pre + "input_layernorm.weight"), p.norm_eps, p.norm_offset)
        if kind == "linear_attention":
            a = gated_deltanet(t, p, pre + "linear_attn.", i, h)
        else:
            a = gated_attention(t, p, pre + "self_attn.", i, h, positions)
        x = t.add(x, a)
        h = t.rms_norm(x, t.weight(pre + "post_attention_layernorm.weight"), p.norm_eps, p.norm_offset)
        x = t.add(x, sparse_moe(t, p, pre + "mlp.", h) if p.moe_layers[i] else gated_mlp(t, pre + "mlp.", h))
    x = t.rms_norm(x, t.weight("model.norm.weight"), p.norm_eps, p.norm_offset)
    t.finish(x, t.optional_weight("lm_head.weight") or t.weight("model.embed_tokens.weight"))
