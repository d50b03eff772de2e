"""A progress bar on stderr while a large checkpoint is read into memory (only on a terminal)."""

from __future__ import annotations

import sys
from pathlib import Path

LARGE = 300 * 1024 * 1024  # below this, loading is quick enough to need no bar
CHUNK = 16 * 1024 * 1024


def checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def warm_with_progress(path: Path, stream=sys.stderr) -> bool:
    """Read the checkpoint's weight files once (into the page cache the memory map then uses), drawing a bar.
    Returns whether it did: only for a large checkpoint and a terminal."""
    files = checkpoint_files(path)
    total = sum(f.stat().st_size for f in files)
    if total < LARGE or not stream.isatty():
        return False
    done = 0
    for f in files:
        with open(f, "rb", buffering=0) as handle:
            while chunk := handle.read(CHUNK):
                done += len(chunk)
                filled = int(30 * done / total)
                stream.write(f"\rloading [{'#' * filled}{'.' * (30 - filled)}] {done / 2**20:7.0f}"
                             f" / {total / 2**20:.0f} MiB")
                stream.flush()
    stream.write("\n")
    return True
