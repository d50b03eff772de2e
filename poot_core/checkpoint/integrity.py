"""Integrity manifests: every file a load reads, with its length and SHA-256.

Weight files are verified (streamed) before any tensor is read from them. Small files (config, tokenizer,
chat template) are read once into memory, hashed, and parsed from those same bytes, so what was checked is
what is used. With a manifest, a file the load reads that is not listed is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poot_core.errors import IntegrityError

CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """{relative file name: (length, sha256 hex)}; names are relative to the checkpoint directory, or the
    file's own name for a single-file (GGUF) checkpoint."""

    files: dict[str, tuple[int, str]]

    @classmethod
    def from_json(cls, value: str | bytes | dict[str, Any]) -> Manifest:
        data = json.loads(value) if isinstance(value, str | bytes) else value
        try:
            files = {name: (int(e["size"]), str(e["sha256"]).lower()) for name, e in data["files"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IntegrityError("manifest", f"not a poot manifest ({exc})") from exc
        return cls(files)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        return cls.from_json(Path(path).read_bytes())

    @classmethod
    def of(cls, path: str | Path) -> Manifest:
        """Write a manifest for a checkpoint: every regular file of a directory, or the one GGUF file."""
        root = Path(path)
        paths = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        base = root if root.is_dir() else root.parent
        return cls({str(p.relative_to(base)): (p.stat().st_size, sha256_file(p)) for p in paths})

    def to_json(self) -> str:
        files = {name: {"size": size, "sha256": digest} for name, (size, digest) in sorted(self.files.items())}
        return json.dumps({"version": 1, "files": files}, indent=2)


class FileAccess:
    """Reads a checkpoint's files, checking them against a manifest when one is given."""

    def __init__(self, base: Path, manifest: Manifest | None) -> None:
        self.base = base
        self.manifest = manifest
        self.read: list[str] = []

    def _entry(self, path: Path) -> tuple[int, str] | None:
        name = str(path.relative_to(self.base))
        self.read.append(name)
        if self.manifest is None:
            return None
        entry = self.manifest.files.get(name)
        if entry is None:
            raise IntegrityError(path, "the load reads this file but the integrity manifest does not list it")
        return entry

    def read_bytes(self, path: Path) -> bytes:
        """A small file, hashed and returned as the very bytes that were checked."""
        entry = self._entry(path)
        data = path.read_bytes()
        if entry is not None:
            size, digest = entry
            if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                raise IntegrityError(path, f"does not match the manifest (length {len(data)}, expected {size})")
        return data

    def verify(self, path: Path) -> None:
        """A large file, streamed through SHA-256 before anything reads a tensor from it."""
        entry = self._entry(path)
        if entry is None:
            return
        size, digest = entry
        actual = path.stat().st_size
        if actual != size:
            raise IntegrityError(path, f"length {actual} differs from the manifest's {size}")
        if sha256_file(path) != digest:
            raise IntegrityError(path, "SHA-256 differs from the manifest")
