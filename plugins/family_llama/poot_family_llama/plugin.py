"""poot-family-llama's entry point: the dense decoder families it serves."""

from __future__ import annotations

import re
from typing import Any

from poot_core import CheckpointError, Family, ModelConfig, StepShape, Tracer, hookimpl
from poot_family_llama.config import DecoderParams, eos_list, model_config, params_from_hf
from poot_family_llama.model import trace_decoder

# llama.cpp tensor names -> Hugging Face names (per block "blk.N." -> "model.layers.N.").
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class DenseDecoder(Family):
    """One dense decoder family; instances differ by name, the names they serve and small quirks."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        p = params_from_hf(hf, self.model_type)
        arch = (hf.get("architectures") or [hf.get("model_type", self.name)])[0]
        return model_config(self.name, arch, p, int(hf["vocab_size"]),
                            int(hf.get("max_position_embeddings", 2048)), eos_list(hf.get("eos_token_id")),
                            hf.get("bos_token_id"), "hf", hf)

    def config_from_gguf(self, meta: dict[str, Any]) -> ModelConfig:
        arch = meta.get("general.architecture", self.model_type)

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise CheckpointError(meta.get("__path__", "gguf"), f"missing metadata {arch}.{name}")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv = key("attention.head_count_kv", heads)
        kv_heads = int(kv[0] if isinstance(kv, list) else kv)
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        layers = int(key("block_count"))
        hf: dict[str, Any] = {
            "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": int(key("feed_forward_length")),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(key("context_length", 2048)),
            "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
            "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))),
        }
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            hf["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        if self.model_type.startswith("gemma3"):
            hf["rope_local_base_freq"] = 10000.0
            hf["query_pre_attn_scalar"] = head_dim
            hf["hidden_activation"] = "gelu_pytorch_tanh"
        p = params_from_hf(hf, self.model_type)
        p.rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", p.rotary_dim))
        if self.model_type == "llama":
            p.rope_style = "interleaved"  # llama.cpp's converter permuted q/k rows for its rope layout
        if self.model_type.startswith("gemma3"):
            p.norm_offset = 0.0  # llama.cpp's converter stored (1 + w)
        p.tie_embeddings = True
        return model_config(self.name, arch, p, hf["vocab_size"], hf["max_position_embeddings"],
                            eos_list(meta.get("tokenizer.ggml.eos_token_id")),
                            meta.get("tokenizer.ggml.bos_token_id"), "gguf", meta)

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        match = BLOCK.match(name)
        if match:
            layer, part, kind = match.groups()
            mapped = GGUF_BLOCK_NAMES.get(part)
            if mapped is None:
                return None
            if part == "ffn_norm" and self.model_type.startswith("gemma3"):
                mapped = "pre_feedforward_layernorm"
            return f"model.layers.{layer}.{mapped}.{kind}"
        stem, _, kind = name.rpartition(".")
        top = GGUF_TOP_NAMES.get(stem)
        return f"{top}.{kind}" if top else None

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_decoder(config, t, shape)


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
