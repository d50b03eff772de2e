"""The dense decoder's parameters (poot_core.DecoderParams) from GGUF metadata, as llama.cpp reads them; from a
Hugging Face config.json they come from poot_core.decoder_params_from_hf."""

from __future__ import annotations

from typing import Any

from poot_core import (
    CheckpointError,
    DecoderParams,
    GGUFKeys,
    GGUFTensors,
    ModelConfig,
    Reason,
    Unsupported,
    rope_from_gguf,
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
