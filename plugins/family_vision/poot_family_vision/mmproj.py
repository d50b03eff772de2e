"""llama.cpp's pair of files for Gemma 3: the text GGUF (the llama family's gemma3, read by poot as any GGUF)
and the mmproj GGUF its converter writes with `--mmproj` (general.architecture "clip", clip.projector_type
"gemma3"): the SigLIP tower, the soft-embedding norm (stored as 1 + w, as the converter writes it) and the
projection. The tower's tensors join the text model's weights under the names the vision step reads; the
tower's parameters, the image mean and std, and the pooling (clip.vision.projector.scale_factor, llama.cpp's
default 4 when absent) come from the file's metadata; the image tokens are the text vocabulary's
`<start_of_image>`, `<image_soft_token>` and `<end_of_image>`, as Gemma 3's tokenizer spells them.
An mmproj file of Qwen2.5-VL (clip.projector_type qwen2.5vl_merger) is read by poot_family_vision.qwen25vl_gguf."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from poot_core import CheckpointError, DecoderParams, ModelConfig, ModelHandle, Reason, Unsupported, WeightStore
from poot_family_vision import qwen25vl_gguf
from poot_family_vision.config import VisionLanguageParams, VisionParams
from poot_family_vision.gemma3 import PROJECTION
from poot_family_vision.kinds import Gemma3Images
from poot_family_vision.preprocess import SquareSettings

VISION, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."
FIXED = {"v.patch_embd.weight": "embeddings.patch_embedding.weight",
         "v.patch_embd.bias": "embeddings.patch_embedding.bias",
         "v.position_embd.weight": "embeddings.position_embedding.weight",
         "v.post_ln.weight": "post_layernorm.weight", "v.post_ln.bias": "post_layernorm.bias"}
BLOCK = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
LLAMA_CPP_SCALE = 4  # clip.cpp's proj_scale_factor for gemma3 when the file gives none


def _name(name: str) -> str | None:
    """The vision step's name of an mmproj tensor (None for the projection, derived separately)."""
    if name in FIXED:
        return VISION + FIXED[name]
    if name == "mm.soft_emb_norm.weight":
        return PROJECTOR + "mm_soft_emb_norm.weight"
    if name == "mm.input_projection.weight":
        return None
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in BLOCK:
        return f"{VISION}encoder.layers.{m.group(1)}.{BLOCK[m.group(2)]}.{m.group(3)}"
    raise Unsupported(Reason.OPERATION, f"mmproj tensor {name}", "not part of Gemma 3's vision tower")


def _tensor(t: Any) -> torch.Tensor:
    if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             gguf.GGMLQuantizationType.BF16):
        raise Unsupported(Reason.QUANTIZATION, f"mmproj tensor {t.name} as {t.tensor_type.name}",
                          "the vision tower is read as F32, F16 or BF16")
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def _value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise CheckpointError(reader.poot_path, f"missing key {key!r}")
        return default
    return field.contents()


def open_pair(handle: ModelHandle, mmproj: str | Path,
              pan_and_scan: bool = False) -> tuple[ModelConfig, WeightStore, Any]:
    """The config, weights and image input of the text GGUF `handle` with the mmproj file beside it."""
    path = Path(mmproj)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"not a readable GGUF file: {exc}") from exc
    reader.poot_path = path  # named in errors
    projector = _value(reader, "clip.projector_type", "")
    if _value(reader, "general.architecture", "") == "clip" and projector == qwen25vl_gguf.PROJECTOR_TYPE:
        return qwen25vl_gguf.open_pair(handle, reader, _tensor, _value)
    if _value(reader, "general.architecture", "") != "clip" or projector != "gemma3":
        raise Unsupported(Reason.REGISTRY, f"mmproj {path.name}",
                          "only Gemma 3's and Qwen2.5-VL's (clip.projector_type gemma3, "
                          f"{qwen25vl_gguf.PROJECTOR_TYPE})")
    text = handle.config()
    if not isinstance(text.params, DecoderParams) or not text.architecture.startswith("gemma3"):
        raise Unsupported(Reason.REGISTRY, f"a Gemma 3 mmproj with a {text.architecture} text model",
                          "the text GGUF must be Gemma 3's")
    tok = handle.text().tokenizer
    ids = [tok.token_to_id(t) for t in TOKENS]
    if None in ids:
        raise CheckpointError(handle.path, f"the vocabulary lacks Gemma 3's image tokens {TOKENS}")
    hidden = int(_value(reader, "clip.vision.embedding_length"))
    heads = int(_value(reader, "clip.vision.attention.head_count"))
    vision = VisionParams(
        layers=int(_value(reader, "clip.vision.block_count")), hidden=hidden, heads=heads, head_dim=hidden // heads,
        intermediate=int(_value(reader, "clip.vision.feed_forward_length")),
        norm_eps=float(_value(reader, "clip.vision.attention.layer_norm_epsilon", 1e-6)), act="gelu_tanh",
        image_size=int(_value(reader, "clip.vision.image_size")), patch=int(_value(reader, "clip.vision.patch_size")),
        scale_factor=int(_value(reader, "clip.vision.projector.scale_factor", LLAMA_CPP_SCALE)))
    params = VisionLanguageParams(text=text.params, vision=vision, image_token_id=ids[1], kind="gemma3",
                                  text_prefixes=("model.",), boi_token_id=ids[0], eoi_token_id=ids[2],
                                  soft_norm_offset=0.0)
    text_weights = handle.store()  # the handle's own store stays the text model's: the pair's is a new one
    store = WeightStore({n: (lambda n=n: text_weights.get(n)) for n in text_weights.names()}, text_weights.shapes())
    for t in reader.tensors:
        name = _name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        if name is None:  # [Dv, Dt] as transformers stores it: read transposed, as for a Hugging Face checkpoint
            store.add(PROJECTION, lambda t=t: _tensor(t).t().contiguous(), (shape[1], shape[0]))
        else:
            store.add(name, lambda t=t, shape=shape: _tensor(t).reshape(shape), shape)
    settings = SquareSettings(height=vision.image_size, width=vision.image_size,
                              mean=tuple(_value(reader, "clip.vision.image_mean", (0.5,) * 3)),
                              std=tuple(_value(reader, "clip.vision.image_std", (0.5,) * 3)))
    return replace(text, params=params), store, Gemma3Images(handle, params, settings, pan_and_scan)
