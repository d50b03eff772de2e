"""Quantized weight layouts: dequantization and the kinds the CPU can compute from.

(The block decoders for GGUF, GPTQ, AWQ and FP8 are being written; until they land no packed kind is
supported, and loading a quantized checkpoint is refused by the executor with Reason.QUANTIZATION.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.errors import Reason, Unsupported


def supported_kinds() -> set[str]:
    return set()


def dequantize(w: PackedWeight, rows: slice | None = None) -> torch.Tensor:
    raise Unsupported(Reason.QUANTIZATION, w.kind, "no decoder for this layout yet")


def packed_from_safetensors(get: Callable[[str], torch.Tensor], prefix: str,
                            qconfig: dict[str, Any]) -> PackedWeight | None:
    raise Unsupported(Reason.QUANTIZATION, str(qconfig.get("quant_method")), f"layer {prefix}")
