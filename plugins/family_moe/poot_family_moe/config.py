"""One configuration for the mixture-of-experts decoders (mixtral, qwen2_moe, qwen3_moe, deepseek_v2/v3),
read from a Hugging Face config.json. GGUF metadata is translated into the same keys by plugin.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from poot_core import CheckpointError, Reason, Unsupported, require_key, rope_from_hf_config


@dataclass
class Latent:
    """Multi-head latent attention (DeepSeek): q through a low-rank q_a/q_b pair when q_rank is set."""

    q_rank: int | None
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int


@dataclass
class Routing:
    experts: int
    top_k: int
    intermediate: int  # per expert
    scoring: str = "softmax"  # or "sigmoid"
    norm_topk: bool = True
    routed_scale: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # "top2": DeepSeek V3 scores a group by its two best experts
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # qwen2_moe: sigmoid gate on the shared expert


@dataclass
class MoeParams:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense layers' MLP
    norm_eps: float
    theta: float
    scaling: dict[str, Any]
    windows: list[int | None]
    sparse: list[bool]  # per layer: experts (True) or a dense MLP
    routing: Routing
    latent: Latent | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    rope_style: str = "neox"
    attn_scale: float = 0.0
    mtp_layers: int = 0  # DeepSeek V3's next-token-prediction layers: loaded and kept, not traced
    # Weight names that differ between families (mixtral: block_sparse_moe, w1/w3/w2).
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    extra: dict[str, Any] = field(default_factory=dict)


def _yarn_softmax_factor(scaling: dict[str, Any]) -> float:
    """DeepSeek's YaRN also scales the attention softmax by mscale(factor, mscale_all_dim) squared."""
    m_all = scaling.get("mscale_all_dim") if scaling.get("rope_type", scaling.get("type")) == "yarn" else None
    if not m_all or scaling["factor"] <= 1:
        return 1.0
    return (0.1 * m_all * math.log(scaling["factor"]) + 1.0) ** 2


def _windows(hf: dict[str, Any], model_type: str, layers: int) -> list[int | None]:
    window = hf.get("sliding_window")
    if model_type == "mixtral":
        return [int(window) if window else None] * layers
    if not hf.get("use_sliding_window") or not window:
        return [None] * layers
    types = hf.get("layer_types")
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window)] * layers


def _sparse(hf: dict[str, Any], model_type: str, layers: int) -> list[bool]:
    if model_type.startswith("deepseek"):
        first = int(hf.get("first_k_dense_replace") or 0)
        return [i >= first for i in range(layers)]
    if model_type == "mixtral":
        return [True] * layers
    only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    return [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers)]


def _routing(hf: dict[str, Any], model_type: str) -> Routing:
    if model_type == "mixtral":
        return Routing(
            int(require_key(hf, "num_local_experts")),
            int(require_key(hf, "num_experts_per_tok")),
            int(require_key(hf, "intermediate_size")),
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        count = hf.get("num_experts") or require_key(hf, "num_local_experts")  # transformers 5 writes the latter
        return Routing(
            int(count),
            int(require_key(hf, "num_experts_per_tok")),
            int(require_key(hf, "moe_intermediate_size")),
            norm_topk=bool(hf.get("norm_topk_prob")),
            shared_intermediate=int(hf.get("shared_expert_intermediate_size") or 0),
            shared_gate=model_type == "qwen2_moe",
        )
    shared = int(hf.get("n_shared_experts") or 0) * int(require_key(hf, "moe_intermediate_size"))
    common = dict(
        experts=int(require_key(hf, "n_routed_experts")),
        top_k=int(require_key(hf, "num_experts_per_tok")),
        intermediate=int(require_key(hf, "moe_intermediate_size")),
        routed_scale=float(hf.get("routed_scaling_factor") or 1.0),
        shared_intermediate=shared,
    )
    if model_type == "deepseek_v3":
        return Routing(
            **common,
            scoring="sigmoid",
            norm_topk=bool(hf.get("norm_topk_prob", True)),
            groups=int(hf.get("n_group") or 1),
            topk_groups=int(hf.get("topk_group") or 1),
            group_score="top2",
        )
    # deepseek_v2 as transformers runs it: softmax scores, never renormalized, groups only when asked.
    grouped = hf.get("topk_method") == "group_limited_greedy"
    return Routing(
        **common,
        scoring="softmax",
        norm_topk=False,
        groups=int(hf.get("n_group") or 1) if grouped else 1,
        topk_groups=int(hf.get("topk_group") or 1) if grouped else 1,
    )


def params_from_hf(hf: dict[str, Any], model_type: str) -> MoeParams:
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden = int(require_key(hf, "hidden_size"))
    heads = int(require_key(hf, "num_attention_heads"))
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise Unsupported(Reason.OPERATION, f"activation {act}", f"{model_type} config")
    theta, scaling = rope_from_hf_config(hf)
    latent = None
    head_dim = int(hf.get("head_dim") or hidden // heads)
    style = "neox"
    if model_type.startswith("deepseek"):
        latent = Latent(
            q_rank=hf.get("q_lora_rank"),
            kv_rank=int(require_key(hf, "kv_lora_rank")),
            nope_dim=int(require_key(hf, "qk_nope_head_dim")),
            rope_dim=int(require_key(hf, "qk_rope_head_dim")),
            v_dim=int(require_key(hf, "v_head_dim")),
        )
        head_dim = latent.nope_dim + latent.rope_dim
        # V2 always pairs rope features (0, 1), (2, 3); V3 does when rope_interleave (its default).
        style = "interleaved" if model_type == "deepseek_v2" or hf.get("rope_interleave", True) else "neox"
    p = MoeParams(
        model_type=model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate=int(require_key(hf, "intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        theta=theta,
        scaling=scaling,
        windows=_windows(hf, model_type, layers),
        sparse=_sparse(hf, model_type, layers),
        routing=_routing(hf, model_type),
        latent=latent,
        qk_norm=model_type == "qwen3_moe",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_style=style,
        attn_scale=head_dim**-0.5 * _yarn_softmax_factor(scaling),
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0) if model_type == "deepseek_v3" else 0,
    )
    if model_type == "mixtral":
        p.moe_prefix, p.expert_names = "block_sparse_moe", ("w1", "w3", "w2")
    r = p.routing
    if r.groups > 1 and r.experts % r.groups:
        raise CheckpointError("config.json", f"{r.experts} experts do not split into {r.groups} groups")
    return p
