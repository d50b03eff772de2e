"""Errors on the command line name the user's problem in one line: a truncated GGUF says which tensor or
metadata value lies past the end, a missing family says how to install it the way poot was installed, a bug
is one line unless its traceback is asked for, and Ctrl-C at any time (even while torch loads) exits 130
without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import smollm
from helpers.paths import ROOT
from poot_core.checkpoint.gguf_file import GGUFFile

SCRIPT = Path(sys.executable).parent / "poot"  # the console command users run
POOT = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "poot_cli"]


def poot(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*POOT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama", torch.float32))


@pytest.mark.parametrize("delay", [0.4, 0.8, 1.5, None])
def test_ctrl_c_while_starting_exits_130_without_a_traceback(model, delay):
    """While torch is imported (the first second or two), while the model loads, or as it generates (None: once
    the first piece is out; a fixed delay could fall after the end on a fast machine, where the 500 tokens take
    under a second). (The interpreter's own start, the first tenth of a second, is before any of poot's code
    runs.)"""
    proc = subprocess.Popen([*POOT, "generate", "-m", model, "--no-chat-template", "-p", "hi", "-n", "500",
                             "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if delay is None:
        assert proc.stdout is not None and proc.stdout.read(1)  # generating now
    else:
        time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def _truncated(tmp_path: Path, size: int) -> Path:
    source = smollm.gguf_path()
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(size))
    return cut


def test_a_gguf_cut_in_its_tensor_data_names_the_tensor_and_the_bytes(tmp_path):
    source = GGUFFile.open(smollm.gguf_path())
    last = max((source.tensor_info(n) for n in source.tensor_names()), key=lambda t: t.offset)
    size = last.offset + last.nbytes // 2
    out = poot("generate", "-m", str(_truncated(tmp_path, size)), "-p", "hi")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert (f"truncated GGUF: tensor {last.name!r} needs bytes {last.offset}..{last.offset + last.nbytes}, "
            f"the file has {size}") in out.stderr


def test_a_gguf_cut_in_its_vocabulary_names_the_metadata_value(tmp_path):
    out = poot("generate", "-m", str(_truncated(tmp_path, 200_000)), "-p", "hi")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert "truncated or corrupt GGUF: metadata value 'tokenizer.ggml." in out.stderr
    assert "the file has 200000" in out.stderr


def test_a_missing_family_names_the_plugin_to_install_from_this_checkout(model):
    out = poot("generate", "-m", model, "-p", "hi", env={"POOT_DISABLE_PLUGIN_AUTOLOAD": "1", "POOT_PLUGINS": "cpu"})
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert f"pip install {ROOT / 'plugins' / 'family_llama'}" in out.stderr
    assert "family_moe" not in out.stderr and "poot-family-llama" not in out.stderr


def test_a_bug_is_one_line_unless_the_traceback_is_asked_for(model, monkeypatch, capsys):
    from poot_core.cli import runtime
    from poot_core.cli.main import main

    def broken(*args, **kwargs):
        raise TypeError("something poot got wrong")

    monkeypatch.setattr(runtime, "load", broken)
    assert main(["generate", "-m", model, "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("poot generate: internal error: TypeError: something poot got wrong "
                           "(POOT_TRACEBACK=1 shows where)")
    monkeypatch.setenv("POOT_TRACEBACK", "1")
    assert main(["generate", "-m", model, "-p", "hi"]) == 1
    assert "Traceback" in capsys.readouterr().err
