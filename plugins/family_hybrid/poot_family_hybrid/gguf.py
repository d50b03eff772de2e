"""The hybrid families from GGUF files written by llama.cpp's converter: metadata read as llama.cpp reads it,
llama.cpp's tensor names mapped to the Hugging Face names the traces use."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from poot_core import (
    DerivedWeight,
    GGUFKeys,
    GGUFNames,
    GGUFTensors,
    ModelConfig,
    Reason,
    Unsupported,
    rope_from_gguf,
    unknown_tensor,
)
from poot_family_hybrid.config import Lfm2Params, Mamba2Params, MambaHybridParams

# LFM2: operator_norm is llama.cpp's attn_norm, the final norm its token_embd_norm, the convolution
# `shortconv.*` (the converter squeezes the kernel to [C, K]).
LFM2_NAMES = GGUFNames().extended(
    block={"attn_norm": "operator_norm", "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
           "attn_k_norm": "self_attn.k_layernorm", "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w1",
           "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv",
           "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"},
    top={"token_embd_norm": "model.embedding_norm"})


def lfm2_params_from_gguf(keys: GGUFKeys, tensors: GGUFTensors) -> Lfm2Params:
    """The converter writes one kv head count per layer, 0 for the convolution layers: that is the layout."""
    layers = int(keys("block_count"))
    hidden, heads = int(keys("embedding_length")), int(keys("attention.head_count"))
    kv = keys.raw("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    kinds = ["conv" if int(n) == 0 else "full_attention" for n in kv]
    kv_heads = {int(n) for n in kv if int(n)}
    if len(kv_heads) > 1:
        raise Unsupported(Reason.SHAPE, f"per-layer {keys.key('attention.head_count_kv')} = {kv}",
                          "the lfm2 family has one kv head count for its attention layers")
    keys("shortconv.l_cache")  # the kernel size, also the convolution tensors' last dimension
    keys.understood("feed_forward_length")  # the MLP's weights say it
    theta, scaling = rope_from_gguf(keys, tensors)
    return Lfm2Params(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads.pop() if kv_heads else heads,
                      head_dim=int(keys("attention.key_length", hidden // heads)),
                      norm_eps=float(keys("attention.layer_norm_rms_epsilon", 1e-5)), layer_types=kinds,
                      theta=theta, scaling=scaling)


def vocab_and_positions(metadata: dict[str, Any], keys: GGUFKeys) -> tuple[int, int]:
    """The vocabulary size (from the tokenizer when the key is absent) and the positions of a file."""
    vocab = int(keys("vocab_size", 0) or len(metadata.get("tokenizer.ggml.tokens", [])))
    return vocab, int(keys("context_length", 1 << 20))


# Mamba2: the mixer's vectors have no ".weight" in either naming; dt_bias is llama.cpp's ssm_dt.bias; ssm_a
# holds A = -exp(A_log) itself, from which A_log is derived (mamba2_derived_weights).
MAMBA2_BLOCK = {"attn_norm.weight": "norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
                "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
                "ssm_dt.bias": "mixer.dt_bias", "ssm_d": "mixer.D", "ssm_norm.weight": "mixer.norm.weight",
                "ssm_out.weight": "mixer.out_proj.weight", "ssm_a": None}
MAMBA2_TOP = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
              "output.weight": "lm_head.weight"}
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)$")


def table_name(name: str, top: dict[str, str | None], block: dict[str, str | None], family: str,
               layers: str) -> str | None:
    """A llama.cpp tensor's traced name from whole-name tables: blk.N.<part> by `block`, as <layers>.N.<mapped>,
    the others by `top`; None where the table holds None (a tensor poot does not read), a typed refusal where it
    holds nothing."""
    match = BLOCK_NAME.match(name)
    table, part = (block, match.group(2)) if match else (top, name)
    if part not in table:
        raise unknown_tensor(name, family)
    mapped = table[part]
    return None if mapped is None else (f"{layers}.{match.group(1)}.{mapped}" if match else mapped)


def mamba2_tensor_name(name: str) -> str | None:
    return table_name(name, MAMBA2_TOP, MAMBA2_BLOCK, "mamba2", "backbone.layers")


def mamba2_derived_weights(config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
    p: Mamba2Params = config.params
    return a_log_weights(tensors, range(p.layers), "backbone.layers.{}.mixer.A_log", p.heads)


def a_log_weights(tensors: GGUFTensors, layers: Iterable[int], name: str, heads: int) -> dict[str, DerivedWeight]:
    """A_log of each Mamba2 layer from llama.cpp's ssm_a (A = -exp(A_log) itself)."""

    def a_log(layer: int) -> torch.Tensor:
        return torch.log(-tensors.read(f"blk.{layer}.ssm_a").reshape(-1))

    return {name.format(i): ((lambda i=i: a_log(i)), (heads,)) for i in layers}


def mamba2_params_from_gguf(keys: GGUFKeys, tensors: GGUFTensors) -> Mamba2Params:
    keys.understood("feed_forward_length", "attention.head_count")  # written as 0, unused
    return _mamba2_from_keys(keys)


