"""Fetch test data that comes from PyPI packages, once, into .cache/testdata.

llama-cpp-python's source distribution carries llama.cpp's tokenizer test vocabularies (ggml-vocab-*.gguf
with .inp/.out pairs of text and expected token ids), dozens of real chat templates (.jinja), and llama.cpp's
own checkpoint converter (convert_hf_to_gguf.py with its `conversion` package and the gguf-py it imports).
The tests use them as reference data and as the reference writer of GGUF files. Nothing comes from a model hub.

Run: python scripts/fetch_test_data.py   (idempotent: does nothing when the data is already there)
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".cache" / "testdata" / "llama.cpp"
SDIST = "llama-cpp-python==0.3.36"
# What the marker file says once everything below is extracted; a change here fetches again.
CONTENTS = f"{SDIST} vocab templates converter\n"
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


def _target(inner: str) -> Path | None:
    """Where a member of the archive (path below its top folder) goes, or None if not wanted."""
    vendored = inner.removeprefix("vendor/llama.cpp/")
    if vendored == inner:
        return None
    if vendored.startswith("models/ggml-vocab-"):
        return DEST / "vocab" / Path(vendored).name
    if vendored.startswith("models/templates/"):
        return DEST / "templates" / Path(vendored).name
    if vendored.startswith(CONVERTER):
        return DEST / "convert" / vendored
    return None


def main() -> int:
    done = DEST / ".complete"
    if done.exists() and done.read_text() == CONTENTS:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
             "-d", tmp],
            check=True,
        )
        archive = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition("/")
                target = _target(inner) if member.isfile() else None
                if target is None:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    done.write_text(CONTENTS)
    print(f"test data in {DEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
