"""Weight matrices on the device, kept in their stored layout and split into row-chunks.

A chunk is one buffer of whole rows no larger than the runtime's storage binding limit, so a matrix
larger than one binding (a big vocabulary head) becomes several bindings and dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from poot_core.errors import CapacityError, Reason, Unsupported

from .runtime import Runtime


@dataclass(frozen=True)
class WeightFormat:
    name: str
    block_values: int  # values per block along a row
    block_bytes: int  # bytes per block
    shader: str  # the wgsl file holding its decode_unit
    helpers: tuple[str, ...] = ()  # wgsl files its decode_unit calls into (after bytes.wgsl)

    def sources(self) -> tuple[str, ...]:
        return (*self.helpers, self.shader)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_values * self.block_bytes


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("f32", 1, 4, "fmt_f32"),
        WeightFormat("f16", 1, 2, "fmt_f16"),
        WeightFormat("bf16", 1, 2, "fmt_bf16"),
        WeightFormat("Q4_0", 32, 18, "fmt_q4_0"),
        WeightFormat("Q4_1", 32, 20, "fmt_q4_1"),
        WeightFormat("Q8_0", 32, 34, "fmt_q8_0"),
        WeightFormat("Q5_0", 32, 22, "fmt_q5_0"),
        WeightFormat("Q5_1", 32, 24, "fmt_q5_1"),
        WeightFormat("IQ4_NL", 32, 18, "fmt_iq4_nl", ("iq4_values",)),
        WeightFormat("Q2_K", 256, 84, "fmt_q2_k"),
        WeightFormat("Q3_K", 256, 110, "fmt_q3_k"),
        WeightFormat("Q4_K", 256, 144, "fmt_q4_k", ("kscale",)),
        WeightFormat("Q5_K", 256, 176, "fmt_q5_k", ("kscale",)),
        WeightFormat("Q6_K", 256, 210, "fmt_q6_k"),
        WeightFormat("IQ4_XS", 256, 136, "fmt_iq4_xs", ("iq4_values",)),
    )
}
_HOST_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


@dataclass
class WeightChunk:
    """Rows row_start .. row_start+rows of the matrix, held in `buffer` from its row `first_row` on (a
    matrix stored inside a concatenation of several starts past row 0 of the shared buffer)."""

    row_start: int
    rows: int
    buffer: Any
    first_row: int = 0


@dataclass
class DeviceWeight:
    """A [rows, cols] matrix in format `fmt`, stored as row-chunks."""

    fmt: WeightFormat
    rows: int
    cols: int
    chunks: list[WeightChunk]


def weight_format(name: str) -> WeightFormat:
    found = FORMATS.get(name)
    if found is None:
        raise Unsupported(Reason.QUANTIZATION, name, f"the Vulkan kernels read {', '.join(FORMATS)}")
    return found


def upload_weight(runtime: Runtime, data: np.ndarray, fmt: str, shape: tuple[int, int]) -> DeviceWeight:
    """Place a weight matrix on the device without widening it.

    data: f32 -> float32 [rows, cols]; f16 -> float16 [rows, cols]; bf16 -> uint16 bit patterns
    [rows, cols]; GGUF types -> uint8 [rows, bytes_per_row] exactly as stored in the file.
    """
    form = weight_format(fmt)
    rows, cols = int(shape[0]), int(shape[1])
    if cols % form.block_values:
        raise Unsupported(Reason.SHAPE, fmt, f"row length {cols} is not a multiple of {form.block_values}")
    row_bytes = form.row_bytes(cols)
    expected_dtype = _HOST_DTYPES.get(fmt, np.uint8)
    if data.dtype != expected_dtype or data.size * data.itemsize != rows * row_bytes:
        raise Unsupported(
            Reason.SHAPE,
            fmt,
            f"expected {np.dtype(expected_dtype).name} data of {rows * row_bytes} bytes for {rows}x{cols}, "
            f"got {data.dtype.name} of {data.size * data.itemsize} bytes",
        )
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(rows, row_bytes)
    rows_per_chunk = runtime.max_binding_bytes // row_bytes
    if rows_per_chunk == 0:
        raise CapacityError(
            f"one {fmt} row of {row_bytes} bytes exceeds the storage binding limit {runtime.max_binding_bytes}"
        )
    chunks = [
        WeightChunk(start, min(rows_per_chunk, rows - start), runtime.raw_upload(flat[start : start + rows_per_chunk]))
        for start in range(0, rows, rows_per_chunk)
    ]
    return DeviceWeight(form, rows, cols, chunks)


@dataclass
class ExpertStack:
    """Every expert's matrices of one MoE layer in one matrix, expert after expert (each expert's parts, say
    gate then up, one after another: `per_expert` rows). Its chunks hold whole experts, `experts_per_chunk`
    each, so one binding reaches any row of the experts it holds."""

    weight: DeviceWeight
    experts: int
    part_rows: tuple[int, ...]
    experts_per_chunk: int

    @property
    def per_expert(self) -> int:
        return sum(self.part_rows)

    def chunk_experts(self) -> list[tuple[WeightChunk, int, int]]:
        """(chunk, first expert, one past its last expert) per chunk."""
        return [(c, c.row_start // self.per_expert, (c.row_start + c.rows) // self.per_expert)
                for c in self.weight.chunks]


def upload_stack(runtime: Runtime, experts: list[list[np.ndarray]], fmt: str, cols: int) -> ExpertStack | None:
    """Stack the experts' matrices (experts[e] = that expert's parts as upload_weight takes them, all of one
    format and row length) in chunks of whole experts. None when one expert exceeds a binding: the caller
    keeps the matrices apart then."""
    form = weight_format(fmt)
    row_bytes = form.row_bytes(cols)
    part_rows = tuple(int(part.size * part.itemsize // row_bytes) for part in experts[0])
    per_expert = sum(part_rows)
    per_chunk = runtime.max_binding_bytes // (per_expert * row_bytes)
    if per_chunk == 0 or cols % form.block_values:
        return None
    chunks = []
    for first in range(0, len(experts), per_chunk):
        group = experts[first : first + per_chunk]
        data = np.concatenate([np.ascontiguousarray(part).view(np.uint8).reshape(-1, row_bytes)
                               for parts in group for part in parts])
        chunks.append(WeightChunk(first * per_expert, data.shape[0], runtime.raw_upload(data)))
    weight = DeviceWeight(form, len(experts) * per_expert, cols, chunks)
    return ExpertStack(weight, len(experts), part_rows, per_chunk)


def row_range(weight: DeviceWeight, start: int, stop: int) -> DeviceWeight:
    """Rows start..stop of `weight` as a matrix of its own, sharing its buffers (no copy)."""
    chunks = []
    for chunk in weight.chunks:
        lo, hi = max(start, chunk.row_start), min(stop, chunk.row_start + chunk.rows)
        if lo < hi:
            chunks.append(WeightChunk(lo - start, hi - lo, chunk.buffer, chunk.first_row + lo - chunk.row_start))
    return DeviceWeight(weight.fmt, stop - start, weight.cols, chunks)
