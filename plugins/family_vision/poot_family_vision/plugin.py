"""poot-family-vision's entry point: the vision-language families it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poot_core import (
    DecoderParams,
    DerivedWeight,
    Family,
    GGUFNames,
    GGUFTensors,
    ModelConfig,
    StepShape,
    StoredWeights,
    Tracer,
    hookimpl,
    trace_dense_decoder,
)
from poot_family_vision import qwen25vl_gguf
from poot_family_vision.config import VisionLanguageParams, model_config
from poot_family_vision.gemma3 import gemma3_config, projection_weight
from poot_family_vision.model import trace_text
from poot_family_vision.qwen25vl import SECTIONS, mrope_masks, qwen25vl_config


class Idefics3(Family):
    """Idefics3 / SmolVLM. Traced by the driver it is the text model, with the image features of a step's image
    tokens spliced in when the serving engine gives them (StepShape.embedded; VisionLanguageModel.request makes
    such requests); VisionLanguageModel runs one request with images without the engine."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return model_config(self.name, hf)

    def prompt_embeddings(self, config: ModelConfig) -> bool:
        return True

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_text(config, t, images=shape.embedded)

    def image_prompts(self, handle: Any, executor: Any, weights: Any) -> Any:
        from poot_family_vision.runtime import VisionLanguageModel  # the runtime imports this module

        return VisionLanguageModel(handle, executor, weights=weights)


class Gemma3(Family):
    """Gemma 3 with its vision tower (Gemma3ForConditionalGeneration). Traced by the driver it is the Gemma 3
    text model, with the image features spliced in when the serving engine gives them; an image's tokens attend
    to each other both ways (StepShape.grouped), so the engine runs each image whole in one step."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return gemma3_config(self.name, hf)

    def hf_derived_weights(self, config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
        return projection_weight(config, store)

    def prompt_embeddings(self, config: ModelConfig) -> bool:
        return True

    def embedding_groups(self, config: ModelConfig) -> bool:
        return True

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_text(config, t, images=shape.embedded, groups=shape.grouped)

    def image_prompts(self, handle: Any, executor: Any, weights: Any) -> Any:
        from poot_family_vision.runtime import VisionLanguageModel  # the runtime imports this module

        return VisionLanguageModel(handle, executor, weights=weights)


class Qwen25VL(Family):
    """Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration; llama.cpp's text GGUF "qwen2vl"). Traced by the driver it
    is the Qwen2 text model alone, whose M-RoPE is the plain rope for text; images go through
    poot_family_vision.runtime.VisionLanguageModel (a GGUF with its mmproj file). In the serving engine a
    step holding a request with images ropes by M-RoPE over the request's positions by section
    (StepShape.sections), the image features spliced in as prompt embeddings; other steps by plain positions,
    which M-RoPE equals for text."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return qwen25vl_config(self.name, hf)

    def prompt_embeddings(self, config: ModelConfig) -> bool:
        return isinstance(config.params, VisionLanguageParams)  # not the text GGUF alone

    def rope_sections(self, config: ModelConfig) -> int:
        return len(SECTIONS) if self.prompt_embeddings(config) and config.params.mrope_sections else 0

    def step_constants(self, config: ModelConfig, shape: StepShape) -> dict[str, Any]:
        if not shape.sections:
            return {}
        return mrope_masks(config.params.mrope_sections, config.params.text.head_dim)

    def image_prompts(self, handle: Any, executor: Any, weights: Any) -> Any:
        if not self.prompt_embeddings(handle.config()):
            return None
        from poot_family_vision.runtime import VisionLanguageModel  # the runtime imports this module

        return VisionLanguageModel(handle, executor, weights=weights)

    def config_from_gguf(self, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
        return qwen25vl_gguf.text_config(self.name, metadata, path, tensors)

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        return GGUFNames().map(name, self.name)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        if isinstance(config.params, DecoderParams):  # the text GGUF alone
            trace_dense_decoder(config, t)
        else:
            trace_text(config, t, images=shape.embedded, mrope=shape.sections > 0)


FAMILIES = [
    Idefics3("idefics3", "idefics3", ("Idefics3ForConditionalGeneration", "idefics3")),
    Idefics3("smolvlm", "smolvlm", ("SmolVLMForConditionalGeneration", "smolvlm")),
    # model_type "gemma3" is the llama family's (Gemma 3 GGUF files name their architecture so)
    Gemma3("gemma3-vision", "gemma3", ("Gemma3ForConditionalGeneration",)),
    Qwen25VL("qwen2_5_vl", "qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2vl")),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "Gemma3", "Idefics3", "Qwen25VL"]
