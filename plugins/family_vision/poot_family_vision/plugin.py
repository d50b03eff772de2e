"""poot-family-vision's entry point: the vision-language families it serves."""

from __future__ import annotations

from typing import Any

from poot_core import Family, ModelConfig, StepShape, Tracer, hookimpl
from poot_family_vision.config import model_config
from poot_family_vision.model import trace_text


class Idefics3(Family):
    """Idefics3 / SmolVLM. Traced by the driver it is the text model alone (prompts without images); images go
    through poot_family_vision.runtime.VisionLanguageModel."""

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return model_config(self.name, hf)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_text(config, t)


FAMILIES = [
    Idefics3("idefics3", "idefics3", ("Idefics3ForConditionalGeneration", "idefics3")),
    Idefics3("smolvlm", "smolvlm", ("SmolVLMForConditionalGeneration", "smolvlm")),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "Idefics3"]
