"""GGUF files finished with gguf's own writer, and copies with metadata changed in place (its reader)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def finish_gguf(writer: Any) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors to its file, in the order the format needs, and
    close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
