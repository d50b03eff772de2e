"""poot-family-moe's entry point: mixtral, qwen2_moe, qwen3_moe, deepseek_v2 and deepseek_v3, from Hugging
Face checkpoints or GGUF files (llama.cpp's names: stacked `ffn_*_exps` experts or the older per-expert
`ffn_*.E`, DeepSeek's latent attention as one `attn_kv_b` or split into `attn_k_b`/`attn_v_b`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poot_core import (
    DerivedWeight,
    Family,
    GGUFKeys,
    GGUFNames,
    GGUFTensors,
    ModelConfig,
    StepShape,
    StoredWeights,
    Tracer,
    eos_ids,
    hookimpl,
    require_key,
    split_gguf_name,
    unknown_tensor,
)
from poot_family_moe.config import MoeParams, params_from_hf
from poot_family_moe.gguf import gguf_hf_config, joined_kv_b
from poot_family_moe.model import mtp_eh_halves, trace_moe

# llama.cpp's per-block names beyond the shared ones ("{moe}" is the experts' prefix: "mlp" or mixtral's
# "block_sparse_moe"; "{shared}" the shared expert's: qwen2_moe "shared_expert", deepseek "shared_experts").
GGUF_NAMES = GGUFNames().extended({
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "{moe}.gate",
    "exp_probs_b": "{moe}.gate.e_score_correction_bias",
    "ffn_gate_exps": "{moe}.experts.gate_exps",
    "ffn_up_exps": "{moe}.experts.up_exps",
    "ffn_down_exps": "{moe}.experts.down_exps",
    "ffn_gate_shexp": "{moe}.{shared}.gate_proj",
    "ffn_up_shexp": "{moe}.{shared}.up_proj",
    "ffn_down_shexp": "{moe}.{shared}.down_proj",
    "ffn_gate_inp_shexp": "{moe}.shared_expert_gate",
})
# DeepSeek's latent attention split for llama.cpp's absorbed form; poot joins them into kv_b (derived weight).
SPLIT_KV_B = ("attn_k_b", "attn_v_b")
# The older per-expert tensors, blk.N.ffn_gate.E.weight: which of the three projections each is.
PER_EXPERT = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}


class MoeDecoder(Family):
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        model_type = str(hf.get("model_type") or self.model_type)
        if model_type not in MODEL_TYPES:
            model_type = self.model_type
        p = params_from_hf(hf, model_type)
        arch = (hf.get("architectures") or [model_type])[0]
        return _model_config(p.model_type, arch, p, int(require_key(hf, "vocab_size")),
                             int(hf.get("max_position_embeddings", 2048)),
                             hf.get("eos_token_id"), hf.get("bos_token_id"), "hf", hf)

    def config_from_gguf(self, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
        arch = str(metadata.get("general.architecture", ""))
        # llama.cpp names mixtral "llama"; its expert count sets it apart
        prefix, arch = (arch, "llama:moe") if arch == "llama" and metadata.get("llama.expert_count") else (arch, arch)
        keys = GGUFKeys(metadata, path, prefix, self.name)
        hf, model_type = gguf_hf_config(keys, tensors, arch, self.name)
        p = params_from_hf(hf, model_type)
        if model_type == "mixtral":
            p.rope_style = "interleaved"  # llama.cpp's converter permuted q/k rows for its rope layout
        keys.refuse_unread()
        return _model_config(p.model_type, arch, p, hf["vocab_size"], hf["max_position_embeddings"],
                             metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.bos_token_id"),
                             "gguf", metadata)

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        p: MoeParams = config.params
        layer, part, kind = split_gguf_name(name)
        if layer is not None and layer >= p.layers:  # DeepSeek V3's next-token-prediction layers: kept, not traced
            return f"model.layers.{layer}.{part}.{kind}"
        if part in SPLIT_KV_B:
            return None
        stem, _, expert = part.rpartition(".")
        if layer is not None and stem in PER_EXPERT and expert.isdigit():
            return f"model.layers.{layer}.{p.moe_prefix}.experts.{expert}.{p.expert_names[PER_EXPERT[stem]]}.{kind}"
        shared = "shared_expert" if p.routing.shared_gate else "shared_experts"
        mapped = GGUF_NAMES.map(name, self.name, moe=p.moe_prefix, shared=shared)
        if part == "exp_probs_b" and mapped is not None:
            return mapped.rpartition(".")[0]  # the Hugging Face name has no .weight/.bias
        return mapped

    def gguf_derived_weights(self, config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
        p: MoeParams = config.params
        present = set(tensors.names())
        derived: dict[str, DerivedWeight] = {}
        for layer in range(p.layers):
            k_b, v_b = (f"blk.{layer}.{part}.weight" for part in SPLIT_KV_B)
            if k_b not in present and v_b not in present:
                continue
            if p.latent is None or k_b not in present or v_b not in present:
                raise unknown_tensor(k_b if k_b in present else v_b, self.name)
            name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            derived[name] = joined_kv_b(tensors, k_b, v_b, p.heads, p.latent)
        return derived

    def hf_derived_weights(self, config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
        return mtp_eh_halves(config, store)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_moe(config, t)


def _model_config(
    family: str, arch: str, p: MoeParams, vocab: int, positions: int, eos: Any, bos: Any, fmt: str, raw: dict[str, Any]
) -> ModelConfig:
    return ModelConfig(
        family=family,
        architecture=arch,
        vocab_size=vocab,
        max_positions=positions,
        hidden_size=p.hidden,
        eos_ids=eos_ids(eos),
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
