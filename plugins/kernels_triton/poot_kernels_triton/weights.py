"""Weights on the device, as stored, and the concatenations the kernels like (q/k/v, gate/up).

Dense weights keep their dtype; a packed matrix (GGUF, GPTQ, AWQ, FP8) keeps its bits, regrouped once into
the planes layout the GPU kernels read (relayout.py); stacked GGUF experts stay in the file's layout.
A concatenation is made once and the original tensors are replaced by views into it, so it costs no memory
once the originals are released: every program that reads q_proj alone still finds it, and the programs
that read q, k and v together read them in one GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from poot_core import PackedWeight, Reason, Unsupported, Weight, weight_kind

from .relayout import GGUF_BLOCKS, is_planes, join, to_planes

DENSE_KINDS = frozenset({"float32", "float16", "bfloat16"})
OTHER_PACKED_KINDS = frozenset({"gptq.2", "gptq.3", "gptq.4", "gptq.8", "awq.4", "fp8.tensor", "fp8.channel",
                                "fp8.block"})  # fmt: skip


def packed_kinds() -> frozenset[str]:
    return frozenset(f"gguf.{name}" for name in GGUF_BLOCKS) | OTHER_PACKED_KINDS


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
        layouts or group sizes, act-order, different widths). The originals become views into it."""
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
        elif all(is_planes(w) for w in parts):
            made = join(parts)
            if made is None:
                return None
            joined, views = made
            for n, view in zip(names, views, strict=True):
                self.tensors[n] = view
        else:
            return None
        self.fused[names] = joined
        return joined


def check_kind(name: str, w: Weight, backend: str = "cuda") -> None:
    """Refuse, naming the tensor, a weight layout the Triton kernels do not compute from."""
    kind = weight_kind(w)
    if isinstance(w, PackedWeight):
        if kind not in packed_kinds() or (len(w.shape) != 2 and w.layout != "gguf"):
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
    """Copy one weight to the device: dense as stored, a packed matrix regrouped into planes on the device
    (the same bits; stacked experts keep the file's layout)."""
    if isinstance(w, PackedWeight):
        parts = {k: v.to(device, non_blocking=False).contiguous() for k, v in w.parts.items()}
        moved = PackedWeight(w.layout, w.shape, parts, dict(w.meta))
        return to_planes(moved) or moved
    return w.to(device).contiguous()
