"""Weights kept as stored.

A dense weight is a plain torch tensor (memory-mapped, dtype as stored: bf16 stays bf16). A quantized
matrix is a `PackedWeight`: its packed parts exactly as the file holds them, plus what is needed to
compute with them. Executors decide how to multiply by it; nobody widens it to a float copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class PackedWeight:
    """A quantized matrix in its stored form.

    layout: the family of packing, one of "gguf", "gptq", "awq", "fp8".
    shape: the logical (out_features, in_features) of the matrix it stands for.
    parts: the stored tensors (for gguf: "blocks", a uint8 [out, bytes_per_row] view of the file;
           for gptq: "qweight", "qzeros", "scales", "g_idx"; for awq: "qweight", "qzeros", "scales";
           for fp8: "weight" and "scale").
    meta: layout parameters (gguf: {"type": "Q4_K"}; gptq: {"bits", "group_size", "sym", "desc_act"}, ...).
    """

    layout: str
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The name a capability list uses, e.g. "gguf.Q4_K", "gptq.4", "awq.4", "fp8.block"."""
        sub = self.meta.get("type") or self.meta.get("bits") or self.meta.get("granularity")
        return f"{self.layout}.{sub}" if sub is not None else self.layout

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


Weight = torch.Tensor | PackedWeight


def weight_kind(w: Weight) -> str:
    """The layout name of any weight: a torch dtype name for dense ones ("bfloat16"), else PackedWeight.kind."""
    if isinstance(w, PackedWeight):
        return w.kind
    return str(w.dtype).removeprefix("torch.")


def weight_shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


def weight_nbytes(w: Weight) -> int:
    if isinstance(w, PackedWeight):
        return w.nbytes()
    return w.numel() * w.element_size()
