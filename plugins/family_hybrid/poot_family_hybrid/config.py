"""Hybrid decoder configurations, read from a Hugging Face config.json: LFM2 (short convolutions beside GQA
attention), Mamba2 (selective-scan layers only) and the Mamba2 hybrids (Granite 4.0-H, Bamba: Mamba2 layers
beside GQA attention)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poot_core import CheckpointError, ModelConfig, Reason, Unsupported, eos_ids, require_key, rope_from_hf_config


@dataclass
class Lfm2Params:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    layer_types: list[str]  # per layer: "conv" or "full_attention"
    theta: float
    scaling: dict[str, Any] = field(default_factory=dict)


@dataclass
class Mamba2Params:
    layers: int
    hidden: int
    heads: int  # SSM heads
    head_dim: int
    state: int  # N, the state size per head and feature
    groups: int  # B and C groups (heads // groups heads share one)
    inner: int  # expand * hidden = heads * head_dim
    conv_kernel: int
    chunk: int  # scan chunk of prefill
    norm_eps: float
    dt_limit: tuple[float, float]


@dataclass
class MambaHybridParams:
    """Granite 4.0-H (GraniteMoeHybrid) and Bamba. Granite scales the embeddings, each residual branch and
    the attention scores by its multipliers and divides the logits by logits_scaling; Bamba ropes half of
    each head, Granite (position_embedding_type "nope") none of it. Granite's MoE variant (experts > 0)
    adds, in every layer, `top_k` of its routed experts (softmax over the chosen experts' router logits) to
    the shared MLP's output."""

    mamba: Mamba2Params
    layer_types: list[str]  # per layer: "mamba" or "attention"
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # 0: no rope
    theta: float
    scaling: dict[str, Any]
    attn_scale: float
    norm_eps: float
    ffn: str  # "shared_mlp" (Granite: one joined input_linear) or "feed_forward" (Bamba: gate/up/down)
    mlp_norm: str  # the norm before the MLP
    final_norm: str
    embed_scale: float | None = None
    residual_scale: float | None = None
    logits_scale: float | None = None  # the final hidden state is divided by it before the head
    experts: int = 0  # routed experts per layer (Granite MoE); 0: the shared MLP alone
    top_k: int = 0
    expert_intermediate: int = 0  # F of each expert

    @property
    def hidden(self) -> int:
        return self.mamba.hidden


def lfm2_params(hf: dict[str, Any]) -> Lfm2Params:
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden = int(require_key(hf, "hidden_size"))
    heads = int(require_key(hf, "num_attention_heads"))
    types = hf.get("layer_types")
    if not types:
        attn = set(hf.get("full_attn_idxs") or range(layers))
        types = ["full_attention" if i in attn else "conv" for i in range(layers)]
    unknown = sorted(set(types) - {"conv", "full_attention"})
    if unknown or len(types) != layers:
        raise Unsupported(Reason.OPERATION, f"LFM2 layer types {unknown or types}",
                          "poot's LFM2 has conv and full_attention layers, one per layer")
    theta, scaling = rope_from_hf_config(hf)
    return Lfm2Params(layers=layers, hidden=hidden, heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
                      head_dim=hidden // heads, norm_eps=float(hf.get("norm_eps", 1e-5)), layer_types=list(types),
                      theta=theta, scaling=scaling)


def mamba2_params(hf: dict[str, Any], prefix: str = "") -> Mamba2Params:
    """Mamba2's own keys, or the hybrids' (prefix "mamba_": mamba_n_heads, mamba_d_head, ...)."""
    hidden = int(require_key(hf, "hidden_size"))
    if prefix:
        renamed = {"num_heads": "n_heads", "head_dim": "d_head", "state_size": "d_state", "n_groups": "n_groups",
                   "expand": "expand", "conv_kernel": "d_conv", "chunk_size": "chunk_size",
                   "use_conv_bias": "conv_bias"}
        hf = {**hf, **{ours: hf[prefix + theirs] for ours, theirs in renamed.items() if prefix + theirs in hf},
              "layer_norm_epsilon": hf.get("rms_norm_eps", 1e-6)}
        if hf.get("head_dim") in (None, "auto"):
            hf["head_dim"] = int(float(hf.get("expand", 2)) * hidden) // int(require_key(hf, "num_heads"))
    heads, head_dim = int(require_key(hf, "num_heads")), int(require_key(hf, "head_dim"))
    inner = int(float(hf.get("expand", 2)) * hidden)
    if heads * head_dim != inner:
        raise CheckpointError("config.json", f"Mamba2 heads x head_dim = {heads * head_dim} is not expand x hidden "
                                             f"= {inner}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise Unsupported(Reason.OPERATION, f"Mamba2 convolution activation {act}", "poot computes silu")
    if not hf.get("rms_norm", True):
        raise Unsupported(Reason.OPERATION, "Mamba2 without its gated RMSNorm", "the mixer's norm is gated")
    low, high = (_float(v) for v in (hf.get("time_step_limit") or (0.0, float("inf"))))
    return Mamba2Params(layers=int(require_key(hf, "num_hidden_layers")), hidden=hidden, heads=heads, head_dim=head_dim,
                        state=int(require_key(hf, "state_size")), groups=int(hf.get("n_groups", 1)), inner=inner,
                        conv_kernel=int(hf.get("conv_kernel", 4)), chunk=int(hf.get("chunk_size", 256)),
                        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), dt_limit=(low, high))


def _float(value: Any) -> float:
    """A float as transformers writes it: infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


MAMBA_LAYERS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                "full_attention": "attention"}


def mamba_hybrid_params(hf: dict[str, Any], model_type: str) -> MambaHybridParams:
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden, heads = int(require_key(hf, "hidden_size")), int(require_key(hf, "num_attention_heads"))
    types = hf.get("layer_types") or hf.get("layers_block_type")
    if not types:
        attn = set(hf.get("attn_layer_indices") or ())
        types = ["attention" if i in attn else "mamba" for i in range(layers)]
    unknown = sorted({t for t in types if t not in MAMBA_LAYERS})
    if unknown or len(types) != layers:
        raise Unsupported(Reason.OPERATION, f"{model_type} layer types {unknown or types}",
                          "poot's Mamba2 hybrids have mamba and attention layers, one per layer")
    granite = model_type == "granitemoehybrid"
    experts = int(hf.get("num_local_experts") or 0) if granite else 0
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta, scaling = rope_from_hf_config(hf)
    if granite:
        kind = hf.get("position_embedding_type")
        if kind not in (None, "nope", "rope"):
            raise Unsupported(Reason.OPERATION, f"position_embedding_type {kind}", "Granite config")
        rotary = head_dim if kind == "rope" else 0
    else:
        rope = hf.get("rope_parameters") or {}
        rotary = int(head_dim * float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))))

    def multiplier(key: str) -> float | None:
        value = hf.get(key) if granite else None
        return None if value in (None, 1, 1.0) else float(value)

    return MambaHybridParams(
        mamba=mamba2_params(hf, "mamba_"), layer_types=[MAMBA_LAYERS[t] for t in types], heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim, rotary_dim=rotary, theta=theta,
        scaling=scaling, attn_scale=float(hf.get("attention_multiplier", 1.0)) if granite else head_dim**-0.5,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), ffn="shared_mlp" if granite else "feed_forward",
        mlp_norm="post_attention_layernorm" if granite else "pre_ff_layernorm",
        final_norm="model.norm" if granite else "model.final_layernorm", embed_scale=multiplier("embedding_multiplier"),
        residual_scale=multiplier("residual_multiplier"), logits_scale=multiplier("logits_scaling"),
        experts=experts, top_k=int(require_key(hf, "num_experts_per_tok")) if experts else 0,
        expert_intermediate=int(require_key(hf, "intermediate_size")) if experts else 0)


def model_config(family: str, hf: dict[str, Any], params: Any) -> ModelConfig:
    arch = (hf.get("architectures") or [hf.get("model_type", family)])[0]
    return ModelConfig(family=family, architecture=arch, vocab_size=int(require_key(hf, "vocab_size")),
                       max_positions=int(hf.get("max_position_embeddings", 1 << 20)), hidden_size=params.hidden,
                       eos_ids=eos_ids(hf.get("eos_token_id")), bos_id=hf.get("bos_token_id"), params=params,
                       source_format="hf", raw=hf)
