"""Quantized weight layouts: dequantization and the kinds the CPU can compute from.

GGUF blocks are decoded with the `gguf` package's reference decoders for now, one tile of rows at a time
(never the whole matrix). GPTQ, AWQ and FP8 decoders are not built yet: such checkpoints are refused with
Reason.QUANTIZATION.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.errors import Reason, Unsupported

GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                        "IQ4_NL", "IQ4_XS"})


def gguf_type_supported(type_name: str) -> bool:
    return type_name in GGUF_TYPES


def supported_kinds() -> set[str]:
    return {f"gguf.{t}" for t in GGUF_TYPES}


def dequantize(w: PackedWeight, rows: slice | None = None) -> torch.Tensor:
    """float32 [selected rows, in] of a packed matrix."""
    if w.layout == "gguf" and gguf_type_supported(w.meta.get("type", "")):
        blocks = w.parts["blocks"] if rows is None else w.parts["blocks"][rows]
        out = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType[w.meta["type"]])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
    raise Unsupported(Reason.QUANTIZATION, w.kind, "no decoder for this layout")


def packed_from_safetensors(get: Callable[[str], torch.Tensor], prefix: str,
                            qconfig: dict[str, Any]) -> PackedWeight | None:
    raise Unsupported(Reason.QUANTIZATION, str(qconfig.get("quant_method")), f"layer {prefix}: not built yet")
