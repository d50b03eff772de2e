"""A checkpoint's WeightStore -> device buffers, each weight kept in its stored layout.

Matrices (2-D) become row-chunked `DeviceWeight`s in their own format (f32, f16, bf16 bit patterns, GGUF
blocks). Vectors (norm scales, biases) become f32 `DeviceArray`s: the kernels read them as f32 and they are
a negligible share of the bytes (the CPU executor widens them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from poot_core import PackedWeight, Reason, Unsupported, weight_kind

from .kernels.runtime import DeviceArray, Runtime
from .kernels.weights import FORMATS, DeviceWeight, upload_weight

DENSE_FORMATS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GGUF_TYPES = tuple(name for name in FORMATS if name.startswith("Q"))
WEIGHT_KINDS = frozenset(DENSE_FORMATS) | frozenset(f"gguf.{t}" for t in GGUF_TYPES)


@dataclass
class DeviceWeights:
    """Every weight of a store on the device, by the store's names. `skipped` holds the weights this
    backend cannot place (say a 3-D expert stack) with the reason, so a graph that uses one is refused
    by name at prepare time instead of the whole upload failing."""

    matrices: dict[str, DeviceWeight] = field(default_factory=dict)
    vectors: dict[str, DeviceArray] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = sum(c.buffer.size for w in self.matrices.values() for c in w.chunks)
        return total + sum(v.buffer.size for v in self.vectors.values())


def _host_dense(w: torch.Tensor) -> tuple[np.ndarray, str]:
    fmt = DENSE_FORMATS[str(w.dtype).removeprefix("torch.")]
    w = w.detach().contiguous()
    if fmt == "bf16":  # numpy has no bfloat16: keep the 16-bit patterns as they are
        return w.view(torch.int16).numpy().view(np.uint16), fmt
    return w.numpy(), fmt


def _vector(runtime: Runtime, w: torch.Tensor) -> DeviceArray:
    return runtime.upload(w.detach().float().contiguous().numpy().reshape(-1))


def upload_store(runtime: Runtime, store: Any) -> DeviceWeights:
    out = DeviceWeights()
    for name in store.names():
        w = store.get(name)
        kind = weight_kind(w)
        if isinstance(w, PackedWeight):
            gguf_type = w.meta.get("type")
            if w.layout != "gguf" or gguf_type not in GGUF_TYPES or "blocks" not in w.parts:
                raise Unsupported(
                    Reason.QUANTIZATION,
                    f"{kind} (tensor {name})",
                    f"the vulkan backend computes from f32, f16, bf16 and GGUF {', '.join(GGUF_TYPES)}",
                )
            blocks = w.parts["blocks"].detach().contiguous().numpy()
            out.matrices[name] = upload_weight(runtime, blocks, gguf_type, (w.shape[0], w.shape[1]))
            continue
        if kind not in DENSE_FORMATS:
            raise Unsupported(
                Reason.QUANTIZATION,
                f"{kind} (tensor {name})",
                "the vulkan backend computes from f32, f16 and bf16 dense weights",
            )
        if w.dim() == 1:
            out.vectors[name] = _vector(runtime, w)
        elif w.dim() == 2:
            data, fmt = _host_dense(w)
            out.matrices[name] = upload_weight(runtime, data, fmt, tuple(w.shape))
        else:
            out.skipped[name] = f"a {w.dim()}-D {kind} tensor {tuple(w.shape)}"
    return out
