"""llama.cpp's pair of files for Qwen2.5-VL: the text GGUF (general.architecture "qwen2vl": Qwen2 with M-RoPE,
rope.dimension_sections) and the mmproj GGUF its converter writes with `--mmproj` (clip.projector_type
"qwen2.5vl_merger"). The text file is read as llama.cpp reads it; the mmproj's tensors join the text model's
weights under the names the vision step reads: the two halves in time of the patch convolution (v.patch_embd.weight
and .weight.1) stacked back into one 3D kernel, q/k/v joined into the qkv projection, v.post_ln as the merger's
norm, mm.0 / mm.2 as its MLP. The file gives no window size, merge size or vision rope base: llama.cpp's values
for qwen2.5vl (112, 2, 10000), as transformers' defaults; full-attention layers every n_wa_pattern layers; the
image tokens are the vocabulary's <|image_pad|>, <|vision_start|>, <|vision_end|>."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from poot_core import (
    CheckpointError,
    DecoderParams,
    GGUFKeys,
    GGUFTensors,
    ModelConfig,
    ModelHandle,
    Reason,
    Unsupported,
    WeightStore,
    eos_ids,
    rope_from_gguf,
)
from poot_family_vision.config import VisionLanguageParams
from poot_family_vision.qwen25vl import QwenVisionParams
from poot_family_vision.qwen25vl_input import QwenImageSettings

PROJECTOR_TYPE = "qwen2.5vl_merger"
TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
LLAMA_CPP_WINDOW, LLAMA_CPP_MERGE = 112, 2
VISION = "visual."
FIXED = {"v.post_ln.weight": "merger.ln_q.weight", "mm.0.weight": "merger.mlp.0.weight",
         "mm.0.bias": "merger.mlp.0.bias", "mm.2.weight": "merger.mlp.2.weight", "mm.2.bias": "merger.mlp.2.bias"}
BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def text_config(family: str, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
    """The text GGUF alone: a Qwen2 decoder (M-RoPE's sections kept in params.extra; for text alone it is the
    plain rope)."""
    arch = str(metadata.get("general.architecture", "qwen2vl"))
    keys = GGUFKeys(metadata, path, arch, family)
    hidden, heads = int(keys("embedding_length")), int(keys("attention.head_count"))
    layers, head_dim = int(keys("block_count")), hidden // heads
    theta, scaling = rope_from_gguf(keys, tensors)
    sections = tuple(int(s) for s in keys.raw("rope.dimension_sections") if int(s))
    if len(sections) != 3 or 2 * sum(sections) != head_dim:
        raise Unsupported(Reason.SHAPE, f"rope.dimension_sections {sections}", f"three of head_dim/2 = {head_dim // 2}")
    p = DecoderParams(layers=layers, hidden=hidden, heads=heads, kv_heads=int(keys("attention.head_count_kv", heads)),
                      head_dim=head_dim, intermediate=int(keys("feed_forward_length")),
                      norm_eps=float(keys("attention.layer_norm_rms_epsilon", 1e-6)), layer_theta=[theta] * layers,
                      layer_scaling=[scaling] * layers, layer_window=[None] * layers, rotary_dim=head_dim,
                      tie_embeddings="output.weight" not in tensors.names(), attn_scale=head_dim**-0.5,
                      extra={"mrope_sections": sections})
    vocab = int(keys("vocab_size", 0) or len(metadata.get("tokenizer.ggml.tokens", [])))
    positions = int(keys("context_length", 2048))
    keys.refuse_unread()
    return ModelConfig(family=family, architecture=arch, vocab_size=vocab, max_positions=positions,
                       hidden_size=hidden, eos_ids=eos_ids(metadata.get("tokenizer.ggml.eos_token_id")),
                       bos_id=metadata.get("tokenizer.ggml.bos_token_id"), params=p, source_format="gguf",
                       raw=metadata)


def _name(name: str) -> str | None:
    """The vision step's name of an mmproj tensor; None for those joined separately (patch halves, q/k/v)."""
    if name in FIXED:
        return VISION + FIXED[name]
    if name.startswith("v.patch_embd."):
        return None
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in ("attn_q", "attn_k", "attn_v"):
        return None
    if m and m.group(2) in BLOCK:
        return f"{VISION}blocks.{m.group(1)}.{BLOCK[m.group(2)]}.{m.group(3)}"
    raise Unsupported(Reason.OPERATION, f"mmproj tensor {name}", "not part of Qwen2.5-VL's vision tower")


