"""A GGUF file, parsed by poot itself over a read-only memory map.

Layout (little-endian): magic "GGUF", version u32 (2 or 3), tensor count u64, metadata count u64; the metadata
key/value pairs; the tensor infos (name, dims in ggml order, type, offset); then, aligned to
`general.alignment` (default 32), the tensor data. Every count, length and offset is checked against the bytes
that remain before it is used, so a hostile file costs bounded memory and time and ends in a CheckpointError
naming the file and the offset.
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.errors import CheckpointError, MissingTensor, Reason, Unsupported

MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 2
# Metadata value types: id -> (struct format, size) for scalars; 8 = string, 9 = array.
SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY = 8, 9
DENSE = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: the last dimension is the row (ggml's ne0)
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Reader:
    def __init__(self, path: Path, buf: memoryview) -> None:
        self.path, self.buf, self.pos = path, buf, 0
        self.reading = "the header"  # what is being read, for the messages

    def fail(self, message: str, at: int | None = None) -> CheckpointError:
        return CheckpointError(self.path, message, self.pos if at is None else at)

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated or corrupt GGUF: {self.reading} needs bytes {self.pos}..{self.pos + n}, "
                            f"the file has {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, kind: int) -> Any:
        fmt, size = SCALARS[kind]
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        start = self.pos
        n = self.u64()
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"string is not UTF-8 ({exc.reason})", start) from exc

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in SCALARS:
            return self.scalar(kind)
        if kind == STRING:
            return self.string()
        if kind == ARRAY and depth < MAX_ARRAY_DEPTH:
            start = self.pos
            item = self.u32()
            count = self.u64()
            if item in NUMPY:
                raw = self.take(count * SCALARS[item][1])  # bounds-checked before anything is allocated
                values = np.frombuffer(raw, dtype=NUMPY[item])
                return (values != 0).tolist() if item == 7 else values.tolist()
            if item not in (STRING, ARRAY):
                raise self.fail(f"unknown array item type {item}", start)
            if count * 8 > len(self.buf) - self.pos:  # every string or array takes at least 8 bytes
                raise self.fail(f"truncated or corrupt GGUF: {self.reading}, an array of {count} items, needs bytes "
                                f"{self.pos}..{self.pos + count * 8} at least, the file has {len(self.buf)}", start)
            return [self.value(item, depth + 1) for _ in range(count)]
        raise self.fail(f"unknown metadata value type {kind}", self.pos - 4)


@dataclass(eq=False, repr=False)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, TensorInfo]
    _buffer: mmap.mmap

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                if path.stat().st_size < 24:
                    raise CheckpointError(path, "too short to be a GGUF file", 0)
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CheckpointError(path, f"cannot read: {exc}") from exc
        r = _Reader(path, memoryview(buffer))
        if bytes(r.take(4)) != MAGIC:
            raise CheckpointError(path, "not a GGUF file (bad magic)", 0)
        version = r.u32()
        if version not in (2, 3):
            raise CheckpointError(path, f"unsupported GGUF version {version}", 4)
        n_tensors, n_kv = r.u64(), r.u64()
        if n_kv * 13 > len(r.buf) or n_tensors * 24 > len(r.buf):  # the smallest possible entries
            raise CheckpointError(
                path, f"claims {n_kv} metadata entries and {n_tensors} tensors, more than the file can hold", 8
            )
        metadata: dict[str, Any] = {}
        key_at: dict[str, int] = {}
        for _ in range(n_kv):
            at = r.pos
            r.reading = "a metadata key"
            key = r.string()
            r.reading = f"metadata value {key!r}"
            if key in metadata:
                raise CheckpointError(path, f"metadata key {key!r} appears twice", at)
            key_at[key] = at
            metadata[key] = r.value(r.u32())
        infos = [cls._tensor_info(r) for _ in range(n_tensors)]
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(
                path, f"general.alignment {alignment!r} is not a power of two", key_at["general.alignment"]
            )
        data_start = -(-r.pos // alignment) * alignment
        tensors = cls._place(path, infos, data_start, alignment, len(r.buf))
        return cls(path, metadata, tensors, buffer)

    @staticmethod
    def _tensor_info(r: _Reader) -> tuple[str, int, tuple[int, ...], int, int]:
        at = r.pos
        r.reading = "a tensor's name"
        name = r.string()
        r.reading = f"the description of tensor {name!r}"
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})", at)
        dims = tuple(r.u64() for _ in range(n_dims))
        type_id = r.u32()
        offset = r.u64()
        return name, type_id, dims, offset, at

    @staticmethod
    def _place(
        path: Path, infos: list[tuple[str, int, tuple[int, ...], int, int]], data_start: int, alignment: int, size: int
    ) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, type_id, dims, offset, at in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise CheckpointError(path, f"tensor {name!r} has unknown type id {type_id}", at) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = math.prod(dims)
            if dims and dims[0] % block:
                raise CheckpointError(
                    path,
                    f"tensor {name!r}: row of {dims[0]} is not a whole number of {qtype.name} blocks of {block}",
                    at,
                )
            nbytes = count // block * type_size
            start = data_start + offset
            if offset % alignment:
                raise CheckpointError(path, f"tensor {name!r}: offset {offset} is not a multiple of the "
                                            f"alignment {alignment}", at)
            if start + nbytes > size:
                raise CheckpointError(path, f"truncated GGUF: tensor {name!r} needs bytes {start}..{start + nbytes}, "
                                            f"the file has {size}", at)
            if name in tensors:
                raise CheckpointError(path, f"tensor {name!r} appears twice", at)
            tensors[name] = TensorInfo(name, qtype.name, tuple(reversed(dims)), start, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise CheckpointError(path, f"tensors {n0!r} and {n1!r} overlap", b1)
        return tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensor(self.path, f"no tensor named {name!r}") from None

    def tensor(self, name: str) -> torch.Tensor | PackedWeight:
        """Dense types as zero-copy tensors; block types as a PackedWeight over the mapped bytes."""
        info = self.tensor_info(name)
        with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about that
            warnings.simplefilter("ignore", UserWarning)
            raw = (
                torch.frombuffer(self._buffer, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
                if info.nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
        if info.type_name in DENSE:
            return raw.view(DENSE[info.type_name]).view(info.shape)
        from poot_core.checkpoint.quant import gguf_type_supported

        if not gguf_type_supported(info.type_name):
            raise Unsupported(
                Reason.QUANTIZATION, f"{info.type_name} (tensor {name})", "poot has no decoder for this GGUF block type"
            )
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return PackedWeight(
            "gguf", info.shape, {"blocks": raw.view(rows, info.nbytes // max(rows, 1))}, {"type": info.type_name}
        )
