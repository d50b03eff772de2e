"""Hostile GGUF files against poot's reader (poot_core/checkpoint/gguf_file.py).

Two parts:
- a table of hand-made hostile files, each of which must end in a CheckpointError naming the file and an
  offset, quickly and without a large allocation;
- hypothesis fuzzing that is aware of the file's structure: files written by gguf.GGUFWriter, then a count,
  length, dimension, type id or offset field set to an extreme value, or the file truncated or bytes
  overwritten. Every outcome is a successful open (then every tensor reads and every decodable one
  dequantizes) or a PootError, within a time budget.
(test_fuzz_checkpoints.py fuzzes with blind byte mutations; this file aims at the fields a parser trusts.)
"""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.fuzz import BUDGET_S, outcome
from helpers.gguf_edit import finish_gguf
from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.errors import CheckpointError

MEMORY_BUDGET = 16 << 20  # bytes of Python allocations one open of a tiny file may make
EXTREMES = [0, 1, 7, 31, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


# A GGUF writer by hand, which records where each integer field sits so the tests can aim at it.


class Builder:
    def __init__(self) -> None:
        self.out = bytearray()
        self.fields: list[tuple[int, int]] = []  # (offset, size) of every count/length/dim/type/offset field

    def u32(self, v: int, field: bool = True) -> None:
        if field:
            self.fields.append((len(self.out), 4))
        self.out += struct.pack("<I", v)

    def u64(self, v: int, field: bool = True) -> None:
        if field:
            self.fields.append((len(self.out), 8))
        self.out += struct.pack("<Q", v)

    def string(self, s: str | bytes, length: int | None = None) -> None:
        raw = s.encode() if isinstance(s, str) else s
        self.u64(len(raw) if length is None else length)
        self.out += raw


def build(
    kvs: list[tuple[str, int, bytes]] | None = None,
    tensors: list[tuple[str, tuple[int, ...], int, int]] | None = None,
    data: bytes = b"",
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
    alignment: int = 32,
) -> Builder:
    """kvs: (key, value type, encoded value); tensors: (name, ggml dims, type id, offset from the data start)."""
    kvs = kvs if kvs is not None else [("general.architecture", 8, struct.pack("<Q", 5) + b"llama")]
    tensors = tensors if tensors is not None else [("t", (32, 2), 0, 0)]
    b = Builder()
    b.out += magic
    b.u32(version)
    b.u64(len(tensors) if n_tensors is None else n_tensors)
    b.u64(len(kvs) if n_kv is None else n_kv)
    for key, kind, value in kvs:
        b.string(key)
        b.u32(kind)
        b.out += value
    for name, dims, type_id, offset in tensors:
        b.string(name)
        b.u32(len(dims))
        for d in dims:
            b.u64(d)
        b.u32(type_id)
        b.u64(offset)
    b.out += bytes(-len(b.out) % alignment)
    b.out += data if data else bytes(256)
    return b


def _f32_tensors() -> list[tuple[str, tuple[int, ...], int, int]]:
    return [("a", (32, 1), 0, 0), ("b", (32, 1), 0, 128)]


HOSTILE: dict[str, Callable[[], bytes]] = {
    "bad magic": lambda: bytes(build(magic=b"GGUX").out),
    "unknown version": lambda: bytes(build(version=99).out),
    "absurd metadata count": lambda: bytes(build(n_kv=2**63).out),
    "absurd tensor count": lambda: bytes(build(n_tensors=2**62).out),
    "metadata count past the end": lambda: bytes(build(n_kv=5).out),
    "absurd key length": lambda: bytes(
        build(kvs=[("k", 4, struct.pack("<I", 1))]).out[:24] + struct.pack("<Q", 2**62) + b"k" * 64
    ),
    "absurd string value length": lambda: bytes(build(kvs=[("k", 8, struct.pack("<Q", 2**63) + b"abc")]).out),
    "absurd array count": lambda: bytes(build(kvs=[("k", 9, struct.pack("<IQ", 4, 2**61) + bytes(16))]).out),
    "absurd string array count": lambda: bytes(build(kvs=[("k", 9, struct.pack("<IQ", 8, 2**40))]).out),
    "arrays nested too deep": lambda: bytes(
        build(kvs=[("k", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1))]).out
    ),
    "unknown metadata type": lambda: bytes(build(kvs=[("k", 77, bytes(8))]).out),
    "unknown array item type": lambda: bytes(build(kvs=[("k", 9, struct.pack("<IQ", 77, 1) + bytes(8))]).out),
    "key not UTF-8": lambda: bytes(build(kvs=[(b"\xff\xfe".decode("latin-1"), 4, bytes(4))]).out).replace(
        "ÿþ".encode(), b"\xff\xfe"
    ),
    "duplicate key": lambda: bytes(build(kvs=[("k", 4, bytes(4)), ("k", 4, bytes(4))]).out),
    "too many dimensions": lambda: bytes(build(tensors=[("t", (1,) * 9, 0, 0)]).out),
    "absurd dimensions": lambda: bytes(build(tensors=[("t", (2**40, 2**40), 0, 0)]).out),
    "dimensions whose product overflows 64 bits": lambda: bytes(build(tensors=[("t", (2**63, 2**63, 4), 0, 0)]).out),
    "unknown tensor type id": lambda: bytes(build(tensors=[("t", (32, 2), 200, 0)]).out),
    "row not a whole number of blocks": lambda: bytes(build(tensors=[("t", (33, 2), 2, 0)]).out),
    "data past the end": lambda: bytes(build(tensors=[("t", (32, 2), 0, 2**50)]).out),
    "misaligned data": lambda: bytes(build(tensors=[("t", (4,), 0, 3)]).out),
    "overlapping tensors": lambda: bytes(build(tensors=[("a", (32, 2), 0, 0), ("b", (32, 1), 0, 128)]).out),
    "duplicate tensor name": lambda: bytes(build(tensors=[("a", (32, 1), 0, 0), ("a", (32, 1), 0, 128)]).out),
    "truncated inside the tensor infos": lambda: bytes(build(tensors=_f32_tensors()).out[:80]),
    "truncated tensor data": lambda: bytes(build(tensors=_f32_tensors()).out[:-200]),
}


