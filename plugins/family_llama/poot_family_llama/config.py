"""Dense decoder configuration: one dataclass for llama, mistral, qwen2, qwen3 and gemma3, read from a
Hugging Face config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poot_core import (
    CheckpointError,
    GGUFKeys,
    GGUFTensors,
    ModelConfig,
    Reason,
    Unsupported,
    require_key,
    rope_from_gguf,
    rope_from_hf_config,
)


@dataclass
class DecoderParams:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    # Per layer: rope base, rope scaling dict, sliding window (None: global attention).
    layer_theta: list[float]
    layer_scaling: list[dict[str, Any]]
    layer_window: list[int | None]
    rotary_dim: int
    tie_embeddings: bool = False
    qk_norm: bool = False
    act: str = "silu"
    embed_scale: float | None = None
    norm_offset: float = 0.0  # gemma stores w - 1 and multiplies by (1 + w)
    sandwich_norms: bool = False  # gemma3: post-attention and pre/post feed-forward norms
    attn_scale: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_style: str = "neox"
    extra: dict[str, Any] = field(default_factory=dict)


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}


def params_from_hf(hf: dict[str, Any], model_type: str) -> DecoderParams:
    layers = int(require_key(hf, "num_hidden_layers"))
    hidden = int(require_key(hf, "hidden_size"))
    heads = int(require_key(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    gemma = model_type.startswith("gemma3")
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if not types:
        if gemma:
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        elif model_type == "mistral" and window:
            types = ["sliding_attention"] * layers
        elif model_type == "qwen2" and hf.get("use_sliding_window") and window:
            start = int(hf.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        else:
            types = ["full_attention"] * layers
    if model_type == "qwen2" and not hf.get("use_sliding_window"):
        types = ["full_attention"] * layers  # qwen2 ignores its sliding_window unless use_sliding_window
    ropes = [rope_from_hf_config(hf, t) for t in types]
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act_name not in ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"activation {act_name}", f"{model_type} config")
    partial = float(hf.get("partial_rotary_factor", 1.0))
    return DecoderParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=int(require_key(hf, "intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        layer_theta=[r[0] for r in ropes], layer_scaling=[r[1] for r in ropes],
        layer_window=[int(window) if t == "sliding_attention" and window else None for t in types],
        rotary_dim=int(head_dim * partial),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qk_norm=model_type in ("qwen3",) or gemma,
        act=ACTIVATIONS[act_name],
        embed_scale=hidden**0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else head_dim**-0.5,
        attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_softcap=hf.get("final_logit_softcapping") if gemma else None,
    )


def params_from_gguf(keys: GGUFKeys, tensors: GGUFTensors, model_type: str) -> DecoderParams:
    """The parameters of a file written by llama.cpp's converter, read as llama.cpp reads them."""
    hidden = int(keys("embedding_length"))
    heads = int(keys("attention.head_count"))
    head_dim = int(keys("attention.key_length", hidden // heads))
    if int(keys("attention.value_length", head_dim)) != head_dim:
        raise Unsupported(Reason.SHAPE, f"value heads of {keys('attention.value_length')} features",
                          f"the dense decoder's value heads are as wide as its key heads ({head_dim})")
    layers = int(keys("block_count"))
    gemma = model_type.startswith("gemma3")
    theta, scaling = rope_from_gguf(keys, tensors)
    thetas, scalings = [theta] * layers, [scaling] * layers
    windows: list[int | None] = [None] * layers
    if gemma:
        window = keys("attention.sliding_window", None)
        if window:
            local = float(keys("rope.freq_base_swa", 10000.0))  # llama.cpp's default for gemma3
            for i, swa in enumerate(_gemma_sliding_layers(keys, layers)):
                if swa:  # sliding layers: their own base, never the global layers' scaling
                    windows[i], thetas[i], scalings[i] = int(window), local, {}
    eps = float(keys("attention.layer_norm_rms_epsilon", 1e-6))
    # Gemma 3 attends with 1/sqrt(head_dim), except the 27B (62 layers) with 1/sqrt(hidden / heads): the
    # file does not say (query_pre_attn_scalar is not converted), llama.cpp decides so by layer count.
    scalar = hidden // heads if gemma and layers == 62 else head_dim
    return DecoderParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=int(keys("attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate=int(keys("feed_forward_length")), norm_eps=eps,
        layer_theta=thetas, layer_scaling=scalings, layer_window=windows,
        rotary_dim=int(keys("rope.dimension_count", head_dim)),
        tie_embeddings="output.weight" not in tensors.names(),
        qk_norm=model_type == "qwen3" or gemma,
        act="gelu_tanh" if gemma else "silu",
        embed_scale=hidden**0.5 if gemma else None,
        norm_offset=0.0,  # llama.cpp's converter stores gemma's norms as (1 + w) already
        sandwich_norms=gemma,
        attn_scale=scalar**-0.5,
        final_softcap=keys("final_logit_softcapping", None) if gemma else None,
        # llama.cpp's converter permuted llama's q/k rows for its interleaved rope (mistral files are "llama")
        rope_style="interleaved" if model_type == "llama" else "neox",
    )


def _gemma_sliding_layers(keys: GGUFKeys, layers: int) -> list[bool]:
    """llama.cpp's gemma3 pattern: `attention.sliding_window_pattern` as one flag per layer, or n (n - 1
    sliding layers then a global one; 0: all sliding); absent, n = 6 (every released Gemma 3)."""
    pattern = keys.raw("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(keys.path, f"{keys.key('attention.sliding_window_pattern')} has "
                                             f"{len(pattern)} entries for {layers} layers")
        return [bool(v) for v in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def model_config(family: str, arch: str, p: DecoderParams, vocab: int, positions: int,
                 eos: tuple[int, ...], bos: int | None, fmt: str, raw: dict[str, Any]) -> ModelConfig:
    return ModelConfig(family=family, architecture=arch, vocab_size=vocab, max_positions=positions,
                       hidden_size=p.hidden, eos_ids=eos, bos_id=bos, params=p, source_format=fmt, raw=raw)
