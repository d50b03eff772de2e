"""The checkpoints and prompts the contiguous and the paged speculation tests share: every family's tiny float32
checkpoint (seeds give other weights over one vocabulary) and prompts that do and do not repeat."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helpers import moe, tiny

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
REPEATING = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
PLAIN = [(5 * i + 11) % 240 + 3 for i in range(24)]  # no token twice
PROBES = [REPEATING, "The capital of France is Paris. The capital of Italy is", "Once upon a time there was a cat"]

_BUILT: dict[tuple[str, int], Path] = {}


def checkpoint_maker(tmp_path_factory: Any) -> Callable[..., Path]:
    """make(arch, seed=0) -> a tiny float32 checkpoint of any family, built once per session."""

    def make(arch: str, seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in _BUILT:
            path = tmp_path_factory.mktemp(f"{arch}-{seed}")
            builder = moe.build if arch in MOE else tiny.build
            _BUILT[key] = builder(path, arch, torch.float32, seed)
        return _BUILT[key]

    return make
