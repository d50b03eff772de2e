"""Vision-language configuration: the SigLIP tower's and the connector's parameters beside the text model's,
read from a Hugging Face config.json (text_config and vision_config nested). Idefics3 / SmolVLM here (a llama
text model); Gemma 3 in poot_family_vision.gemma3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poot_core import (
    HF_ACTIVATIONS,
    DecoderParams,
    ModelConfig,
    Reason,
    Unsupported,
    decoder_params_from_hf,
    eos_ids,
    require_key,
)


@dataclass
class VisionParams:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    act: str
    image_size: int
    patch: int
    # scale_factor**2 neighbouring patches become one token: Idefics3's pixel shuffle, Gemma 3's average pooling
    scale_factor: int

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.patches // self.scale_factor**2


@dataclass
class VisionLanguageParams:
    text: DecoderParams
    vision: VisionParams  # Qwen2.5-VL: poot_family_vision.qwen25vl.QwenVisionParams
    image_token_id: int
    # "gemma3": average pooling, soft-embedding norm, bidirectional attention in an image; "qwen2_5_vl"
    kind: str = "idefics3"
    # where a checkpoint may keep the text model's `model.` weights (the first that holds them is read)
    text_prefixes: tuple[str, ...] = ("model.text_model.",)
    boi_token_id: int | None = None  # Gemma 3's start and end of an image
    eoi_token_id: int | None = None
    soft_norm_offset: float = 1.0  # Gemma 3's soft-embedding norm: (1 + w); llama.cpp's mmproj stores 1 + w (0.0)
    mrope_sections: tuple[int, ...] | None = None  # Qwen2.5-VL's M-RoPE (temporal, height, width frequency slots)


def vision_params(vc: dict[str, Any], scale_factor: int, family: str = "Idefics3") -> VisionParams:
    hidden = int(require_key(vc, "hidden_size", "vision_config"))
    heads = int(require_key(vc, "num_attention_heads", "vision_config"))
    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act not in HF_ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"vision activation {act}", f"{family} config")
    image_size = int(require_key(vc, "image_size", "vision_config"))
    patch = int(require_key(vc, "patch_size", "vision_config"))
    side = image_size // patch
    if image_size % patch or side % scale_factor:
        raise Unsupported(Reason.SHAPE, f"image size {image_size} with patch {patch} and scale factor {scale_factor}",
                          "the tower needs whole patches, and a side of them divisible by the scale factor")
    layers = int(require_key(vc, "num_hidden_layers", "vision_config"))
    intermediate = int(require_key(vc, "intermediate_size", "vision_config"))
    return VisionParams(layers=layers, hidden=hidden, heads=heads, head_dim=hidden // heads, intermediate=intermediate,
                        norm_eps=float(vc.get("layer_norm_eps", 1e-6)), act=HF_ACTIVATIONS[act], image_size=image_size,
                        patch=patch, scale_factor=scale_factor)


def model_config(family: str, hf: dict[str, Any]) -> ModelConfig:
    tc, vc = require_key(hf, "text_config", "config.json"), require_key(hf, "vision_config", "config.json")
    text_type = str(tc.get("model_type", "llama"))
    if text_type != "llama":
        raise Unsupported(Reason.REGISTRY, f"{family} with a {text_type} text model", "only llama text models so far")
    text = decoder_params_from_hf(tc, "llama")
    scale = int(hf.get("scale_factor", 2))
    params = VisionLanguageParams(text=text, vision=vision_params(vc, scale),
                                  image_token_id=int(require_key(hf, "image_token_id", "config.json")))
    return language_config(family, hf, tc, params)


def language_config(family: str, hf: dict[str, Any], tc: dict[str, Any], params: VisionLanguageParams) -> ModelConfig:
    """The ModelConfig of a vision-language checkpoint whose text model's config is `tc`."""
    arch = (hf.get("architectures") or [hf.get("model_type", family)])[0]
    eos = eos_ids(tc.get("eos_token_id", hf.get("eos_token_id")))
    vocab = int(require_key(tc, "vocab_size", "text_config"))
    return ModelConfig(family=family, architecture=str(arch), vocab_size=vocab,
                       max_positions=int(tc.get("max_position_embeddings", 2048)), hidden_size=params.text.hidden,
                       eos_ids=eos, bos_id=tc.get("bos_token_id"), params=params, source_format="hf", raw=hf)
