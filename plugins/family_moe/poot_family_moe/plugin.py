"""poot-family-moe's entry point: mixtral, qwen2_moe, qwen3_moe, deepseek_v2 and deepseek_v3, from Hugging
Face checkpoints or GGUF files (llama.cpp's names, stacked `ffn_*_exps` experts)."""

from __future__ import annotations

import re
from typing import Any

from poot_core import CheckpointError, Family, ModelConfig, StepShape, Tracer, hookimpl
from poot_family_moe.config import MoeParams, params_from_hf
from poot_family_moe.model import trace_moe

# llama.cpp per-block names -> ours ("{moe}" is the experts' prefix: "mlp" or mixtral's "block_sparse_moe";
# "{shared}" the shared expert's: qwen2_moe "shared_expert", deepseek "shared_experts").
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "exp_probs_b": "{moe}.gate.e_score_correction_bias",
    "ffn_gate_exps": "{moe}.experts.gate_exps",
    "ffn_up_exps": "{moe}.experts.up_exps",
    "ffn_down_exps": "{moe}.experts.down_exps",
    "ffn_gate_shexp": "{moe}.{shared}.gate_proj",
    "ffn_up_shexp": "{moe}.{shared}.up_proj",
    "ffn_down_shexp": "{moe}.{shared}.down_proj",
    "ffn_gate_inp_shexp": "{moe}.shared_expert_gate",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = re.compile(r"blk\.(\d+)\.([a-z_.]+)\.(weight|bias)$")
# GGUF architecture -> the Hugging Face model_type whose conventions its file follows.
GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "llama:moe": "mixtral"}


class MoeDecoder(Family):
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        model_type = str(hf.get("model_type") or self.model_type)
        if model_type not in MODEL_TYPES:
            model_type = self.model_type
        p = params_from_hf(hf, model_type)
        arch = (hf.get("architectures") or [model_type])[0]
        return _model_config(
            p.model_type,
            arch,
            p,
            int(hf["vocab_size"]),
            int(hf.get("max_position_embeddings", 2048)),
            hf.get("eos_token_id"),
            hf.get("bos_token_id"),
            "hf",
            hf,
        )

    def config_from_gguf(self, meta: dict[str, Any]) -> ModelConfig:
        arch = str(meta.get("general.architecture", ""))
        if arch == "llama" and meta.get("llama.expert_count"):
            arch = "llama:moe"  # llama.cpp names mixtral "llama"; its expert count sets it apart
        prefix = "llama" if arch == "llama:moe" else arch
        where = meta.get("__path__", "gguf")

        def key(name: str, default: Any = ...) -> Any:
            value = meta.get(f"{prefix}.{name}")
            if value is None:
                if default is ...:
                    raise CheckpointError(where, f"missing metadata {prefix}.{name}")
                return default
            return value[0] if isinstance(value, list) and value else value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        layers = int(key("block_count"))
        hf: dict[str, Any] = {
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv", heads)),
            "intermediate_size": int(key("feed_forward_length", 0)),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(key("context_length", 2048)),
            "vocab_size": int(key("vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", []))),
            "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length", 0)),
        }
        experts = int(key("expert_count"))
        if arch == "deepseek2":
            sigmoid = int(key("expert_gating_func", 1)) == 2
            model_type = "deepseek_v3" if sigmoid else "deepseek_v2"
            rope_dim = int(key("rope.dimension_count"))
            q_rank = int(key("attention.q_lora_rank", 0))
            groups = int(key("expert_group_count", 1))
            hf.update(
                {
                    "n_routed_experts": experts,
                    "q_lora_rank": q_rank or None,
                    "kv_lora_rank": int(key("attention.kv_lora_rank")),
                    "qk_rope_head_dim": rope_dim,
                    "qk_nope_head_dim": int(key("attention.key_length")) - rope_dim,
                    "v_head_dim": int(key("attention.value_length")),
                    "n_shared_experts": int(key("expert_shared_count", 0)),
                    "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
                    "norm_topk_prob": bool(key("expert_weights_norm", sigmoid)),
                    "n_group": groups,
                    "topk_group": int(key("expert_group_used_count", 1)),
                    "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
                    "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
                    "num_nextn_predict_layers": int(key("nextn_predict_layers", 0)),
                }
            )
        else:
            model_type = GGUF_MODEL_TYPES.get(arch)
            if model_type is None:
                raise CheckpointError(where, f"family {self.name} does not read GGUF architecture {arch!r}")
            hf.update(
                {
                    "num_experts": experts,
                    "num_local_experts": experts,
                    "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length", 0)),
                    "norm_topk_prob": bool(key("expert_weights_norm", model_type != "qwen2_moe")),
                }
            )
            if model_type == "mixtral":
                hf["intermediate_size"] = hf["intermediate_size"] or hf["moe_intermediate_size"]
            head_dim = key("attention.key_length", None)
            if head_dim:
                hf["head_dim"] = int(head_dim)
        p = params_from_hf(hf, model_type)
        if model_type == "mixtral":
            p.rope_style = "interleaved"  # llama.cpp's converter permuted q/k rows for its rope layout
        return _model_config(
            p.model_type,
            arch,
            p,
            hf["vocab_size"],
            hf["max_position_embeddings"],
            meta.get("tokenizer.ggml.eos_token_id"),
            meta.get("tokenizer.ggml.bos_token_id"),
            "gguf",
            meta,
        )

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        p: MoeParams = config.params
        match = BLOCK.match(name)
        if match:
            layer, part, kind = match.groups()
            mapped = GGUF_BLOCK_NAMES.get(part)
            if int(layer) >= p.layers:  # DeepSeek V3's next-token-prediction layers: kept, not traced
                return f"model.layers.{layer}.{mapped or part}.{kind}"
            if mapped is None:
                return None
            shared = "shared_expert" if p.routing.shared_gate else "shared_experts"
            full = f"model.layers.{layer}.{mapped.format(moe=p.moe_prefix, shared=shared)}"
            return full if part == "exp_probs_b" else f"{full}.{kind}"  # the HF name has no .weight/.bias
        stem, _, kind = name.rpartition(".")
        top = GGUF_TOP_NAMES.get(stem)
        return f"{top}.{kind}" if top else None

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_moe(config, t, shape)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _model_config(
    family: str, arch: str, p: MoeParams, vocab: int, positions: int, eos: Any, bos: Any, fmt: str, raw: dict[str, Any]
) -> ModelConfig:
    return ModelConfig(
        family=family,
        architecture=arch,
        vocab_size=vocab,
        max_positions=positions,
        hidden_size=p.hidden,
        eos_ids=_eos(eos),
        bos_id=None if bos is None else int(bos),
        params=p,
        source_format=fmt,
        raw=raw,
    )


MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
FAMILIES = [
    MoeDecoder("mixtral", "mixtral", ("MixtralForCausalLM", "mixtral", "llama:moe")),
    MoeDecoder("qwen2_moe", "qwen2_moe", ("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe")),
    MoeDecoder("qwen3_moe", "qwen3_moe", ("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe")),
    MoeDecoder("deepseek_v2", "deepseek_v2", ("DeepseekV2ForCausalLM", "deepseek_v2", "deepseek2")),
    MoeDecoder("deepseek_v3", "deepseek_v3", ("DeepseekV3ForCausalLM", "deepseek_v3")),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "MoeDecoder"]
