"""GGUF quantized blocks for tests: random valid blocks of every type, or gguf's own quantizer where it has one."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf's Python side can quantize these
RANDOM_ONLY = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
# Byte offsets of the float16 scale fields inside each block (ggml's block structs).
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks: random bytes with finite float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        raw[:, at : at + 2] = rng.uniform(-0.1, 0.1, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def quantized_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return quants.quantize(data, GGMLQuantizationType[type_name])
