"""GGUF files with metadata changed in place (gguf's own reader)."""

from __future__ import annotations

import shutil
from pathlib import Path


def gguf_copy(source: Path, target: Path, **fields: object) -> Path:
    """A copy of a GGUF file with some scalar metadata values changed in place (gguf's own reader)."""
    from gguf import GGUFReader

    shutil.copyfile(source, target)
    reader = GGUFReader(target, "r+")
    for key, value in fields.items():
        field = reader.get_field(key)
        assert field is not None, key
        field.parts[field.data[0]][0] = value
    del reader
    return target
