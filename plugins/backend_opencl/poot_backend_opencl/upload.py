"""A checkpoint's WeightStore -> OpenCL buffers, each weight in its stored layout (never widened).

Matrices (2-D) keep their format: f32, f16, bf16 bit patterns, GGUF blocks as stored. A 3-D stack of experts
([experts, rows, cols], GGUF's ffn_*_exps) is one buffer whose experts are row ranges. Vectors (norm scales,
biases) become f32: the kernels read them as f32 and they are a negligible share of the bytes (the CPU executor
widens them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from poot_core import PackedWeight, Reason, Unsupported, weight_kind

from .kernels.launch import Arr, DeviceWeight
from .kernels.ops import FORMATS, row_bytes
from .kernels.runtime import Runtime

DENSE_FORMATS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GGUF_TYPES = tuple(name for name in FORMATS if name not in DENSE_FORMATS.values())
WEIGHT_KINDS = frozenset(DENSE_FORMATS) | frozenset(f"gguf.{t}" for t in GGUF_TYPES)


@dataclass
class DeviceWeights:
    """Every weight of a store on the device, by the store's names. `stacks` holds 3-D expert stacks as
    [experts * rows, cols] matrices; `skipped` the weights this backend cannot place, with the reason, so a graph
    that uses one is refused by name at prepare time."""

    matrices: dict[str, DeviceWeight] = field(default_factory=dict)
    vectors: dict[str, Arr] = field(default_factory=dict)
    stacks: dict[str, tuple[int, DeviceWeight]] = field(default_factory=dict)  # name -> (experts, all rows)
    skipped: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        buffers = {id(w.buf): w.buf.size for w in (*self.matrices.values(), *(s for _, s in self.stacks.values()))}
        return sum(buffers.values()) + sum(v.buf.size for v in self.vectors.values())


def _host(name: str, w: Any) -> tuple[np.ndarray, str]:
    """A weight as host bytes in its stored format (bf16 as its 16-bit patterns, GGUF as block bytes)."""
    kind = weight_kind(w)
    if isinstance(w, PackedWeight):
        gguf_type = w.meta.get("type")
        if w.layout != "gguf" or gguf_type not in GGUF_TYPES or "blocks" not in w.parts:
            raise Unsupported(Reason.QUANTIZATION, f"{kind} (tensor {name})",
                              f"the opencl backend computes from f32, f16, bf16 and GGUF {', '.join(GGUF_TYPES)}")
        return w.parts["blocks"].detach().cpu().contiguous().numpy().view(np.uint8), gguf_type
    if kind not in DENSE_FORMATS:
        raise Unsupported(Reason.QUANTIZATION, f"{kind} (tensor {name})",
                          "the opencl backend computes from f32, f16 and bf16 dense weights and GGUF blocks")
    fmt = DENSE_FORMATS[kind]
    t = w.detach().cpu().contiguous()
    if fmt == "bf16":  # numpy has no bfloat16: keep the bit patterns
        t = t.view(torch.int16)
    return t.numpy().view(np.uint8), fmt


def upload_matrix(runtime: Runtime, data: np.ndarray, fmt: str, rows: int, cols: int) -> DeviceWeight:
    values = FORMATS[fmt][0]
    if cols % values:
        raise Unsupported(Reason.SHAPE, f"{fmt} rows of {cols}", f"{fmt} rows are whole blocks of {values}")
    nbytes = rows * row_bytes(fmt, cols)
    if data.size != nbytes:
        raise Unsupported(Reason.SHAPE, fmt, f"expected {nbytes} bytes for {rows}x{cols}, got {data.size}")
    return DeviceWeight(runtime.upload(data.reshape(-1)), fmt, rows, cols, row_bytes(fmt, cols))


def upload_store(runtime: Runtime, store: Any) -> DeviceWeights:
    out = DeviceWeights()
    for name in store.names():
        w = store.get(name)
        shape = tuple(int(s) for s in w.shape)
        if len(shape) == 1:
            if isinstance(w, PackedWeight):
                out.skipped[name] = f"a packed vector {weight_kind(w)}"
            else:
                out.vectors[name] = Arr(runtime.upload(w.detach().cpu().float().numpy().reshape(-1)), shape)
            continue
        if len(shape) not in (2, 3):
            out.skipped[name] = f"a {len(shape)}-D tensor {shape}"
            continue
        data, fmt = _host(name, w)
        cols = shape[-1]
        rows = int(np.prod(shape[:-1]))
        try:
            matrix = upload_matrix(runtime, data, fmt, rows, cols)
        except Unsupported as exc:
            out.skipped[name] = str(exc)
            continue
        if len(shape) == 2:
            out.matrices[name] = matrix
        else:
            out.stacks[name] = (shape[0], matrix)
    return out
