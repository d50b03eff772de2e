"""A Hugging Face checkpoint's *.safetensors files -> a WeightStore of weights as stored.

Quantized projections (GPTQ, AWQ, FP8) are gathered from their parts (qweight, qzeros, scales, ...) into
one PackedWeight under the layer's `.weight` name; everything else is a zero-copy memory-mapped tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poot_core.checkpoint.integrity import FileAccess
from poot_core.checkpoint.parts import WeightStore
from poot_core.errors import CheckpointError

# Suffixes that mark a quantized layer's parts; the layer prefix is what comes before them.
QUANT_PART_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                       ".input_scale", ".weight_zero_point", ".weight_packed", ".weight_shape")
QUANT_MARKERS = (".qweight", ".weight_scale", ".weight_scale_inv", ".weight_packed")


def weight_files(root: Path, access: FileAccess) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            mapping = json.loads(access.read_bytes(index))["weight_map"]
            names = sorted(set(mapping.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(index, f"not a safetensors index ({exc})") from exc
        files = [root / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(index, f"names weight files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(root, "no *.safetensors weight files")
    return files


def open_store(root: Path, access: FileAccess, qconfig: dict[str, Any] | None, family: Any) -> WeightStore:
    from poot_core.checkpoint.safetensors_file import SafetensorsFile

    owner: dict[str, SafetensorsFile] = {}
    for path in weight_files(root, access):
        access.verify(path)  # checked in full before any tensor is read from it
        file = SafetensorsFile.open(path)
        for name in file.names():
            if name in owner:
                raise CheckpointError(path, f"tensor {name} is stored twice (also in {owner[name].path})")
            owner[name] = file

    def raw(name: str) -> Any:
        return owner[name].tensor(name)

    loaders: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    quant_prefixes = sorted({n[: -len(m)] for n in owner for m in QUANT_MARKERS if n.endswith(m)})
    if quant_prefixes and not qconfig:
        raise CheckpointError(root, "weights have quantized parts but config.json has no quantization_config")
    taken: set[str] = set()
    if quant_prefixes:
        from poot_core.checkpoint.quant import packed_from_safetensors

        for prefix in quant_prefixes:
            packed = packed_from_safetensors(raw, prefix, qconfig or {})
            if packed is None:
                continue
            loaders[prefix + ".weight"] = (lambda p=packed: p)
            shapes[prefix + ".weight"] = tuple(packed.shape)
            taken.update(n for n in owner if n.startswith(prefix + ".") and n != prefix + ".bias"
                         and n.endswith((".weight", *QUANT_PART_SUFFIXES)))
    for name in owner:
        if name in taken or name in loaders:
            continue
        loaders[name] = (lambda n=name: raw(n))
        shapes[name] = tuple(raw(name).shape)
    return WeightStore(loaders, shapes)
