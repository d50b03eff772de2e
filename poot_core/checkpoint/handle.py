"""ModelHandle: a checkpoint opened, its family resolved, its weights mapped as stored.

A directory is a Hugging Face checkpoint (`hf_load`: config.json, tokenizer files, *.safetensors with or
without an index); a file is GGUF (`gguf_load`: config, weights, tokenizer and chat template inside). The
loaders return `Parts`; the handle is built here from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poot_core.checkpoint.layouts import weight_shape
from poot_core.checkpoint.parts import LoadOptions, Parts, WeightStore
from poot_core.errors import CheckpointError
from poot_core.family import Family, ModelConfig
from poot_core.registry import Registry


class ModelHandle:
    def __init__(self, path: Path, family: Family, config: ModelConfig, text: Any, store: WeightStore,
                 files: list[str]) -> None:
        self.path = path
        self.family = family
        self._config = config
        self._text = text
        self._store = store
        self.files_read = files

    @classmethod
    def from_parts(cls, parts: Parts) -> ModelHandle:
        return cls(parts.path, parts.family, parts.config, parts.text, parts.store, parts.files)

    def config(self) -> ModelConfig:
        return self._config

    def text(self) -> Any:
        """The tokenizer and chat services (poot_core.text.TextServices)."""
        return self._text

    def store(self) -> WeightStore:
        return self._store

    @classmethod
    def load(cls, path: str | Path, registry: Registry | None = None,
             options: LoadOptions | None = None) -> ModelHandle:
        path = Path(path)
        registry = registry or Registry.builtin()
        options = options or LoadOptions()
        if path.is_dir():
            from poot_core.checkpoint.hf_load import load_hf

            return cls.from_parts(load_hf(path, registry, options))
        if path.is_file():
            from poot_core.checkpoint.gguf_load import load_gguf

            return cls.from_parts(load_gguf(path, registry, options))
        raise CheckpointError(path, "no such checkpoint: neither a directory nor a file")


__all__ = ["LoadOptions", "ModelHandle", "Parts", "WeightStore", "weight_shape"]
