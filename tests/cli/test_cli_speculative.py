"""`poot generate` with speculative decoding: -md/--model-draft, --lookup, --mtp, --draft-max, --draft-min.
The reply is the one without them; bad combinations are refused in one line before any tensor is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import moe, tiny
from poot_core import WeightStore
from poot_core.cli.main import main

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("mistral", torch.float32))


def _reply(capsys, *argv: str) -> dict:
    assert main(["generate", "--no-chat-template", "-p", PROMPT, "-n", "24", "-c", "128", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_reply_is_the_plain_reply(model, tiny_checkpoint, capsys):
    plain = _reply(capsys, "-m", model)
    lookup = _reply(capsys, "-m", model, "--lookup", "--draft-max", "4")
    drafted = _reply(capsys, "-m", model, "-md", str(tiny_checkpoint("qwen2", torch.float32)), "--draft-min", "2")
    for spec in (lookup, drafted):
        assert (spec["tokens"], spec["text"]) == (plain["tokens"], plain["text"])
        assert spec["timings"]["proposed"] > 0
    assert plain["timings"]["proposed"] == 0


@pytest.fixture()
def no_tensor_reads(monkeypatch):
    def refuse(self, name):
        raise AssertionError(f"tensor {name} read before the refusal")

    monkeypatch.setattr(WeightStore, "get", refuse)


def _refused(capsys, *argv: str) -> str:
    assert main(["generate", "-p", "hi", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_combinations_are_refused_before_tensors_are_read(model, tmp_path, capsys, no_tensor_reads):
    other = tmp_path / "other-vocabulary"
    shutil.copytree(model, other)
    tiny.save_tokenizer(other, vocab_size=320)  # same weights, a tokenizer with merges: other ids
    assert "tokenizer" in _refused(capsys, "-m", model, "-md", str(other))
    assert "no multi-token-prediction" in _refused(capsys, "-m", model, "--mtp", "2")
    assert "give one" in _refused(capsys, "-m", model, "--lookup", "-md", model)
    assert "give -md FILE, --lookup or --mtp" in _refused(capsys, "-m", model, "--draft-max", "4")
    assert "--draft-min" in _refused(capsys, "-m", model, "--lookup", "--draft-max", "2", "--draft-min", "3")
    assert "--draft-max must be >= 1" in _refused(capsys, "-m", model, "--lookup", "--draft-max", "0")
    assert "does not combine" in _refused(capsys, "-m", model, "--mtp", "1", "--draft-max", "2")
    assert "no such draft" in _refused(capsys, "-m", model, "-md", str(tmp_path / "absent.gguf"))


def test_mtp_on_a_checkpoint_with_part_of_a_nextn_layer(tmp_path, capsys, no_tensor_reads):
    path = moe.build(tmp_path / "v3", "deepseek_v3", torch.float32)  # nextn norms and eh_proj, no decoder layer
    capsys.readouterr()  # the builder's own progress output
    assert "lacks the nextn layer's weight" in _refused(capsys, "-m", str(path), "--mtp", "1")


def test_mtp_reply_is_the_plain_reply(tmp_path, capsys):
    path = moe.build(tmp_path / "v3", "deepseek_v3", torch.float32)
    moe.add_nextn_layer(path, tmp_path / "donor")  # a whole nextn layer
    capsys.readouterr()
    plain = _reply(capsys, "-m", str(path))
    spec = _reply(capsys, "-m", str(path), "--mtp", "2")
    assert (spec["tokens"], spec["text"]) == (plain["tokens"], plain["text"])
    assert spec["timings"]["proposed"] > 0
