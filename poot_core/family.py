"""What a model family plugin provides.

A family turns a checkpoint's config (Hugging Face config.json or GGUF metadata) into a `ModelConfig`,
says which stored tensor names it reads, and writes the model once as a function over the tracer's ops
(`trace`). It holds no device code: executors run the traced graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from poot_core.errors import CheckpointError, Reason, Unsupported

if TYPE_CHECKING:
    import torch

    from poot_core.checkpoint.layouts import Weight
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


def eos_ids(value: Any) -> tuple[int, ...]:
    """End-of-sequence ids as configs spell them: absent, one id, or a list."""
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def require_key(hf: dict[str, Any], key: str, section: str | None = None) -> Any:
    """hf[key] of a Hugging Face config.json (or of its `section`, as vision_config), or a CheckpointError
    naming the key when it is missing or null (null is how configs spell a value they do not give)."""
    if hf.get(key) is None:
        raise CheckpointError("config.json", f"missing key {key!r}" + (f" in {section}" if section else ""))
    return hf[key]


class GGUFTensors(Protocol):
    """The tensors of a GGUF file, by llama.cpp's names, as a family sees them while it reads the file."""

    @property
    def path(self) -> Path:
        """The file, for error messages."""
        ...

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The torch-order shape (llama.cpp lists dimensions the other way round)."""
        ...

    def stored(self, name: str) -> Weight:
        """The tensor as stored: a zero-copy tensor for dense types, a PackedWeight for block types."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """Its exact values in float32 (dequantized): for the small tensors a config needs (rope_freqs)."""
        ...


# A weight a family builds from several stored tensors: how to make it (lazily), and its shape.
DerivedWeight = tuple[Callable[[], "Weight"], tuple[int, ...]]


class StoredWeights(Protocol):
    """The tensors of a Hugging Face checkpoint by their stored names, as a family sees them after its config."""

    def names(self) -> list[str]: ...

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def get(self, name: str) -> Weight:
        """The tensor as stored (memory-mapped), or a PackedWeight for quantized checkpoints."""
        ...


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

    def prompt_embeddings(self, config: ModelConfig) -> bool:
        """Whether `trace` splices given embeddings into a step's rows (StepShape.embedded): the serving engine
        runs requests with PromptEmbeddings (images) only for such a checkpoint."""
        return False

    def embedding_groups(self, config: ModelConfig) -> bool:
        """Whether the tokens of one run of consecutive prompt embeddings (an image) attend to each other both
        ways (Gemma 3): the serving engine then never splits such a run between steps, and a step holding one
        is StepShape.grouped."""
        return False

    def rope_sections(self, config: ModelConfig) -> int:
        """How many sections of positions the family's rope can turn by (StepShape.sections; Qwen2.5-VL's
        M-RoPE: 3); 0: one position a token. A request's PromptEmbeddings then carry positions by section."""
        return 0

    def step_constants(self, config: ModelConfig, shape: StepShape) -> dict[str, Any]:
        """Step inputs of fixed value that the family's trace of `shape` reads (M-RoPE's section masks), which
        the serving engine adds to every step of that shape."""
        return {}

    def image_prompts(self, handle: Any, executor: Any, weights: Any) -> Any:
        """For a family with `prompt_embeddings`: its poot_core.driver.embeddings.ImagePrompts over `handle`'s
        weights already on `executor` (what lets `poot serve` take images), or None when it takes none."""
        return None

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        raise Unsupported(Reason.REGISTRY, f"{self.name} from a Hugging Face checkpoint",
                          "this family reads no Hugging Face configs")

    def config_from_gguf(self, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
        """The config of the GGUF file at `path` (named in errors) from its metadata and, where llama.cpp
        stores parameters as tensors (rope_freqs), its tensors. A key that changes the computation and that
        the family does not understand is refused by name (poot_core.GGUFKeys.refuse_unread)."""
        raise Unsupported(Reason.REGISTRY, f"{self.name} from a GGUF file", "this family reads no GGUF files")

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        """Map a llama.cpp tensor name to the name `trace` uses; None for a tensor the config already read
        or a derived weight is made from. A name the family does not know is refused (poot_core.GGUFNames)."""
        return name

    def gguf_derived_weights(self, config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
        """Weights `trace` reads that the file stores split differently (DeepSeek's attn_k_b/attn_v_b)."""
        return {}

    def hf_derived_weights(self, config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
        """Weights `trace` reads that a Hugging Face checkpoint stores joined (Granite's stacked experts keep
        gate and up in one tensor): views of the stored tensors where they can be."""
        return {}

    @abstractmethod
    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        """Write the model's step for `shape` with the tracer's ops."""

    def describe(self) -> str:
        return f"{self.name}: {', '.join(self.architectures)}"
