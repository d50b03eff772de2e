"""A .safetensors file, parsed by poot itself over a read-only memory map.

Layout: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, ...,
"__metadata__": {...}}, then the data section. Every claim of the header is checked against the file before
any tensor is made: a lying or truncated file is a CheckpointError naming the file and the byte offset, and
nothing is read or allocated in proportion to what the header merely claims.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poot_core.errors import CheckpointError, MissingTensor

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit
MAX_DIMS = 8


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


@dataclass(eq=False, repr=False)
class SafetensorsFile:
    path: Path
    _entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    _data_start: int
    _buffer: mmap.mmap | None

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsFile:
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(path, "shorter than the 8-byte header length", 0)
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or 8 + n > size:
                    raise CheckpointError(path, f"header length {n} runs past the end of the {size}-byte file", 0)
                raw = f.read(n)
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        except OSError as exc:
            raise CheckpointError(path, f"cannot read: {exc}") from exc
        try:
            header = json.loads(raw, object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError) as exc:  # also bad UTF-8, duplicate keys, absurd numbers, deep nesting
            raise CheckpointError(path, f"header is not JSON: {exc}", 8) from exc
        if not isinstance(header, dict):
            raise CheckpointError(path, "header is not a JSON object", 8)
        data_start = 8 + n
        entries, metadata = _validate(path, header, size - data_start, data_start)
        return cls(path, entries, metadata, data_start, buffer)

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise MissingTensor(self.path, f"no tensor named {name!r}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy, read-only view of the stored tensor, in its stored dtype."""
        dtype, shape, begin, end = self._entry(name)
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        assert self._buffer is not None
        with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about that
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self._buffer, dtype=dtype, count=(end - begin) // _itemsize(dtype), offset=self._data_start + begin
            )
        return flat.view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _validate(
    path: Path, header: dict[str, Any], data_size: int, data_start: int
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "__metadata__ is not an object of strings", 8)
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(path, f"tensor {name!r}: entry is not an object", 8)
        dtype = DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise CheckpointError(path, f"tensor {name!r}: unknown dtype {info.get('dtype')!r}", 8)
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CheckpointError(path, f"tensor {name!r}: bad shape {shape!r}", 8)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(path, f"tensor {name!r}: bad data_offsets {offsets!r}", 8)
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                path,
                f"tensor {name!r}: data [{begin}, {end}) lies outside the {data_size}-byte data section",
                data_start + min(max(begin, 0), data_size),
            )
        if math.prod(shape) * _itemsize(dtype) != end - begin:
            raise CheckpointError(
                path,
                f"tensor {name!r}: shape {shape} of {info['dtype']} needs "
                f"{math.prod(shape) * _itemsize(dtype)} bytes but its offsets hold {end - begin}",
                data_start + begin,
            )
        entries[name] = (dtype, tuple(shape), begin, end)
    spans = sorted((b, e, n) for n, (_, _, b, e) in entries.items() if e > b)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CheckpointError(path, f"tensors {n0!r} and {n1!r} overlap", data_start + b1)
    return entries, metadata
