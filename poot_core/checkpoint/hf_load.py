"""A Hugging Face checkpoint directory -> Parts: config.json (+ generation_config.json), the tokenizer files
and the *.safetensors weights (with or without an index), every file checked against the manifest when the
load has one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poot_core.checkpoint.integrity import FileAccess
from poot_core.checkpoint.parts import LoadOptions, Parts, WeightStore
from poot_core.errors import CheckpointError
from poot_core.registry import Registry


def load_hf(root: Path, registry: Registry, options: LoadOptions) -> Parts:
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
    for name, (make, shape) in family.hf_derived_weights(config, store).items():
        store.add(name, make, shape)
    _check_shapes(root, store)
    return Parts(root, family, config, TextServices(vocab), store, access.read)


def _json(access: FileAccess, path: Path) -> dict[str, Any]:
    data = access.read_bytes(path)
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(path, "expected a JSON object")
    return value


def _check_shapes(root: Path, store: WeightStore) -> None:
    for name, shape in store.shapes().items():
        if any(d < 0 for d in shape):
            raise CheckpointError(root, f"tensor {name} has a negative dimension {shape}")
