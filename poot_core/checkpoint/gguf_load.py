"""A GGUF file -> ModelHandle: config, weights, tokenizer and chat template from the one file.

The family resolves from `general.architecture`; it maps llama.cpp's tensor names to its own. Block-quantized
tensors stay packed (PackedWeight over the memory-mapped file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poot_core.checkpoint.handle import LoadOptions, ModelHandle, WeightStore
from poot_core.checkpoint.integrity import FileAccess
from poot_core.registry import Registry


def load_gguf(cls: type[ModelHandle], path: Path, registry: Registry, options: LoadOptions) -> ModelHandle:
    from poot_core.checkpoint.gguf_file import GGUFFile
    from poot_core.text.gguf_vocab import vocabulary_from_gguf
    from poot_core.text.services import TextServices

    access = FileAccess(path.parent, options.manifest())
    access.verify(path)  # the whole file (weights, config, tokenizer, template) before anything is parsed
    file = GGUFFile.open(path)
    meta: dict[str, Any] = dict(file.metadata)
    meta.setdefault("__path__", str(path))
    arch = meta.get("general.architecture")
    # llama.cpp names a mixture-of-experts llama (mixtral) plain "llama": its expert count tells them apart.
    family = registry.resolve(f"{arch}:moe" if meta.get(f"{arch}.expert_count") else None, arch)
    config = family.config_from_gguf(meta)
    vocab = vocabulary_from_gguf(meta, str(path))
    # The tokenizer arrays (tens of thousands of strings) live on in the tokenizer; keep only the small keys.
    small = {k: v for k, v in meta.items() if not (isinstance(v, list) and len(v) > 1024)}
    file.metadata = config.raw = small
    config.eos_ids = tuple(dict.fromkeys((*config.eos_ids, *vocab.stop_ids)))
    if vocab.bos_id is not None:
        config.bos_id = vocab.bos_id
    loaders: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in file.tensor_names():
        mapped = family.gguf_tensor_name(config, name)
        if mapped is None:
            continue
        loaders[mapped] = (lambda n=name: file.tensor(n))
        shapes[mapped] = tuple(file.tensor_info(name).shape)
    return cls(path, family, config, TextServices(vocab), WeightStore(loaders, shapes), access.read)
