"""poot's own safetensors parser: equal to the reference library on good files, typed errors on bad ones."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from poot_core import CheckpointError, PootError
from poot_core.checkpoint.safetensors_file import SafetensorsFile


@pytest.fixture()
def good(tmp_path):
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).bfloat16(),
        "c": torch.arange(6, dtype=torch.int32),
        "e": torch.zeros(0, 3),
    }
    path = tmp_path / "good.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_matches_reference_and_keeps_dtype(good):
    ref = load_file(good)
    f = SafetensorsFile.open(good)
    assert set(f.names()) == set(ref)
    for name, t in ref.items():
        ours = f.tensor(name)
        assert ours.dtype == t.dtype and ours.shape == t.shape and torch.equal(ours, t)
    assert f.metadata == {"format": "pt"}


def _write(path, header: dict, data: bytes = b"", length: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _raw(path, data: bytes):
    path.write_bytes(data)
    return path


def _raw_header(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


CASES = {
    "truncated length": lambda p: _raw(p, b"\x01\x02"),
    "header past end": lambda p: _write(p, {}, length=10**9),
    "not json": lambda p: _raw(p, struct.pack("<Q", 3) + b"{x]"),
    "not an object": lambda p: _write(p, [1, 2]),  # type: ignore[arg-type]
    "unknown dtype": lambda p: _write(p, {"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "offsets past data": lambda p: _write(p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "size mismatch": lambda p: _write(p, {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16),
    "negative dim": lambda p: _write(p, {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
    "huge dims": lambda p: _write(
        p, {"t": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "duplicate name": lambda p: _raw_header(
        p,
        b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4,
    ),
    "deep nesting": lambda p: _raw_header(p, b"[" * 100_000 + b"]" * 100_000),
    "huge number": lambda p: _raw_header(
        p, b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', b"\0" * 4
    ),
    "dtype not a string": lambda p: _write(
        p, {"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "metadata not strings": lambda p: _write(p, {"__metadata__": {"a": 1}}),
    "bool dim": lambda p: _write(p, {"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
    "bad utf8": lambda p: _raw_header(p, b'{"\xff": 1}'),
    "overlap": lambda p: _write(
        p,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_files_are_checkpoint_errors(tmp_path, case):
    path = CASES[case](tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile.open(path)
    assert "bad.safetensors" in str(err.value) and isinstance(err.value.offset, int)


def test_unknown_name_is_typed_and_views_are_zero_copy(good):
    f = SafetensorsFile.open(good)
    with pytest.raises(CheckpointError, match="nope"):
        f.tensor("nope")
    assert f.tensor("a").data_ptr() == f.tensor("a").data_ptr()
    assert f.tensor("b").dtype == torch.bfloat16


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_files_fail_typed(tmp_path, data):
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": torch.ones(2, dtype=torch.bfloat16)}
    path = tmp_path / "fuzz.safetensors"
    save_file(tensors, path)
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    path.write_bytes(bytes(raw[:cut]))
    try:
        f = SafetensorsFile.open(path)
        for name in f.names():
            f.tensor(name).sum()
    except PootError:
        pass