def _open_all(path: Path) -> None:
    f = GGUFFile.open(path)
    for name in f.tensor_names():
        t = f.tensor(name)
        if isinstance(t, PackedWeight):
            dequantize(t)
        else:
            t.sum()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_a_checkpoint_error_with_name_and_offset(tmp_path: Path, case: str) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[case]())
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as err:
            _open_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < BUDGET_S
    assert peak < MEMORY_BUDGET
    assert str(path) in str(err.value) and err.value.path == str(path)
    assert err.value.offset is not None and 0 <= err.value.offset <= path.stat().st_size, str(err.value)


def test_the_table_builder_makes_readable_files(tmp_path: Path) -> None:
    """The hostile cases differ from a valid file only in the field they break: the valid one opens."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(bytes(build(tensors=_f32_tensors()).out))
    f = GGUFFile.open(path)
    assert f.metadata["general.architecture"] == "llama"
    assert f.tensor("b").shape == (1, 32)


def test_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "align.gguf"
    path.write_bytes(bytes(build(kvs=[("general.alignment", 4, struct.pack("<I", 24))]).out))
    with pytest.raises(CheckpointError) as err:
        GGUFFile.open(path)
    assert str(path) in str(err.value) and "alignment" in str(err.value)


# Structure-aware fuzzing of files written by gguf.GGUFWriter.


def writer_file(path: Path) -> bytes:
    rng = np.random.default_rng(1)
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tensor("norm", np.ones(16, dtype=np.float32))
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        q = quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype)
        w.add_tensor(f"w_{qtype.name}", q, raw_dtype=qtype)
    w.add_tensor("h", rng.standard_normal((3, 8)).astype(np.float16))
    finish_gguf(w)
    return path.read_bytes()


def header_fields(raw: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every integer field in the header of a valid file, found by walking it."""
    fields: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", raw, pos)[0]

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        kind = struct.unpack_from("<I", raw, pos)[0]
        pos += 4
        if kind == 8:
            string()
        elif kind == 9:
            fields += [(pos, 4), (pos + 4, 8)]
            item, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            for _ in range(count):
                if item == 8:
                    string()
                else:
                    pos += sizes[item]
        else:
            pos += sizes[kind]
    for _ in range(n_tensors):
        string()
        fields.append((pos, 4))
        n_dims = struct.unpack_from("<I", raw, pos)[0]
        pos += 4
        fields += [(pos + 8 * i, 8) for i in range(n_dims)]
        pos += 8 * n_dims
        fields += [(pos, 4), (pos + 4, 8)]
        pos += 12
    return fields


_VALID: dict[str, bytes] = {}


def _valid(tmp: Path) -> bytes:
    if "raw" not in _VALID:
        _VALID["raw"] = writer_file(tmp / "valid.gguf")
    return _VALID["raw"]


def test_field_walker_matches_the_writer(tmp_path: Path) -> None:
    raw = _valid(tmp_path)
    fields = header_fields(raw)
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    assert (n_tensors, n_kv) == (4, 5)  # general.architecture is added by the writer
    assert len(fields) > 3 + 2 * n_kv + 4 * n_tensors
    assert outcome(_open_all, _write(tmp_path, raw)) == "ok"


def _write(tmp: Path, raw: bytes) -> Path:
    path = tmp / "fuzz.gguf"
    path.write_bytes(raw)
    return path


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_header_fields(tmp_path: Path, data: st.DataObject) -> None:
    raw = bytearray(_valid(tmp_path))
    fields = header_fields(bytes(raw))
    for _ in range(data.draw(st.integers(1, 3))):
        at, size = data.draw(st.sampled_from(fields))
        top = 2 ** (8 * size) - 1
        value = data.draw(st.one_of(st.sampled_from([v for v in EXTREMES if v <= top]), st.integers(0, top)))
        raw[at : at + size] = value.to_bytes(size, "little")
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    outcome(_open_all, _write(tmp_path, bytes(raw)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_bytes_and_truncation(tmp_path: Path, data: st.DataObject) -> None:
    raw = bytearray(_valid(tmp_path))
    header_end = max(a + s for a, s in header_fields(bytes(raw)))
    for _ in range(data.draw(st.integers(0, 6))):
        at = data.draw(st.integers(0, header_end + 64))  # mostly the header, where the parser trusts bytes
        chunk = data.draw(st.binary(min_size=1, max_size=8))
        raw[at : at + len(chunk)] = chunk
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    outcome(_open_all, _write(tmp_path, bytes(raw if cut is None else raw[:cut])))
