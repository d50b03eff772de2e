"""Tiny random hybrid checkpoints (Hugging Face): LFM2, Mamba2, Granite 4.0-H (dense and with routed experts),
Bamba and Qwen3-Next."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from helpers import tiny

TOKENIZER_SIZE = 320  # with merges beyond the 256 bytes and 4 specials, as the converter's gpt2 vocabulary needs


def hybrid_config(arch: str) -> Any:
    # the tokenizer's ids (llama.cpp's converter checks them), a multiple of 16 (its Mamba2 pads to one)
    common: dict[str, Any] = dict(vocab_size=TOKENIZER_SIZE, hidden_size=64, bos_token_id=0, eos_token_id=1,
                                  pad_token_id=0)
    if arch == "lfm2":
        return tf.Lfm2Config(**common, intermediate_size=128, block_auto_adjust_ff_dim=False, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                             tie_word_embeddings=True)
    if arch == "mamba2":  # 8 heads in 2 groups; a bias on the convolution (LFM2's has none)
        return tf.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16,
                               n_groups=2, conv_kernel=4, chunk_size=8, use_conv_bias=True,
                               tie_word_embeddings=False)
    mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=8, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, tie_word_embeddings=False)
    if arch == "granitemoehybrid":  # the dense Granite 4.0-H: multipliers, no rope, gate and up joined
        return tf.GraniteMoeHybridConfig(**common, **mamba, intermediate_size=64, shared_intermediate_size=96,
                                         num_local_experts=0, mamba_n_groups=1, position_embedding_type=None,
                                         layer_types=["linear_attention", "full_attention", "linear_attention",
                                                      "linear_attention"],
                                         embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.2, logits_scaling=8.0)
    if arch == "granite_moe":  # Granite 4.0-H with routed experts: 2 of 4 per token beside the shared MLP
        return tf.GraniteMoeHybridConfig(**common, **mamba, intermediate_size=32, shared_intermediate_size=48,
                                         num_local_experts=4, num_experts_per_tok=2, mamba_n_groups=2,
                                         position_embedding_type=None,
                                         layer_types=["linear_attention", "full_attention", "linear_attention",
                                                      "full_attention"],
                                         embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.2, logits_scaling=8.0)
    if arch == "granite_rope":  # the options Granite 4.0-H leaves off: rope on the whole head, biases, 1 expert
        return tf.GraniteMoeHybridConfig(**{**common, **mamba, "tie_word_embeddings": True}, intermediate_size=32,
                                         shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=1,
                                         mamba_n_groups=2, position_embedding_type="rope", attention_bias=True,
                                         mamba_proj_bias=True, mamba_conv_bias=False,
                                         layer_types=["full_attention", "linear_attention", "full_attention",
                                                      "linear_attention"],
                                         embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.2, logits_scaling=8.0)
    if arch == "bamba":  # rope on half of each head
        return tf.BambaConfig(**common, **mamba, intermediate_size=128, mamba_n_groups=2, attn_layer_indices=[1])
    qwen3next = dict(intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                     max_position_embeddings=512, layer_types=["linear_attention", "full_attention",
                                                               "linear_attention", "full_attention"])
    if arch == "qwen3next":  # 2 key heads for 4 value heads; every layer's MLP sparse (2 of 4 + the shared expert)
        return tf.Qwen3NextConfig(**common, **qwen3next, linear_num_key_heads=2, linear_num_value_heads=4,
                                  num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen3next_mix":  # what llama.cpp's converter leaves out: a dense MLP (layer 2), no renormalized
        # top-k weights, tied embeddings; as many value heads as key heads
        return tf.Qwen3NextConfig(**{**common, **qwen3next}, linear_num_key_heads=2, linear_num_value_heads=2,
                                  num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
                                  tie_word_embeddings=True)
    raise ValueError(arch)


def with_mtp_block(path: Path, copy: Path, seed: int = 1) -> Path:
    """A copy of a Qwen3-Next checkpoint with the multi-token-prediction block the hub's checkpoints carry under
    `mtp.*` (transformers skips it; llama.cpp's converter writes it as one more block): a decoder layer (here
    the last layer's weights), the fc joining embedding and hidden state, and its norms."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, copy)
    weights = load_file(copy / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    last = max(int(name.split(".")[2]) for name in weights if name.startswith("model.layers."))
    g = torch.Generator().manual_seed(seed)
    extra = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.05}
    extra |= {f"mtp.{n}.weight": torch.zeros(hidden) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    prefix = f"model.layers.{last}."
    extra |= {"mtp.layers.0." + n.removeprefix(prefix): w.clone() for n, w in weights.items() if n.startswith(prefix)}
    dtype = weights["model.norm.weight"].dtype
    save_file({**weights, **{n: w.to(dtype) for n, w in extra.items()}}, copy / "model.safetensors",
              metadata={"format": "pt"})
    return copy


def dequantized_copy(source: Path, target: Path) -> Path:
    """The GGUF file `source` with every tensor dequantized to float32 by the gguf package, metadata as it is."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from helpers.gguf_edit import finish_gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer's own
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape(tuple(reversed(tensor.shape.tolist()))))
    finish_gguf(writer)
    return target


def build(path: Path, arch: str, dtype: torch.dtype, seed: int = 0, layers: int | None = None) -> Path:
    """`layers`: fewer decoder layers than the config's; the first 2 of lfm2, granitemoehybrid and qwen3next hold
    one recurrent and one attention layer."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny.with_layers(hybrid_config(arch), layers))
    tiny._randomize(model, seed)
    model.to(dtype).save_pretrained(path)
    tiny.save_tokenizer(path, TOKENIZER_SIZE)
    return path


def assert_vulkan_refuses_and_triton_prepares(graph: Any, handle: Any) -> list[str]:
    """The recurrent ops `graph` uses (poot_core.graph.passes.HYBRID_OPS): absent from the Vulkan backend's
    vocabulary (refused by name at prepare), and bound by the Triton executor, whose prepare takes the graph over
    `handle`'s uploaded weights (on the CPU: nothing runs). Both backends are installed by make test's set-up:
    missing, this fails."""
    from poot_backend_vulkan.program import VULKAN_OPS
    from poot_core.graph import passes
    from poot_kernels_triton.executor import TRITON_OPS, TritonExecutor

    used = sorted(graph.ops() & passes.HYBRID_OPS)
    assert used
    assert not set(used) & VULKAN_OPS
    assert set(used) <= TRITON_OPS
    ex = TritonExecutor.on_interpreter()
    program = ex.prepare(graph, ex.upload(handle.store()))
    assert len(program.steps) > 0
    return used

