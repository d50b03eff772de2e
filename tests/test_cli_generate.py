"""`poot generate`: flags, refusals before the checkpoint is read, streaming, conversation K/V reuse,
Ctrl-C and broken pipes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import smollm
from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor

POOT = [sys.executable, "-m", "poot_core.cli.main"]


def poot(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*POOT, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama", torch.float32))


@pytest.fixture()
def broken(tmp_path):
    """A 'checkpoint' that fails the moment anything reads it: refusals must come first."""
    (tmp_path / "config.json").write_text("{not json")
    return str(tmp_path)


@pytest.mark.parametrize("flags,words", [
    (["--chat-template", "chatml"], "not a jinja template"),
    (["--chat-template-file", "/no/such/file.jinja"], "cannot read"),
    (["--chat-template", "{% for m in messages %}"], "does not compile"),
    (["--no-chat-template", "--chat-template", "{{ x }}"], "does not combine"),
    (["--chat-template", "{{ x }}", "--chat-template-file", "f"], "do not combine"),
    (["--conversation", "--no-chat-template"], "needs a chat template"),
    (["-n", "-5"], "-n must be"),
])
def test_refusals_come_before_the_checkpoint_is_read(broken, flags, words):
    out = poot("generate", "-m", broken, "-p", "hi", *flags)
    assert out.returncode != 0
    assert words in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_conversation_needs_a_template(model, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    out = poot("generate", "-m", str(plain), "--conversation", stdin="hello\n")
    assert out.returncode != 0 and "ships none" in out.stderr


def test_prompt_that_does_not_fit_the_window_is_refused(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "hello world " * 40, "-n", "40", "-c", "48")
    assert out.returncode != 0 and "does not fit" in out.stderr


def test_greedy_output_streams_the_drivers_text(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "The capital of France is", "-n", "12",
               "--ignore-eos", "--backend", "cpu")
    assert out.returncode == 0, out.stderr
    handle = ModelHandle.load(model)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=512, prefill_chunk=256)).serve()
    expected = driver.generate(GenerateRequest(handle.text().encode("The capital of France is"), 12,
                                               ignore_eos=True)).text
    assert out.stdout == expected + "\n"
    assert re.search(r"prefill: \d+ tokens .* decode: \d+ tokens", out.stderr)  # timings on by default
    quiet = poot("generate", "-m", model, "--no-chat-template", "-p", "x", "-n", "2", "--no-show-timings")
    assert "decode:" not in quiet.stderr


def test_conversation_second_turn_prefills_only_its_own_tokens(model):
    out = poot("generate", "-m", model, "--conversation", "-p", "Hello there!", "-n", "6", "--ignore-eos", "-v",
               stdin="Tell me more.\n")
    assert out.returncode == 0, out.stderr
    turns = re.findall(r"turn: (\d+) prompt tokens, (\d+) reused from the cache, (\d+) prefilled", out.stderr)
    assert len(turns) == 2
    (p1, r1, f1), (p2, r2, f2) = [tuple(map(int, t)) for t in turns]
    assert r1 == 0 and f1 == p1
    assert r2 >= p1 and f2 == p2 - r2 and f2 < p2 - p1 + 8  # only the new turn (and the reply's end marker)


def test_sampling_flags_and_seed_repeat(model):
    args = ["generate", "-m", model, "--no-chat-template", "-p", "Once upon", "-n", "10", "--ignore-eos",
            "--temp", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.1",
            "-s", "42", "--no-show-timings"]
    a, b = poot(*args), poot(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_reverse_prompt_stops(model):
    full = poot("generate", "-m", model, "--no-chat-template", "-p", "Once", "-n", "16", "--ignore-eos",
                "--no-show-timings").stdout.rstrip("\n")
    assert len(full) > 4
    stop = full[2:4]
    cut = poot("generate", "-m", model, "--no-chat-template", "-p", "Once", "-n", "16", "--ignore-eos",
               "-r", stop, "--no-show-timings").stdout.rstrip("\n")
    assert cut == full[: full.index(stop)]


def test_named_absent_backend_is_refused(model):
    out = poot("generate", "-m", model, "-p", "x", "-n", "1", "--backend", "rocm")
    assert out.returncode != 0 and "rocm" in out.stderr


def test_broken_pipe_exits_quietly(model):
    cmd = " ".join([*POOT, "generate", "-m", model, "--no-chat-template", "-p", "'Once upon'", "-n", "200",
                    "--ignore-eos", "--no-show-timings", "|", "head", "-c", "1"])
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=300)
    err = out.stderr.decode(errors="replace")
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_ctrl_c_stops_cleanly_and_prints_timings():
    """A real model, so that generation is still running when the signal comes."""
    proc = subprocess.Popen([*POOT, "generate", "-m", str(smollm.gguf_path()), "--no-chat-template", "-p",
                             "Once upon a time", "-n", "1000", "-c", "2048", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    proc.stdout.read(1)  # generation has started
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "decode:" in err and "Traceback" not in err


def test_progress_bar_only_for_large_checkpoints_on_a_terminal(tmp_path):
    import io

    from poot_core.cli import progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    big = tmp_path / "model.gguf"
    with open(big, "wb") as f:
        f.truncate(progress.LARGE + 1)
    shown = Tty()
    assert progress.warm_with_progress(big, shown) and "loading [" in shown.getvalue()
    assert not progress.warm_with_progress(big, io.StringIO())  # not a terminal
    small = tmp_path / "small.gguf"
    small.write_bytes(b"x")
    assert not progress.warm_with_progress(small, Tty())
