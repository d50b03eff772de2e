"""Integrity manifests: every file the load reads is listed, checked, and parsed from the checked bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from poot_core import IntegrityError, LoadOptions, Manifest, ModelHandle


@pytest.fixture()
def checkpoint(tmp_path, tiny_checkpoint):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", torch.float32), target)
    return target


def test_manifest_round_trip_loads(checkpoint):
    manifest = Manifest.of(checkpoint)
    handle = ModelHandle.load(checkpoint, options=LoadOptions(integrity=manifest))
    assert "config.json" in handle.files_read and "tokenizer.json" in handle.files_read
    assert any(f.endswith(".safetensors") for f in handle.files_read)


def test_modified_tokenizer_fails_naming_the_file(checkpoint):
    manifest = Manifest.of(checkpoint)
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<|evil|>"
    (checkpoint / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(IntegrityError) as err:
        ModelHandle.load(checkpoint, options=LoadOptions(integrity=manifest))
    assert "tokenizer.json" in str(err.value)


def test_modified_weights_fail_before_any_tensor_is_read(checkpoint):
    manifest = Manifest.of(checkpoint)
    weights = checkpoint / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as err:
        ModelHandle.load(checkpoint, options=LoadOptions(integrity=manifest))
    assert "model.safetensors" in str(err.value)


def test_unlisted_file_is_refused(checkpoint):
    manifest = Manifest.of(checkpoint)
    files = {k: v for k, v in manifest.files.items() if k != "generation_config.json"}
    with pytest.raises(IntegrityError) as err:
        ModelHandle.load(checkpoint, options=LoadOptions(integrity=Manifest(files)))
    assert "generation_config.json" in str(err.value) and "does not list" in str(err.value)


def test_cli_writes_a_manifest_that_loads(checkpoint, tmp_path):
    out = subprocess.run([sys.executable, "-m", "poot_core.cli.main", "manifest", str(checkpoint)],
                         capture_output=True, text=True, check=True)
    path = tmp_path / "manifest.json"
    path.write_text(out.stdout)
    ModelHandle.load(checkpoint, options=LoadOptions(integrity=path))


def test_bad_manifest_is_typed():
    with pytest.raises(IntegrityError):
        Manifest.from_json('{"files": {"a": {"size": "x"}}}')
