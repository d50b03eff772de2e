"""ModelHandle: a checkpoint opened, its family resolved, its weights mapped as stored.

A directory is a Hugging Face checkpoint (config.json, tokenizer files, *.safetensors with or without an
index); a file is GGUF (config, weights, tokenizer and chat template inside).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poot_core.checkpoint.integrity import FileAccess, Manifest
from poot_core.checkpoint.layouts import Weight, weight_nbytes, weight_shape
from poot_core.errors import CheckpointError
from poot_core.family import Family, ModelConfig
from poot_core.registry import Registry


@dataclass
class LoadOptions:
    """integrity: a Manifest (or a path to its JSON) every file the load reads must match.
    progress: show a progress bar on stderr while verifying large files (None: when stderr is a terminal)."""

    integrity: Manifest | str | Path | None = None
    progress: bool | None = None

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


def _json(access: FileAccess, path: Path) -> dict[str, Any]:
    data = access.read_bytes(path)
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(path, "expected a JSON object")
    return value


class ModelHandle:
    def __init__(self, path: Path, family: Family, config: ModelConfig, text: Any, store: WeightStore,
                 files: list[str]) -> None:
        self.path = path
        self.family = family
        self._config = config
        self._text = text
        self._store = store
        self.files_read = files

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
            return _load_hf(cls, path, registry, options)
        if path.is_file():
            from poot_core.checkpoint.gguf_load import load_gguf

            return load_gguf(cls, path, registry, options)
        raise CheckpointError(path, "no such checkpoint: neither a directory nor a file")


def _load_hf(cls: type[ModelHandle], root: Path, registry: Registry, options: LoadOptions) -> ModelHandle:
    from poot_core.checkpoint.safetensors_load import open_store
    from poot_core.text.hf_vocab import vocabulary_from_hf
    from poot_core.text.services import TextServices

    access = FileAccess(root, options.manifest())
    config_path = root / "config.json"
    if not config_path.exists():
        raise CheckpointError(root, "not a Hugging Face checkpoint: config.json is missing")
    hf = _json(access, config_path)
    archs = hf.get("architectures") or []
    family = registry.resolve(*(archs if isinstance(archs, list) else []), hf.get("model_type"))
    config = family.config_from_hf(hf)
    generation = root / "generation_config.json"
    if generation.exists():
        gen = _json(access, generation)
        eos = gen.get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            config.eos_ids = tuple(dict.fromkeys((*config.eos_ids, *(int(e) for e in extra))))
    vocab = vocabulary_from_hf(root, access, config)
    store = open_store(root, access, hf.get("quantization_config"), family)
    _check_shapes(root, store)
    return cls(root, family, config, TextServices(vocab), store, access.read)


def _check_shapes(root: Path, store: WeightStore) -> None:
    for name, shape in store.shapes().items():
        if any(d < 0 for d in shape):
            raise CheckpointError(root, f"tensor {name} has a negative dimension {shape}")


__all__ = ["LoadOptions", "ModelHandle", "WeightStore", "weight_shape"]
