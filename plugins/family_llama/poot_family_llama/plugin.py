"""poot-family-llama's entry point: the dense decoder families it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poot_core import (
    DecoderParams,
    Family,
    GGUFKeys,
    GGUFNames,
    GGUFTensors,
    ModelConfig,
    StepShape,
    Tracer,
    decoder_params_from_hf,
    eos_ids,
    hookimpl,
    require_key,
    trace_dense_decoder,
)
from poot_family_llama.config import model_config, params_from_gguf

# llama.cpp's names beyond the shared ones: gemma3's sandwich norms (its ffn_norm is the pre-feed-forward one).
GGUF_NAMES = GGUFNames().extended({"post_attention_norm": "post_attention_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"})
GEMMA3_GGUF_NAMES = GGUF_NAMES.extended({"ffn_norm": "pre_feedforward_layernorm"})


class DenseDecoder(Family):
    """One dense decoder family; instances differ by name, the names they serve and small quirks."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        p = decoder_params_from_hf(hf, self.model_type)
        arch = (hf.get("architectures") or [hf.get("model_type", self.name)])[0]
        return model_config(self.name, arch, p, int(require_key(hf, "vocab_size")),
                            int(hf.get("max_position_embeddings", 2048)), eos_ids(hf.get("eos_token_id")),
                            hf.get("bos_token_id"), "hf", hf)

    def config_from_gguf(self, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
        arch = str(metadata.get("general.architecture", self.model_type))
        keys = GGUFKeys(metadata, path, arch, self.name)
        p = params_from_gguf(keys, tensors, self.model_type)
        vocab = int(keys("vocab_size", 0) or len(metadata.get("tokenizer.ggml.tokens", [])))
        positions = int(keys("context_length", 2048))
        keys.refuse_unread()
        return model_config(self.name, arch, p, vocab, positions,
                            eos_ids(metadata.get("tokenizer.ggml.eos_token_id")),
                            metadata.get("tokenizer.ggml.bos_token_id"), "gguf", metadata)

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        names = GEMMA3_GGUF_NAMES if self.model_type.startswith("gemma3") else GGUF_NAMES
        return names.map(name, self.name)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_dense_decoder(config, t)


FAMILIES = [
    DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama")),
    DenseDecoder("mistral", "mistral", ("MistralForCausalLM", "mistral")),
    DenseDecoder("qwen2", "qwen2", ("Qwen2ForCausalLM", "qwen2")),
    DenseDecoder("qwen3", "qwen3", ("Qwen3ForCausalLM", "qwen3")),
    DenseDecoder("gemma3", "gemma3_text", ("Gemma3ForCausalLM", "gemma3_text", "gemma3")),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["DecoderParams", "DenseDecoder", "FAMILIES"]
