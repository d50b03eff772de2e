"""Hypothesis fuzzing of both checkpoint parsers: mutated, truncated and spliced small files.

Every outcome is either a successful open (and then every tensor reads, and every computable GGUF tensor
dequantizes) or a PootError, within bounded time. A hunt of 3,000 examples per parser found no escaping
seed; any future one goes into the hostile-file tables of test_gguf_file.py / test_safetensors_file.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from helpers.fuzz import outcome
from helpers.gguf_edit import finish_gguf
from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.checkpoint.safetensors_file import SafetensorsFile
from poot_core.errors import PootError

EXAMPLES = int(os.environ.get("POOT_FUZZ_EXAMPLES", "200"))  # raise it for a longer hunt


def small_gguf(path) -> bytes:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    w.add_tensor("norm", np.ones(8, dtype=np.float32))
    q = quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), GGMLQuantizationType.Q4_1)
    w.add_tensor("q", q, raw_dtype=GGMLQuantizationType.Q4_1)
    w.add_tensor("h", rng.standard_normal((2, 4)).astype(np.float16))
    finish_gguf(w)
    return path.read_bytes()


def small_safetensors(path) -> bytes:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "v": torch.ones(2, dtype=torch.bfloat16),
        "i": torch.arange(3, dtype=torch.int64),
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return path.read_bytes()


def read_everything_gguf(path) -> None:
    f = GGUFFile.open(path)
    for name in f.tensor_names():
        try:
            t = f.tensor(name)
        except PootError:
            continue  # e.g. a block type that a mutation turned into one poot cannot compute
        if isinstance(t, PackedWeight):
            dequantize(t)
        else:
            t.float().sum()


def read_everything_safetensors(path) -> None:
    f = SafetensorsFile.open(path)
    for name in f.names():
        f.tensor(name).float().sum()


def mutate(data: st.DataObject, raw: bytes) -> bytes:
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 6), label="flips")):
        i = data.draw(st.integers(0, len(out) - 1))
        out[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans(), label="splice"):  # overwrite a word with an extreme little-endian integer
        i = data.draw(st.integers(0, len(out) - 8))
        word = data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 255, 2**40]))
        out[i : i + 8] = word.to_bytes(8, "little")
    cut = data.draw(st.integers(0, len(out)), label="cut")
    return bytes(out[:cut]) if data.draw(st.booleans(), label="truncate") else bytes(out)


# suffix -> (writes the valid file and returns its bytes, reads every tensor of a file)
FORMATS = {"gguf": (small_gguf, read_everything_gguf), "safetensors": (small_safetensors, read_everything_safetensors)}


@pytest.mark.parametrize("suffix", list(FORMATS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_file(tmp_path, suffix, data) -> None:
    write_valid, read_everything = FORMATS[suffix]
    good = tmp_path / f"good.{suffix}"
    raw = good.read_bytes() if good.exists() else write_valid(good)
    path = tmp_path / f"fuzz.{suffix}"
    path.write_bytes(mutate(data, raw))
    outcome(read_everything, path)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=512))
def test_fuzz_random_bytes_after_magic(raw: bytes) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.gguf"
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + raw)
        outcome(read_everything_gguf, path)
        path = Path(d) / "r.safetensors"
        path.write_bytes(raw)
        outcome(read_everything_safetensors, path)
