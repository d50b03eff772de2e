"""A tiny random llama written as GGUF in one quantization type, with a Hugging Face copy of the dequantized values."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers as tf
from gguf import GGMLQuantizationType, quants

from helpers import tiny
from helpers.gguf_blocks import QUANTIZABLE, random_blocks
from helpers.gguf_edit import finish_gguf
from helpers.moe import gguf_tokenizer

PROMPT = [(11 * i + 5) % 250 + 2 for i in range(24)]
HEADS, KV_HEADS = 4, 2
MATRICES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _config(layers: int, width: int) -> tf.LlamaConfig:
    # rows of 256 values by default: the K-quants and IQ4_XS pack 256 weights per block
    return tf.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                          tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)


def _from_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its interleaved rope layout back to Hugging Face's)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def build(tmp: Path, type_name: str, *, layers: int = 2, width: int = 256) -> tuple[Path, Path]:
    """The GGUF file and its Hugging Face copy. `width` (hidden size; the MLP is twice as wide) must be a multiple
    of the type's block: 256 for the K-quants and IQ4_XS, 32 for the others."""
    config = _config(layers, width)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    tiny._randomize(model, 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qtype = GGMLQuantizationType[type_name]
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] = {
        "token_embd.weight": (state["model.embed_tokens.weight"].numpy(), None),
        "output_norm.weight": (state["model.norm.weight"].numpy(), None),
        "output.weight": (state["lm_head.weight"].numpy(), None),
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, g_name in NORMS.items():
            tensors[f"blk.{layer}.{g_name}.weight"] = (state[f"model.layers.{layer}.{hf_name}.weight"].numpy(), None)
        for i, (hf_name, g_name) in enumerate(MATRICES.items()):
            key = f"model.layers.{layer}.{hf_name}.weight"
            rows, cols = state[key].shape
            # The blocks are the file's rows as they stand; the float copy below is made from these very
            # blocks, so whatever order they came in, file and copy hold the same matrix.
            if type_name in QUANTIZABLE:
                blocks = quants.quantize(state[key].numpy(), qtype)
            else:
                blocks = random_blocks(type_name, rows, cols, seed=100 * layer + i)
            values = quants.dequantize(blocks, qtype).astype(np.float32)
            if hf_name.endswith(("q_proj", "k_proj")):
                values = _from_gguf_rows(values, HEADS if hf_name.endswith("q_proj") else KV_HEADS)
            state[key] = torch.from_numpy(np.ascontiguousarray(values))
            tensors[f"blk.{layer}.{g_name}.weight"] = (blocks, qtype)
    reference = tmp / "hf"
    model.load_state_dict(state)
    model.save_pretrained(reference)
    tiny.save_tokenizer(reference)
    path = tmp / f"tiny-{type_name}.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", config.num_hidden_layers)
    w.add_uint32("llama.embedding_length", config.hidden_size)
    w.add_uint32("llama.feed_forward_length", config.intermediate_size)
    w.add_uint32("llama.attention.head_count", HEADS)
    w.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    w.add_uint32("llama.context_length", config.max_position_embeddings)
    w.add_uint32("llama.vocab_size", config.vocab_size)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    w.add_float32("llama.rope.freq_base", 10000.0)
    gguf_tokenizer(w)
    for name, (array, raw) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw)
    finish_gguf(w)
    return path, reference
