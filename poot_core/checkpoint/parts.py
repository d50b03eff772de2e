"""What a checkpoint loader is given and what it returns.

The loaders (`hf_load`, `gguf_load`) take a path, the registry and `LoadOptions` and return the `Parts` of a
checkpoint; `ModelHandle.load` picks the loader and builds the handle from them. Nothing here imports a
loader or the handle, so the layers only point one way: handle -> loaders -> parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poot_core.checkpoint.integrity import Manifest
from poot_core.checkpoint.layouts import Weight, weight_nbytes
from poot_core.errors import CheckpointError
from poot_core.family import Family, ModelConfig

# The values of LoadOptions.cpu_activations.
CPU_ACTIVATIONS = ("exact", "q8")


@dataclass
class LoadOptions:
    """integrity: a Manifest (or a path to its JSON) every file the load reads must match.
    progress: show a progress bar on stderr while verifying large files (None: when stderr is a terminal).
    cpu_activations: "exact" (float32 activations times exactly dequantized weights) or "q8": the CPU
    executor's decode products from GGUF block weights quantize x to 8 bits per 32 values and sum integer
    products, as llama.cpp does (faster, about 1e-2 relative; every GGUF block type with a C kernel has this
    route, see poot_core.cpu.packed_linear.Q8_TYPES). Other weights and other backends ignore it."""

    integrity: Manifest | str | Path | None = None
    progress: bool | None = None
    cpu_activations: str = "exact"

    def __post_init__(self) -> None:
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"LoadOptions(cpu_activations={self.cpu_activations!r}): expected one of "
                             f"{', '.join(map(repr, CPU_ACTIVATIONS))}")

    def manifest(self) -> Manifest | None:
        if self.integrity is None or isinstance(self.integrity, Manifest):
            return self.integrity
        return Manifest.load(self.integrity)


class WeightStore:
    """Named weights as stored, produced lazily (memory-mapped) and cached by name."""

    def __init__(self, loaders: dict[str, Callable[[], Weight]], shapes: dict[str, tuple[int, ...]]) -> None:
        self._loaders = loaders
        self._shapes = shapes
        self._cache: dict[str, Weight] = {}

    def names(self) -> list[str]:
        return list(self._loaders)

    def add(self, name: str, loader: Callable[[], Weight], shape: tuple[int, ...]) -> None:
        """A derived weight (Family.hf_derived_weights); a stored tensor of that name is an error."""
        if name in self._loaders:
            raise CheckpointError(name, "a derived weight has the name of a stored tensor")
        self._loaders[name], self._shapes[name] = loader, shape

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._loaders

    def get(self, name: str) -> Weight:
        w = self._cache.get(name)
        if w is None:
            w = self._cache[name] = self._loaders[name]()
        return w

    def nbytes(self) -> int:
        return sum(weight_nbytes(self.get(n)) for n in self._loaders)


@dataclass
class Parts:
    """A checkpoint as a loader opened it: its family and config, text services, weights, and the files read
    (relative names, in the order they were read)."""

    path: Path
    family: Family
    config: ModelConfig
    text: Any
    store: WeightStore
    files: list[str]


__all__ = ["LoadOptions", "Parts", "WeightStore"]
