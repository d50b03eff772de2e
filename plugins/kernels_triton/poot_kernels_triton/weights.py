"""Weights on the device, as stored, and the concatenations the kernels like (q/k/v, gate/up).

A concatenation is made once and the original tensors are replaced by views into it, so it costs no memory
once the originals are released: every program that reads q_proj alone still finds it, and the programs
that read q, k and v together read them in one GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from poot_core import PackedWeight, Reason, Unsupported, Weight, weight_kind

DENSE_KINDS = frozenset({"float32", "float16", "bfloat16"})
GPTQ_KINDS = frozenset({"gptq.4"})


def packed_kinds() -> frozenset[str]:
    from .quant import GGUF_TYPES

    return frozenset(f"gguf.{name}" for name in GGUF_TYPES) | GPTQ_KINDS


def weight_bytes(w: Weight) -> int:
    if isinstance(w, PackedWeight):
        return w.nbytes()
    return w.numel() * w.element_size()


@dataclass
class DeviceWeights:
    """The executor's handle to uploaded weights: tensors by stored name, the activation dtype the kernels
    compute in (bf16 unless every matrix is float16 or float32), and the concatenations made so far."""

    tensors: dict[str, Weight]
    act_dtype: torch.dtype
    device: torch.device
    fused: dict[tuple[str, ...], Weight] = field(default_factory=dict)

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for w in list(self.tensors.values()) + list(self.fused.values()):
            parts = w.parts.values() if isinstance(w, PackedWeight) else [w]
            for t in parts:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    def concatenated(self, names: tuple[str, ...]) -> Weight | None:
        """One weight holding the rows of `names` in order, or None when they cannot be joined (mixed
        layouts, GPTQ, different widths). The originals become views into it."""
        if names in self.fused:
            return self.fused[names]
        parts = [self.tensors[n] for n in names]
        if all(isinstance(w, torch.Tensor) for w in parts):
            if len({(w.dtype, w.dim(), w.shape[1:]) for w in parts}) != 1 or parts[0].dim() != 2:
                return None
            joined = torch.cat(parts, dim=0)
            offset = 0
            for n, w in zip(names, parts, strict=True):
                self.tensors[n] = joined[offset : offset + w.shape[0]]
                offset += w.shape[0]
        elif all(isinstance(w, PackedWeight) and w.layout == "gguf" for w in parts):
            types = {str(w.meta.get("type")) for w in parts}
            blocks = [w.parts["blocks"] for w in parts]
            if len(types) != 1 or len({b.shape[1] for b in blocks}) != 1:
                return None
            rows = torch.cat(blocks, dim=0)
            joined = PackedWeight("gguf", (rows.shape[0], parts[0].shape[1]), {"blocks": rows}, dict(parts[0].meta))
            offset = 0
            for n, w, b in zip(names, parts, blocks, strict=True):
                view = rows[offset : offset + b.shape[0]]
                self.tensors[n] = PackedWeight("gguf", w.shape, {"blocks": view}, dict(w.meta))
                offset += b.shape[0]
        else:
            return None
        self.fused[names] = joined
        return joined


def check_kind(name: str, w: Weight, backend: str = "cuda") -> None:
    """Refuse, naming the tensor, a weight layout the Triton kernels do not compute from."""
    kind = weight_kind(w)
    if isinstance(w, PackedWeight):
        if kind not in packed_kinds():
            raise Unsupported(
                Reason.QUANTIZATION,
                f"{kind} (tensor {name})",
                f"the {backend} backend computes {sorted(packed_kinds())}",
            )
    elif kind not in DENSE_KINDS and w.dim() > 0 and w.is_floating_point():
        raise Unsupported(
            Reason.QUANTIZATION, f"{kind} (tensor {name})", f"the {backend} backend computes f32/f16/bf16"
        )


def activation_dtype(weights: dict[str, Weight]) -> torch.dtype:
    """bf16 when any matrix is bf16 or packed, f16 when the matrices are f16, else f32."""
    dtypes = {w.dtype for w in weights.values() if isinstance(w, torch.Tensor) and w.dim() == 2}
    if torch.bfloat16 in dtypes or any(isinstance(w, PackedWeight) for w in weights.values()):
        return torch.bfloat16
    if torch.float16 in dtypes:
        return torch.float16
    return torch.float32


def to_device(w: Weight, device: torch.device) -> Weight:
    """Copy one weight to the device unchanged (dtype and packing as stored)."""
    if isinstance(w, PackedWeight):
        parts = {k: v.to(device, non_blocking=False).contiguous() for k, v in w.parts.items()}
        return PackedWeight(w.layout, w.shape, parts, dict(w.meta))
    return w.to(device).contiguous()