def _mamba2_from_keys(keys: GGUFKeys) -> Mamba2Params:
    """llama.cpp's keys: ssm.inner_size, ssm.state_size, ssm.group_count, ssm.conv_kernel and ssm.time_step_rank
    (the head count). The scan chunk is not stored (it changes the summation order only)."""
    inner, heads = int(keys("ssm.inner_size")), int(keys("ssm.time_step_rank"))
    return Mamba2Params(layers=int(keys("block_count")), hidden=int(keys("embedding_length")), heads=heads,
                        head_dim=inner // heads, state=int(keys("ssm.state_size")),
                        groups=int(keys("ssm.group_count", 1)), inner=inner, conv_kernel=int(keys("ssm.conv_kernel")),
                        chunk=256, norm_eps=float(keys("attention.layer_norm_rms_epsilon", 1e-5)),
                        dt_limit=(0.0, float("inf")))


# Granite 4.0-H (llama.cpp's granitehybrid): the Mamba2 mixer's tensors as in mamba2 (under "mamba."), the
# shared MLP apart (ffn_* in the dense model, ffn_*_shexp beside the routed experts), stacked experts.
GRANITE_NAMES = GGUFNames().extended(block={
    "ffn_gate": "shared_mlp.gate_proj", "ffn_up": "shared_mlp.up_proj", "ffn_down": "shared_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj", "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.experts.gate_exps", "ffn_up_exps": "block_sparse_moe.experts.up_exps",
    "ffn_down_exps": "block_sparse_moe.experts.down_exps"})


def granite_tensor_name(name: str) -> str | None:
    match = BLOCK_NAME.match(name)
    part = match.group(2) if match else ""
    if match and part in MAMBA2_BLOCK and part != "attn_norm.weight":  # attn_norm: the layer's input norm
        mapped = MAMBA2_BLOCK[part]
        return None if mapped is None else f"model.layers.{match.group(1)}.mamba.{mapped.removeprefix('mixer.')}"
    return GRANITE_NAMES.map(name, "granitemoehybrid")


def granite_derived_weights(config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
    p: MambaHybridParams = config.params
    mamba = [i for i, kind in enumerate(p.layer_types) if kind == "mamba"]
    return a_log_weights(tensors, mamba, "model.layers.{}.mamba.A_log", p.mamba.heads)


def granite_params_from_gguf(keys: GGUFKeys, tensors: GGUFTensors) -> MambaHybridParams:
    """The layout from the per-layer kv head counts (0: a Mamba2 layer), Granite's four multipliers, the
    experts. llama.cpp ropes a granitehybrid model only when rope.scaling.finetuned says so (Bamba, whose
    rope the converter writes as the whole head where transformers ropes half): refused."""
    mamba = _mamba2_from_keys(keys)
    hidden, heads = mamba.hidden, int(keys("attention.head_count"))
    kv = keys.raw("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * mamba.layers
    kinds = ["mamba" if int(n) == 0 else "attention" for n in kv]
    kv_heads = {int(n) for n in kv if int(n)}
    if len(kv_heads) > 1:
        raise Unsupported(Reason.SHAPE, f"per-layer {keys.key('attention.head_count_kv')} = {kv}",
                          "the granitemoehybrid family has one kv head count for its attention layers")
    if keys("rope.scaling.finetuned", False):
        raise Unsupported(Reason.OPERATION, f"{keys.key('rope.scaling.finetuned')} = True (rope in granitehybrid)",
                          "poot reads Granite 4.0-H files, which use no rope")
    keys.understood("rope.dimension_count", "rope.freq_base")  # no rope (above)
    head_dim = int(keys("attention.key_length", hidden // heads))
    experts = int(keys("expert_count", 0))
    # The shared MLP's weights say its width; feed_forward_length is an expert's width, and
    # expert_used_count: with no experts (the dense model, expert_count 0) only the config's default
    keys.understood("expert_shared_feed_forward_length",
                    *(() if experts else ("feed_forward_length", "expert_used_count")))

    def scale(name: str) -> float | None:
        value = keys(name, None)
        return None if value is None or float(value) == 1.0 else float(value)

    attn = keys("attention.scale", None)
    return MambaHybridParams(
        mamba=mamba, layer_types=kinds, heads=heads, kv_heads=kv_heads.pop() if kv_heads else heads,
        head_dim=head_dim, rotary_dim=0, theta=10000.0, scaling={},
        attn_scale=head_dim**-0.5 if attn is None else float(attn), norm_eps=mamba.norm_eps, ffn="shared_mlp",
        mlp_norm="post_attention_layernorm", final_norm="model.norm", embed_scale=scale("embedding_scale"),
        residual_scale=scale("residual_scale"), logits_scale=scale("logit_scale"), experts=experts,
        top_k=int(keys("expert_used_count")) if experts else 0,
        expert_intermediate=int(keys("feed_forward_length")) if experts else 0)