def open_pair(handle: ModelHandle, reader: Any, tensor: Any, value: Any) -> tuple[ModelConfig, WeightStore, Any]:
    """The config, weights and image input of the text GGUF `handle` with the Qwen2.5-VL mmproj `reader` open
    (`tensor` reads one of its tensors as torch, `value` one of its keys: mmproj.py's)."""
    from poot_family_vision.kinds import QwenImages

    text = handle.config()
    if not isinstance(text.params, DecoderParams) or "mrope_sections" not in text.params.extra:
        raise Unsupported(Reason.REGISTRY, f"a Qwen2.5-VL mmproj with a {text.architecture} text model",
                          "the text GGUF must be Qwen2.5-VL's (qwen2vl)")
    tok = handle.text().tokenizer
    ids = [tok.token_to_id(t) for t in TOKENS]
    if None in ids:
        raise CheckpointError(handle.path, f"the vocabulary lacks Qwen2.5-VL's image tokens {TOKENS}")
    def number(key: str) -> int:
        return int(value(reader, "clip.vision." + key))

    layers, pattern = number("block_count"), number("n_wa_pattern")
    vision = QwenVisionParams(
        layers=layers, hidden=number("embedding_length"), heads=number("attention.head_count"),
        intermediate=number("feed_forward_length"), act="silu" if value(reader, "clip.use_silu", False) else "gelu",
        patch=number("patch_size"),
        temporal=2, merge=LLAMA_CPP_MERGE, window=LLAMA_CPP_WINDOW,
        full_layers=tuple(i for i in range(layers) if (i + 1) % pattern == 0),
        out_hidden=number("projection_dim"),
        norm_eps=float(value(reader, "clip.vision.attention.layer_norm_epsilon", 1e-6)))
    params = VisionLanguageParams(text=text.params, vision=vision, image_token_id=ids[0],  # type: ignore[arg-type]
                                  kind="qwen2_5_vl", text_prefixes=("model.",), boi_token_id=ids[1],
                                  eoi_token_id=ids[2], mrope_sections=text.params.extra["mrope_sections"])
    text_weights = handle.store()  # the handle's own store stays the text model's: the pair's is a new one
    store = WeightStore({n: (lambda n=n: text_weights.get(n)) for n in text_weights.names()}, text_weights.shapes())
    by_name = {t.name: t for t in reader.tensors}

    def shape(t: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape))

    for t in reader.tensors:
        name = _name(t.name)
        if name is not None:
            store.add(name, lambda t=t: tensor(t).reshape(shape(t)), shape(t))
    halves = [by_name.get("v.patch_embd.weight"), by_name.get("v.patch_embd.weight.1")]
    if None in halves:
        raise CheckpointError(Path(reader.poot_path), "the mmproj lacks v.patch_embd.weight or .weight.1")
    d, c, kh, kw = shape(halves[0])
    store.add(VISION + "patch_embed.proj.weight",
              lambda: torch.stack([tensor(h).reshape(d, c, kh, kw) for h in halves], dim=2), (d, c, 2, kh, kw))
    for i in range(layers):
        for kind in ("weight", "bias"):
            parts = [by_name[f"v.blk.{i}.attn_{x}.{kind}"] for x in "qkv"]
            rows = sum(shape(p)[0] for p in parts)
            store.add(f"{VISION}blocks.{i}.attn.qkv.{kind}",
                      lambda parts=parts: torch.cat([tensor(p).reshape(shape(p)) for p in parts]),
                      (rows, *shape(parts[0])[1:]))
    settings = QwenImageSettings(mean=tuple(value(reader, "clip.vision.image_mean", QwenImageSettings.mean)),
                                 std=tuple(value(reader, "clip.vision.image_std", QwenImageSettings.std)),
                                 patch=vision.patch, merge=vision.merge)
    return replace(text, params=params), store, QwenImages(handle, params, settings)


__all__ = ["PROJECTOR_TYPE", "open_pair", "text_config"]
