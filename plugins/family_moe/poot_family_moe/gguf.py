"""GGUF files of the mixture-of-experts families: their metadata translated into the Hugging Face config keys
`params_from_hf` reads (read as llama.cpp reads them), and DeepSeek's split latent-attention tensors joined
back into one kv_b projection."""

from __future__ import annotations

from typing import Any

import torch

from poot_core import CheckpointError, DerivedWeight, GGUFKeys, GGUFTensors, Reason, Unsupported, rope_from_gguf
from poot_family_moe.config import Latent

# GGUF architecture -> the Hugging Face model_type whose conventions its file follows.
GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "llama:moe": "mixtral"}
# llama.cpp's expert_gating_func values
SOFTMAX, SIGMOID = 1, 2


def gguf_hf_config(keys: GGUFKeys, tensors: GGUFTensors, arch: str, family: str) -> tuple[dict[str, Any], str]:
    hidden = int(keys("embedding_length"))
    heads = int(keys("attention.head_count"))
    theta, scaling = rope_from_gguf(keys, tensors)
    hf: dict[str, Any] = {
        "num_hidden_layers": int(keys("block_count")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(keys("attention.head_count_kv", heads)),
        "intermediate_size": int(keys("feed_forward_length", 0)),
        "rms_norm_eps": float(keys("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(keys("context_length", 2048)),
        "vocab_size": int(keys("vocab_size", 0) or len(keys.metadata.get("tokenizer.ggml.tokens", []))),
        "num_experts_per_tok": int(keys("expert_used_count")),
        "moe_intermediate_size": int(keys("expert_feed_forward_length", 0)),
    }
    experts = int(keys("expert_count"))
    if arch == "deepseek2":
        model_type = _deepseek(keys, hf, experts, scaling)
    else:
        found = GGUF_MODEL_TYPES.get(arch)
        if found is None:
            raise CheckpointError(keys.path, f"family {family} does not read GGUF architecture {arch!r}")
        model_type = found
        hf.update({
            "num_experts": experts,
            "num_local_experts": experts,
            "shared_expert_intermediate_size": int(keys("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": bool(keys("expert_weights_norm", model_type != "qwen2_moe")),
        })
        if model_type == "mixtral":
            hf["intermediate_size"] = hf["intermediate_size"] or hf["moe_intermediate_size"]
        head_dim = hf["head_dim"] = int(keys("attention.key_length", hidden // heads))
        for name in ("attention.value_length", "rope.dimension_count"):
            if int(keys(name, head_dim)) != head_dim:
                raise Unsupported(Reason.SHAPE, f"{keys.key(name)} = {keys(name)}",
                                  f"this family's attention has values and rope as wide as its heads ({head_dim})")
    hf["rope_parameters"] = {"rope_theta": theta, **scaling}
    return hf, model_type


def _deepseek(keys: GGUFKeys, hf: dict[str, Any], experts: int, scaling: dict[str, Any]) -> str:
    """DeepSeek V2/V3 (llama.cpp's deepseek2). V3 routes by sigmoid scores; older V2 files have no
    gating key and route by softmax, as llama.cpp reads them."""
    sigmoid = int(keys("expert_gating_func", SOFTMAX)) == SIGMOID
    rope_dim = int(keys("rope.dimension_count"))
    groups = int(keys("expert_group_count", 1))
    # Files from the converter with llama.cpp's absorbed latent attention give the per-head sizes as *_mla
    # (key_length/value_length then describe the latent); older files give them as key_length/value_length.
    key_length = int(keys("attention.key_length"))
    value_length = int(keys("attention.value_length"))
    key_length = int(keys("attention.key_length_mla", key_length))
    value_length = int(keys("attention.value_length_mla", value_length))
    hf.update({
        "n_routed_experts": experts,
        "q_lora_rank": int(keys("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(keys("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": value_length,
        "n_shared_experts": int(keys("expert_shared_count", 0)),
        "routed_scaling_factor": float(keys("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(keys("expert_weights_norm", sigmoid)),
        "n_group": groups,
        "topk_group": int(keys("expert_group_used_count", 1)),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "first_k_dense_replace": int(keys("leading_dense_block_count", 0)),
        "num_nextn_predict_layers": int(keys("nextn_predict_layers", 0)),
    })
    log_mul = keys("rope.scaling.yarn_log_multiplier", None)
    if log_mul is not None:
        if scaling.get("rope_type") != "yarn":
            raise Unsupported(Reason.OPERATION, f"{keys.key('rope.scaling.yarn_log_multiplier')} without YaRN rope")
        # The converter stores 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it (it is not stored).
        scaling["mscale_all_dim"] = scaling["mscale"] = float(log_mul) / 0.1
    return "deepseek_v3" if sigmoid else "deepseek_v2"


def joined_kv_b(tensors: GGUFTensors, k_b: str, v_b: str, heads: int, latent: Latent) -> DerivedWeight:
    """kv_b [H * (nope + v), L] from llama.cpp's k_b [H, L, nope] (transposed per head) and v_b [H, v, L].

    Dense types are joined in their own dtype. Block-quantized halves cannot be joined into blocks of the
    other orientation, so they become their exact dequantized float32 values (these two tensors only)."""
    L, nope, v = latent.kv_rank, latent.nope_dim, latent.v_dim
    want = {k_b: (heads, L, nope), v_b: (heads, v, L)}
    for name, shape in want.items():
        if tensors.shape(name) != shape:
            raise CheckpointError(tensors.path,
                                  f"tensor {name} has shape {tensors.shape(name)}, the metadata says {shape}")

    def make() -> torch.Tensor:
        k, vv = tensors.stored(k_b), tensors.stored(v_b)
        if not (isinstance(k, torch.Tensor) and isinstance(vv, torch.Tensor) and k.dtype == vv.dtype):
            k, vv = tensors.read(k_b), tensors.read(v_b)
        return torch.cat((k.transpose(1, 2), vv), dim=1).reshape(heads * (nope + v), L).contiguous()

    return make, (heads * (nope + v), L)
