"""What a model family plugin provides.

A family turns a checkpoint's config (Hugging Face config.json or GGUF metadata) into a `ModelConfig`,
says which stored tensor names it reads, and writes the model once as a function over the tracer's ops
(`trace`). It holds no device code: executors run the traced graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from poot_core.errors import Reason, Unsupported

if TYPE_CHECKING:
    from poot_core.graph import StepShape, Tracer


@dataclass
class ModelConfig:
    """The family-neutral facts every part of poot needs, plus the family's own parameters in `params`."""

    family: str
    architecture: str
    vocab_size: int
    max_positions: int
    hidden_size: int
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    # "decoder" generates text; "encoder" gives hidden states for embeddings and scores.
    kind: str = "decoder"
    params: Any = None
    source_format: str = "hf"  # "hf" or "gguf"
    raw: dict[str, Any] = field(default_factory=dict)


class Family(ABC):
    """Base class of a model family. Subclasses set `name` and `architectures`, implement `trace`, and the
    config readers of the formats they serve (the others refuse with a typed error)."""

    name: str = ""
    # Every name this family serves: HF `architectures` entries, HF `model_type` values and GGUF
    # `general.architecture` values.
    architectures: tuple[str, ...] = ()
    # The Hugging Face model_type whose conventions this family follows (one plugin class may serve several).
    model_type: str = ""

    def __init__(self, name: str | None = None, model_type: str | None = None,
                 architectures: tuple[str, ...] | None = None) -> None:
        """Subclasses may set these as class attributes instead; arguments given here win."""
        if name is not None:
            self.name = name
        if model_type is not None:
            self.model_type = model_type
        if architectures is not None:
            self.architectures = architectures

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        raise Unsupported(Reason.REGISTRY, f"{self.name} from a Hugging Face checkpoint",
                          "this family reads no Hugging Face configs")

    def config_from_gguf(self, metadata: dict[str, Any]) -> ModelConfig:
        raise Unsupported(Reason.REGISTRY, f"{self.name} from a GGUF file", "this family reads no GGUF files")

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        """Map a llama.cpp tensor name to the name `trace` uses (None: not used)."""
        return name

    @abstractmethod
    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        """Write the model's step for `shape` with the tracer's ops."""

    def describe(self) -> str:
        return f"{self.name}: {', '.join(self.architectures)}"
