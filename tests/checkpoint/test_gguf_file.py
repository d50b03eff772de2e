"""poot's own GGUF reader: equal to what gguf.GGUFWriter wrote on good files, typed errors on broken ones."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from helpers.gguf_edit import finish_gguf
from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.errors import CheckpointError, Reason, Unsupported

SCALARS = {
    "u8": 7,
    "i8": -3,
    "u16": 65000,
    "i16": -1234,
    "u32": 4_000_000_000,
    "i32": -2_000_000_000,
    "f32": 1.5,
    "bool": True,
    "u64": 2**60,
    "i64": -(2**60),
    "f64": 0.1,
}


def write_good(path, seed: int = 0) -> dict:
    """A small GGUF with every metadata value type and dense, quantized and 1-D tensors; returns what went in."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", SCALARS["u8"])
    w.add_int8("t.i8", SCALARS["i8"])
    w.add_uint16("t.u16", SCALARS["u16"])
    w.add_int16("t.i16", SCALARS["i16"])
    w.add_uint32("t.u32", SCALARS["u32"])
    w.add_int32("t.i32", SCALARS["i32"])
    w.add_float32("t.f32", SCALARS["f32"])
    w.add_bool("t.bool", SCALARS["bool"])
    w.add_uint64("t.u64", SCALARS["u64"])
    w.add_int64("t.i64", SCALARS["i64"])
    w.add_float64("t.f64", SCALARS["f64"])
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.floats", [0.5, -2.0])
    tensors = {
        "dense.f32": rng.standard_normal((3, 8)).astype(np.float32),
        "dense.f16": rng.standard_normal((4, 16)).astype(np.float16),
        "norm": rng.standard_normal(64).astype(np.float32),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    q41 = quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    w.add_tensor("blk.q4_1", q41, raw_dtype=GGMLQuantizationType.Q4_1)
    q80 = quants.quantize(rng.standard_normal(96).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("vec.q8_0", q80, raw_dtype=GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, size=(2, 144), dtype=np.uint8)
    q4k[:, 0:4] = rng.uniform(-0.1, 0.1, size=(2, 2)).astype(np.float16).view(np.uint8)
    w.add_tensor("blk.q4_k", q4k, raw_dtype=GGMLQuantizationType.Q4_K)
    finish_gguf(w)
    return {**tensors, "blk.q4_1": q41, "vec.q8_0": q80, "blk.q4_k": q4k}


def test_metadata_and_tensors_round_trip(tmp_path) -> None:
    path = tmp_path / "good.gguf"
    written = write_good(path)
    f = GGUFFile.open(path)
    for key, value in SCALARS.items():
        got = f.metadata[f"t.{key}"]
        assert got == pytest.approx(value, rel=1e-7) and type(got) is type(value)
    assert f.metadata["t.str"] == "héllo ✓"
    assert f.metadata["t.ints"] == [1, 2, 3] and f.metadata["t.strs"] == ["a", "", "ünï"]
    assert f.metadata["t.floats"] == [0.5, -2.0]
    assert f.metadata["general.architecture"] == "llama"
    ref = GGUFReader(str(path))
    assert sorted(f.tensor_names()) == sorted(t.name for t in ref.tensors)
    for t in ref.tensors:
        info = f.tensor_info(t.name)
        assert info.type_name == t.tensor_type.name and info.nbytes == t.n_bytes
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.offset == t.data_offset
    for name in ("dense.f32", "dense.f16", "norm"):
        got = f.tensor(name)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.from_numpy(written[name]).dtype
        assert torch.equal(got, torch.from_numpy(written[name]))
    q = f.tensor("blk.q4_1")
    assert isinstance(q, PackedWeight) and q.shape == (6, 64) and q.meta == {"type": "Q4_1"}
    assert q.parts["blocks"].shape == (6, 40) and np.array_equal(q.parts["blocks"].numpy(), written["blk.q4_1"])
    np.testing.assert_array_equal(
        dequantize(q).numpy(), quants.dequantize(written["blk.q4_1"], GGMLQuantizationType.Q4_1)
    )
    v = f.tensor("vec.q8_0")
    assert isinstance(v, PackedWeight) and v.shape == (96,)
    np.testing.assert_array_equal(
        dequantize(v).numpy(), quants.dequantize(written["vec.q8_0"], GGMLQuantizationType.Q8_0)
    )
    k = f.tensor("blk.q4_k")
    assert k.shape == (2, 256)
    np.testing.assert_array_equal(
        dequantize(k).numpy(), quants.dequantize(written["blk.q4_k"], GGMLQuantizationType.Q4_K)
    )


def test_tensors_are_zero_copy_views_of_the_mapping(tmp_path) -> None:
    path = tmp_path / "good.gguf"
    write_good(path)
    f = GGUFFile.open(path)
    a, b = f.tensor("dense.f32"), f.tensor("dense.f32")
    assert a.data_ptr() == b.data_ptr()  # the same mapped bytes, no copy per call
    blocks = f.tensor("blk.q4_1").parts["blocks"]
    assert blocks.data_ptr() == f.tensor("blk.q4_1").parts["blocks"].data_ptr()


def test_type_poot_cannot_compute_opens_but_refuses_the_tensor(tmp_path) -> None:
    path = tmp_path / "iq2.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("odd", np.zeros((1, 66), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.add_tensor("ok", np.ones(4, dtype=np.float32))
    finish_gguf(w)
    f = GGUFFile.open(path)
    assert f.tensor_info("odd").type_name == "IQ2_XXS"
    assert torch.equal(f.tensor("ok"), torch.ones(4))
    with pytest.raises(Unsupported) as err:
        f.tensor("odd")
    assert err.value.reason == Reason.QUANTIZATION and err.value.name == "IQ2_XXS (tensor odd)"


def test_unknown_tensor_name_is_typed(tmp_path) -> None:
    path = tmp_path / "good.gguf"
    write_good(path)
    with pytest.raises(CheckpointError, match="nope"):
        GGUFFile.open(path).tensor("nope")


# -- hand-made broken files ------------------------------------------------------------------------------------


def gstr(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + struct.pack("<II", 4, value)


def tinfo(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", type_id, offset)
    )


def with_data(head: bytes, data: bytes) -> bytes:
    return head + b"\0" * (-len(head) % 32) + data


F32 = 0
CASES = {
    "short": b"GGU",
    "bad magic": b"GGML" + b"\0" * 30,
    "bad version": header(0, 0, version=9),
    "absurd kv count": header(0, 2**62),
    "absurd tensor count": header(2**62, 0),
    "absurd string length": header(0, 1) + struct.pack("<Q", 2**62) + b"k",
    "key not utf8": header(0, 1) + gstr(b"\xff\xfe") + struct.pack("<II", 4, 1),
    "unknown value type": header(0, 1) + gstr("k") + struct.pack("<I", 99) + b"\0" * 8,
    "unknown array item type": header(0, 1) + gstr("k") + struct.pack("<IIQ", 9, 77, 1) + b"\0" * 8,
    "absurd array length": header(0, 1) + gstr("k") + struct.pack("<IIQ", 9, 4, 2**61),
    "absurd string array": header(0, 1) + gstr("k") + struct.pack("<IIQ", 9, 8, 2**40),
    "deep arrays": header(0, 1)
    + gstr("k")
    + struct.pack("<IIQ", 9, 9, 1)
    + struct.pack("<IQ", 9, 1)
    + struct.pack("<IQ", 9, 1)
    + struct.pack("<IQ", 4, 0),
    "duplicate key": header(0, 2) + kv_u32("k", 1) + kv_u32("k", 2),
    "bad alignment": header(0, 1) + kv_u32("general.alignment", 3),
    "too many dims": header(1, 0) + tinfo("t", (1, 1, 1, 1, 1), F32, 0),
    "absurd dims": with_data(header(1, 0) + tinfo("t", (2**40, 2**40), F32, 0), b"\0" * 64),
    "unknown tensor type": with_data(header(1, 0) + tinfo("t", (4,), 200, 0), b"\0" * 16),
    "tensor past end": with_data(header(1, 0) + tinfo("t", (64,), F32, 0), b"\0" * 16),
    "offset past end": with_data(header(1, 0) + tinfo("t", (4,), F32, 2**63), b"\0" * 16),
    "misaligned": with_data(header(1, 0) + tinfo("t", (4,), F32, 4), b"\0" * 64),
    "overlap": with_data(header(2, 0) + tinfo("a", (16,), F32, 0) + tinfo("b", (16,), F32, 32), b"\0" * 128),
    "duplicate tensor": with_data(header(2, 0) + tinfo("a", (4,), F32, 0) + tinfo("a", (4,), F32, 32), b"\0" * 64),
    "partial block": with_data(header(1, 0) + tinfo("t", (48,), 2, 0), b"\0" * 64),  # Q4_0 rows hold 32s
    "truncated tensor info": header(1, 0) + gstr("t") + struct.pack("<I", 2) + struct.pack("<Q", 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_files_are_checkpoint_errors(tmp_path, case: str) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(CASES[case])
    with pytest.raises(CheckpointError) as err:
        GGUFFile.open(path)
    assert "broken.gguf" in str(err.value) and err.value.path == str(path)
    assert isinstance(err.value.offset, int) and 0 <= err.value.offset <= max(len(CASES[case]), 2**63)


def test_every_truncation_of_a_good_file_is_typed(tmp_path) -> None:
    good = tmp_path / "good.gguf"
    write_good(good)
    raw = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in list(range(0, 400, 3)) + list(range(400, len(raw), 97)):
        cut.write_bytes(raw[:n])
        with pytest.raises(CheckpointError) as err:
            GGUFFile.open(cut)
        assert err.value.offset is not None or n < 24, n
