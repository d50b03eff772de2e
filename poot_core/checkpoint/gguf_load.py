"""A GGUF file -> Parts: config, weights, tokenizer and chat template from the one file.

The family resolves from `general.architecture`; it reads its config from the metadata (and from the few
tensors llama.cpp uses for parameters, such as rope_freqs) and maps llama.cpp's tensor names to its own,
refusing those it does not know. Block-quantized tensors stay packed (PackedWeight over the mapped file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.checkpoint.integrity import FileAccess
from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.checkpoint.parts import LoadOptions, Parts, WeightStore
from poot_core.registry import Registry


class FileTensors:
    """The GGUFTensors view of an opened file that families read while they build their config."""

    def __init__(self, file: GGUFFile) -> None:
        self._file = file

    @property
    def path(self) -> Path:
        return self._file.path

    def names(self) -> list[str]:
        return self._file.tensor_names()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.tensor_info(name).shape)

    def stored(self, name: str) -> Weight:
        return self._file.tensor(name)

    def read(self, name: str) -> torch.Tensor:
        return float_values(self.stored(name))


def float_values(w: Weight) -> torch.Tensor:
    """The exact values of a stored tensor in float32 (a copy)."""
    if isinstance(w, PackedWeight):
        from poot_core.checkpoint.quant import dequantize

        return dequantize(w).reshape(w.shape)
    return w.float().clone()


def _marked(w: Weight, options: LoadOptions) -> Weight:
    """w, its block weights marked for the CPU executor's q8 decode products where the options ask for them."""
    if options.cpu_activations != "exact" and isinstance(w, PackedWeight):
        w.meta["cpu_activations"] = options.cpu_activations
    return w


def load_gguf(path: Path, registry: Registry, options: LoadOptions) -> Parts:
    from poot_core.text.gguf_vocab import vocabulary_from_gguf
    from poot_core.text.services import TextServices

    access = FileAccess(path.parent, options.manifest())
    access.verify(path)  # the whole file (weights, config, tokenizer, template) before anything is parsed
    file = GGUFFile.open(path)
    meta: dict[str, Any] = dict(file.metadata)
    arch = meta.get("general.architecture")
    # llama.cpp names a mixture-of-experts llama (mixtral) plain "llama": its expert count tells them apart.
    family = registry.resolve(f"{arch}:moe" if meta.get(f"{arch}.expert_count") else None, arch)
    tensors = FileTensors(file)
    config = family.config_from_gguf(meta, path, tensors)
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
        loaders[mapped] = (lambda n=name: _marked(file.tensor(n), options))
        shapes[mapped] = tensors.shape(name)
    for mapped, (make, shape) in family.gguf_derived_weights(config, tensors).items():
        loaders[mapped], shapes[mapped] = make, shape
    return Parts(path, family, config, TextServices(vocab), WeightStore(loaders, shapes), access.read)
